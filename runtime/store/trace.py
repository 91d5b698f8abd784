"""Routing traces: the sequence of expert requests a run made, per forward step and layer.

A trace is what the store sees: for each forward step (a prompt in prefill, one token in decode),
each layer's request for the experts its router picked, in order. `TraceRecorder` writes one down
as the engine runs; the simulator replays it through eviction policies and Belady's optimum.

File (JSON): {"format": "flashpack-trace", "version": 1, "num_experts", "top_k", "layers",
"record_stride", "meta": {...}, "steps": [{"tokens": T, "fetches": [[layer, [experts...]], ...]}]}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from flashpack.errors import FlashpackError

TRACE_FORMAT = "flashpack-trace"
TRACE_VERSION = 1


@dataclass
class Step:
    tokens: int  # tokens in this forward: the prompt length in prefill, 1 in decode
    fetches: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)


@dataclass
class Trace:
    num_experts: int
    top_k: int
    layers: list[int]
    record_stride: int = 0
    steps: list[Step] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def fetches(self, decode_only: bool = False) -> Iterator[tuple[int, tuple[int, ...]]]:
        for step in self.steps:
            if decode_only and step.tokens != 1:
                continue
            yield from step.fetches

    def tokens(self, decode_only: bool = False) -> int:
        return sum(s.tokens for s in self.steps if not decode_only or s.tokens == 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": TRACE_FORMAT, "version": TRACE_VERSION, "num_experts": self.num_experts,
            "top_k": self.top_k, "layers": self.layers, "record_stride": self.record_stride, "meta": self.meta,
            "steps": [{"tokens": step.tokens, "fetches": [[layer, list(e)] for layer, e in step.fetches]}
                      for step in self.steps],
        }

    def save(self, path: Path | str) -> Path:
        path = Path(path)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps(self.to_dict(), separators=(",", ":")))
        temporary.replace(path)
        return path

    @classmethod
    def load(cls, path: Path | str) -> "Trace":
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise FlashpackError(f"cannot read trace {path}: {error}") from None
        if doc.get("format") != TRACE_FORMAT or doc.get("version") != TRACE_VERSION:
            raise FlashpackError(f"{path} is not a flashpack trace (version {TRACE_VERSION})")
        steps = [Step(s["tokens"], [(int(layer), tuple(e)) for layer, e in s["fetches"]]) for s in doc["steps"]]
        return cls(doc["num_experts"], doc["top_k"], list(doc["layers"]), doc.get("record_stride", 0), steps,
                   doc.get("meta", {}))

    @classmethod
    def from_fetches(cls, fetches: list[tuple[int, list[int]]], num_experts: int, top_k: int) -> "Trace":
        """A decode trace from bare fetches, for tests and hand-made examples: a new one-token
        step starts whenever the layer does not increase."""
        steps: list[Step] = []
        for layer, experts in fetches:
            if not steps or layer <= steps[-1].fetches[-1][0]:
                steps.append(Step(1))
            steps[-1].fetches.append((layer, tuple(experts)))
        return cls(num_experts, top_k, sorted({layer for layer, _ in fetches}), steps=steps)


class TraceRecorder:
    """Records what every MoE block's router picked, as the requests a store sees: per layer the
    step's experts, ascending and unique (Qwen4ExpModel.observe_routing calls it with the ids
    [T, k]; reading them back syncs once a layer, fine for a profiling run).

    Call `begin_step(tokens)` before each forward (the profile runner does); routing before any
    step lands in a step of 0 tokens.
    """

    def __init__(self, trace: Trace):
        self.trace = trace

    def begin_step(self, tokens: int) -> None:
        self.trace.steps.append(Step(tokens))

    def __call__(self, layer: int, experts) -> None:
        """experts: a tensor of ids [T, k] (this module stays free of torch: the simulator uses it)."""
        if not self.trace.steps:
            self.begin_step(0)
        self.trace.steps[-1].fetches.append((layer, tuple(experts.unique().tolist())))
