"""Our engine, timed: prefill of the prompt (time to first token) and greedy decode, with the store's
counters taken apart per phase.

The engine's step is called directly (`engine.step.forward(tokens, state, last_only=True)`), so
no tokenizer or sampler work is timed; the first token is the argmax of the prefill's logits and
each decode step feeds the previous argmax. A warm-up (a prompt of other ids of the same length, so
every kernel the timed prompt needs is compiled for its shapes, and two decode steps) runs first,
untimed: it loads kernels, captures the decode graphs and leaves the store's caches as a server
would have them, partly warm; then the heap is frozen, as Engine.warm_up ends (EngineConfig.freeze_heap).
Every run uses one sequence state, reset in place and with room reserved for the longest run, so the
graphs captured in the warm-up are replayed. Every clock read
is preceded by a device synchronize. With several repeats, each starts a fresh sequence on the
same (warmer) store; times are the medians, store traffic the mean per token over all repeats.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from flashpack.runtime.bench.clock import BEFORE_LAYERS, BEFORE_LAYERS_HOST, LayerClock, median_seconds, synchronize
from flashpack.runtime.bench.phases import difference, phase_summary, snapshot

WARMUP_DECODE = 2


@dataclass
class EngineResult:
    prompt_tokens: int
    gen_tokens: int
    repeats: list[dict] = field(default_factory=list)  # per repeat: times, store deltas, tokens
    fixed_seconds: dict[str, float] = field(default_factory=dict)  # embedding + head, per phase

    @property
    def ttft_seconds(self) -> float:
        return statistics.median(r["ttft_s"] for r in self.repeats)

    @property
    def decode_seconds(self) -> float:
        """Median time of the whole decode phase (gen_tokens steps)."""
        return statistics.median(r["decode_seconds"] for r in self.repeats)

    @property
    def decode_layer_seconds(self) -> float | None:
        """The part of `decode_seconds` spent in the decoder layers (the device's time from the
        first layer's work to the last's, CUDA-graph decode only), or None."""
        each = self.decode_seconds_by_layer
        return None if each is None else sum(each.values())

    @property
    def decode_seconds_by_layer(self) -> dict[int, float] | None:
        """{layer: the part of `decode_seconds` spent in it} (a piece of several layers' graphs is
        timed as a whole, under its last layer), or None where the layers were not timed: each the
        median share of the repeats, so that it belongs to the median time it is a part of."""
        shares = self._median_shares()
        return None if shares is None else {key: seconds for key, seconds in shares.items() if isinstance(key, int)}

    @property
    def decode_seconds_before_layers(self) -> float | None:
        """The part of `decode_seconds` from a step's start to the device reaching its first layer
        (LayerClock.step): the host's work that the device waits through."""
        shares = self._median_shares()
        return None if shares is None else shares.get(BEFORE_LAYERS)

    @property
    def decode_host_seconds_before_layers(self) -> float | None:
        """The same span on the host's clock: where it is shorter than the device's, the device
        waited for work queued before the first layer, not for the host."""
        shares = self._median_shares()
        return None if shares is None else shares.get(BEFORE_LAYERS_HOST)

    def _median_shares(self) -> dict[int | str, float] | None:
        if any(r.get("decode_layer_seconds") is None for r in self.repeats):
            return None
        keys = self.repeats[0]["decode_layer_seconds"]
        return {key: self.decode_seconds * statistics.median(
            r["decode_layer_seconds"][key] / r["decode_seconds"] for r in self.repeats) for key in keys}

    def phase_store(self, phase: str) -> dict:
        deltas = [r[f"{phase}_counters"] for r in self.repeats]
        summed = {name: sum(d.get(name, 0) for d in deltas) for name in deltas[0]}
        tokens = (self.prompt_tokens if phase == "prefill" else self.gen_tokens) * len(self.repeats)
        return phase_summary(summed, tokens)

    def _table_steps(self) -> dict | None:
        """Decode steps tried from the store's slot table, those that stood (no expert missing), and
        how their experts were predicted and staged (step_report.StagingCounts)."""
        counts = [r["table_steps"] for r in self.repeats if r.get("table_steps") is not None]
        if not counts:
            return None
        return {name: sum(c[name] for c in counts) for name in counts[0]} | {"steps": self.gen_tokens * len(counts)}

    def to_dict(self) -> dict:
        ttft, decode = self.ttft_seconds, self.decode_seconds
        step_times = [t for r in self.repeats for t in r["step_seconds"]]
        return {
            "prefill": {
                "tokens": self.prompt_tokens, "ttft_s": ttft, "tokens_per_s": self.prompt_tokens / ttft,
                "store": self.phase_store("prefill"),
            },
            "decode": {
                "tokens": self.gen_tokens, "seconds": decode, "tokens_per_s": self.gen_tokens / decode,
                "layer_seconds": self.decode_layer_seconds,
                "layer_seconds_each": None if self.decode_seconds_by_layer is None else {
                    str(layer): seconds for layer, seconds in sorted(self.decode_seconds_by_layer.items())},
                "before_layers_seconds": self.decode_seconds_before_layers,
                "before_layers_host_seconds": self.decode_host_seconds_before_layers,
                "ms_per_token": 1000 * decode / self.gen_tokens,
                "ms_per_token_median_step": 1000 * statistics.median(step_times),
                "ms_per_token_max_step": 1000 * max(step_times),
                "store": self.phase_store("decode"),
                "steps_from_slot_table": self._table_steps(),
            },
            "fixed_seconds": self.fixed_seconds,
            "generated": self.repeats[0]["generated"],
            "repeats": [
                {"ttft_s": r["ttft_s"], "decode_seconds": r["decode_seconds"],
                 "decode_tokens_per_s": self.gen_tokens / r["decode_seconds"]}
                for r in self.repeats
            ],
        }


def greedy(step, state, tokens: torch.Tensor) -> tuple[int, torch.Tensor]:
    """One forward of `tokens`; (argmax of the last position, its logits)."""
    logits = step.forward(tokens, state, last_only=True).logits[-1]
    return int(logits.argmax()), logits


@torch.no_grad()
def warm_up(engine, state, prompt: list[int], decode: int = WARMUP_DECODE) -> None:
    step = engine.step
    state.restore(step.new_state())
    token, _ = greedy(step, state, torch.tensor(prompt, dtype=torch.long))
    for _ in range(decode):
        token, _ = greedy(step, state, torch.tensor([token]))
    synchronize(engine.model.device)
    engine.freeze_heap()  # as Engine.warm_up ends: what the warm-up built stays out of later collections


@torch.no_grad()
def timed_run(engine, state, prompt: list[int], gen: int, progress: bool = False) -> dict:
    step, store, device = engine.step, engine.store, engine.model.device
    state.restore(step.new_state())
    tokens = torch.tensor(prompt, dtype=torch.long)
    step.settle()
    before = snapshot(store)
    synchronize(device)
    start = time.perf_counter()
    token, _ = greedy(step, state, tokens)
    synchronize(device)
    ttft = time.perf_counter() - start
    step.settle()
    middle = snapshot(store)
    table_before = _table_counts(step.graphs)
    clock = LayerClock(device) if step.graphs is not None else None
    engine.time_layers(clock)
    generated, steps = [token], []
    try:
        for _ in tqdm(range(gen), desc="decode", unit="tok", disable=not progress, leave=False):
            start = time.perf_counter()
            if clock is not None:
                clock.step()
            token, _ = greedy(step, state, torch.tensor([token]))
            synchronize(device)
            steps.append(time.perf_counter() - start)
            generated.append(token)
    finally:
        engine.time_layers(None)
    step.settle()
    after = snapshot(store)
    table_after = _table_counts(step.graphs)
    return {
        "ttft_s": ttft, "decode_seconds": sum(steps), "step_seconds": steps, "generated": generated,
        "decode_layer_seconds": clock.take() if clock is not None else None,  # {layer: seconds}
        "prefill_counters": difference(before, middle), "decode_counters": difference(middle, after),
        "table_steps": None if table_after is None else {
            name: table_after[name] - table_before[name] for name in table_after},
    }


def _table_counts(graphs) -> dict[str, int] | None:
    """Steps tried from the store's slot table and steps that stood, with their StagingCounts, so
    far; None where no step runs from a slot table."""
    if graphs is None or graphs.speculation is None:
        return None
    return {"tried": graphs.speculation.tries, "stood": graphs.speculation.confirmed} | asdict(graphs.staging)


@torch.no_grad()
def fixed_seconds(model, prompt_len: int) -> dict[str, float]:
    """Time of what a forward does outside the decoder layers: embedding (and the repeat into hc
    streams) of the phase's tokens, then the final mixer and lm_head on the last position."""
    hc = model.config.hc_count

    def outside_layers(tokens: torch.Tensor):
        streams = model.embed(tokens).repeat(1, hc)
        return model.logits(streams[-1:])

    prompt = torch.zeros(prompt_len, dtype=torch.long, device=model.device)
    return {
        "prefill": median_seconds(lambda: outside_layers(prompt), model.device),
        "decode": median_seconds(lambda: outside_layers(prompt[:1]), model.device),
    }


def run_engine(engine, prompt: list[int], gen: int, warmup_prompt: list[int], repeats: int = 1,
               progress: bool = False) -> EngineResult:
    """Warm up, then `repeats` timed prefill + `gen` decode steps; `engine` is an Engine with a store."""
    state = engine.step.new_state()
    state.reserve(max(len(prompt), len(warmup_prompt)) + gen + 1)
    warm_up(engine, state, warmup_prompt)
    result = EngineResult(len(prompt), gen)
    for _ in tqdm(range(repeats), desc="repeats", disable=not progress or repeats == 1, leave=False):
        result.repeats.append(timed_run(engine, state, prompt, gen, progress))
    result.fixed_seconds = fixed_seconds(engine.model, len(prompt))
    return result
