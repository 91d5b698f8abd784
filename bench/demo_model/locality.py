"""Routing locality and what it buys an expert cache.

Locality of a layer: over consecutive tokens t - 1, t of one sequence, the share of token t's
top-k experts that token t - 1 also used (|S_t & S_t-1| / k). Uniform random routing gives k / E.
It is measured two ways:

    prompt   per token, from Qwen4ExpModel.observe_routing over held-out windows (a trace keeps a
             prompt's experts as one set, so it cannot say which token used which)
    decode   from a routing trace (runtime/store/trace.py): consecutive decode steps of a request,
             each one token's experts

The traces are recorded and replayed with the code behind `flashpack trace record` and
`flashpack trace replay` (runtime/store/workload.py, simulate.py): decode steps only, every policy at a few
capacities against Belady's optimum, misses per decoded token.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.workload import run_workload
from flashpack.runtime.store.simulate import replay
from flashpack.runtime.store.trace import Trace

REPLAYED = ("lru", "lfu", "lfu-decay", "belady", "belady-global")


class PromptLocality:
    """An observe_routing observer: per layer, shared experts of consecutive positions."""

    def __init__(self, top_k: int):
        self.top_k = top_k
        self.shared: dict[int, float] = {}
        self.pairs: dict[int, int] = {}

    def __call__(self, layer: int, experts: torch.Tensor) -> None:
        """experts: int [T, k], one forward's positions in order (a forward starts a sequence or
        continues it; the bench gives each window a fresh state, so each call is its own)."""
        if experts.shape[0] < 2:
            return
        common = (experts[1:, :, None] == experts[:-1, None, :]).any(-1).sum().item()
        self.shared[layer] = self.shared.get(layer, 0.0) + common
        self.pairs[layer] = self.pairs.get(layer, 0) + experts.shape[0] - 1

    def result(self) -> dict:
        return summarise({layer: self.shared[layer] / (self.pairs[layer] * self.top_k) for layer in sorted(self.pairs)},
                         sum(self.pairs.values()) // max(len(self.pairs), 1))


def decode_locality(trace: Trace) -> dict:
    """Per layer over consecutive one-token steps (a prompt step starts a new request)."""
    shared: dict[int, int] = {}
    pairs: dict[int, int] = {}
    previous: dict[int, set[int]] | None = None
    for step in trace.steps:
        if step.tokens != 1:
            previous = None
            continue
        current = {layer: set(experts) for layer, experts in step.fetches}
        if previous is not None:
            for layer, experts in current.items():
                shared[layer] = shared.get(layer, 0) + len(experts & previous.get(layer, set()))
                pairs[layer] = pairs.get(layer, 0) + 1
        previous = current
    per_layer = {layer: shared[layer] / (pairs[layer] * trace.top_k) for layer in sorted(pairs)}
    return summarise(per_layer, sum(pairs.values()) // max(len(pairs), 1))


def summarise(per_layer: dict[int, float], pairs: int) -> dict:
    mean = sum(per_layer.values()) / len(per_layer) if per_layer else 0.0
    return {"per_layer": [per_layer[layer] for layer in sorted(per_layer)], "mean": mean, "pairs_per_layer": pairs}


def write_workload(path: Path, prompts: list[str], max_tokens: int) -> Path:
    """A `flashpack trace record` workload: one {"prompt", "max_tokens"} line a prompt."""
    path.write_text("".join(json.dumps({"prompt": text, "max_tokens": max_tokens}) + "\n" for text in prompts))
    return path


def trace_pack(pack: Path, workload: Path, out: Path, max_tokens: int) -> Trace:
    """`flashpack trace record PACK --workload F --out T` on the CPU in FP32 (its function,
    profile.record_trace, is run_workload and a save; called here without the progress bar)."""
    trace = run_workload(pack, workload, EngineConfig(dtype="float32"), max_tokens=max_tokens, progress=False)
    trace.save(out)
    return trace


def replay_misses(trace: Trace, capacities: list[int]) -> dict:
    """Decode misses per decoded token, {capacity: {policy: misses}} (`flashpack trace replay
    --decode-only --no-adaptive`)."""
    report = replay(trace, capacities, ["lru", "lfu", "lfu-decay"], adaptive=False, decode_only=True)
    per_token = {str(capacity): {policy: report.row(capacity, policy).total / max(report.tokens, 1)
                                 for policy in REPLAYED} for capacity in capacities}
    return {"decode_tokens": report.tokens, "misses_per_token": per_token}
