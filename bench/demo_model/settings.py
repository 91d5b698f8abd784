"""What one run of the bench reads and decodes: the full run (a few minutes on 2 cores) and --quick."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class BenchSettings:
    windows: int | None = 32  # held-out windows read, evenly spaced over the slice's 219 (None: all)
    window_length: int = 1024  # the trainer's
    unigram_train_files: int | None = None  # training files counted for the baseline (None: all 2,794)
    greedy_prompts: int = 8
    greedy_prompt_tokens: int = 64
    greedy_tokens: int = 32
    edit_prompts: int = 10
    plain_prompts: int = 8
    plain_prompt_tokens: int = 256
    lookup_tokens: int = 48  # greedy tokens decoded after each prompt-lookup prompt
    lookup_n_max: int = 3
    lookup_k: int = 4
    trace_prompts: int = 8
    trace_prompt_chars: int = 1200
    trace_tokens: int = 48
    capacities: tuple[int, ...] = (4, 8, 16)  # expert slots per layer, of 32
    synth_preset: str = "tiny"  # 8 layers, 32 experts top-4 of width 32, like the demo (hidden 64)
    synth_router_skew: float = 1.0  # synth's routing-popularity law, as the `small` preset uses
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


FULL = BenchSettings()
QUICK = replace(FULL, windows=2, unigram_train_files=100, greedy_prompts=2, greedy_tokens=8, edit_prompts=2,
                plain_prompts=2, lookup_tokens=12, trace_prompts=2, trace_tokens=8)
