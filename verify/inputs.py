"""The token sequences verify feeds both models: a prefill chunk, then teacher-forced decode tokens.

Every sequence is fixed before anything runs (decode tokens are the sequence's own continuation,
not sampled), so the reference can run layer-major and both sides see identical inputs.

The default sequences are random ids (seeded) sized from the config so every feature is exercised:
"past-budget" prefills more complete indexer blocks than the QSA budget keeps (block selection, the
incomplete tail, and decode steps that keep selecting), with EOS tokens inside (PLE n-grams restart
at a document boundary, twice in a row once); "eos-first" is short and opens with EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from flashpack.errors import FlashpackError
from flashpack.layout.model_config import TextConfig


@dataclass(frozen=True)
class Sequence:
    name: str
    prefill: tuple[int, ...]
    decode: tuple[int, ...]

    @property
    def steps(self) -> list[list[int]]:
        """What each forward call gets: the prefill chunk, then one decode token per call."""
        return [list(self.prefill)] + [[token] for token in self.decode]

    @property
    def length(self) -> int:
        return len(self.prefill) + len(self.decode)


def default_sequences(cfg: TextConfig, decode_tokens: int, seed: int = 0) -> list[Sequence]:
    gen = torch.Generator().manual_seed(seed)
    eos = cfg.eos_token_id

    def rand(n: int) -> list[int]:  # EOS only where placed on purpose
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
        return [i if i != eos else (i + 1) % cfg.vocab_size for i in ids]

    ratio = cfg.indexer_compress_ratio
    # budget + 3 blocks + a partial block: more complete blocks than the budget keeps, and a tail.
    long_prefill = cfg.indexer_budget + 3 * ratio + ratio // 2 + 1
    third = long_prefill // 3
    past_budget = rand(third) + _eos(cfg) + rand(third) + _eos(cfg) * 2 + rand(long_prefill - 2 * third - 3)
    eos_first = _eos(cfg) + rand(6) + _eos(cfg) + rand(3)
    return [
        Sequence(name, tuple(prefill), tuple(rand(decode_tokens)))
        for name, prefill in (("past-budget", past_budget), ("eos-first", eos_first))
    ]


def _eos(cfg: TextConfig) -> list[int]:
    return [cfg.eos_token_id] if cfg.eos_token_id >= 0 else []


def prompt_sequences(pack: Path, prompts: list[str], decode_tokens: int) -> list[Sequence]:
    """Tokenise `prompts` with the pack's tokenizer; each prompt's last `decode_tokens` tokens are decoded."""
    from flashpack.runtime.tokenizer import PackTokenizer

    tokenizer = PackTokenizer.load(pack)
    sequences = []
    for index, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt)
        if len(ids) <= decode_tokens:
            raise FlashpackError(
                f"prompt {index + 1} is {len(ids)} tokens; it needs more than --decode-tokens ({decode_tokens})"
            )
        split = len(ids) - decode_tokens
        sequences.append(Sequence(f"prompt-{index + 1}", tuple(ids[:split]), tuple(ids[split:])))
    return sequences


def check_sequences(cfg: TextConfig, sequences: list[Sequence]) -> None:
    """Refuse inputs the model cannot take, with one line each."""
    for seq in sequences:
        if seq.length > cfg.max_position_embeddings:
            raise FlashpackError(
                f"input {seq.name} is {seq.length} tokens, longer than the model's context "
                f"(max_position_embeddings {cfg.max_position_embeddings})"
            )
        bad = [t for t in (*seq.prefill, *seq.decode) if not 0 <= t < cfg.vocab_size]
        if bad:
            raise FlashpackError(f"input {seq.name} has token id {bad[0]} outside the vocabulary ({cfg.vocab_size})")
