"""Replay a routing trace through eviction policies and Belady's optimum; count misses per layer.

The cache model is the store's device tier: a pool of `capacity` slots per layer (or a shared
pool that the rebalancer re-partitions), every requested expert must be resident while its fetch
runs (the fetch's experts are pinned together when they fit, else streamed one at a time, as the
store does for a prefill that asks for more than a layer holds). A miss is one record read.

Belady's optimum evicts the resident expert whose next request is furthest in the future; for
requests that are sets, the current set is protected. It is the offline limit for a fixed
per-layer partition ("belady"); "belady-global" runs it on one pool shared by all layers, a limit
no partitioning beats. Plain Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from flashpack.runtime.store import capacity as _capacity
from flashpack.runtime.store.capacity import Rebalancer, even_split
from flashpack.runtime.store.policy import make_policy, policy_names
from flashpack.runtime.store.residency import NoRoom, Residency
from flashpack.runtime.store.trace import Trace

Fetch = tuple[int, tuple[int, ...]]
_NEVER = float("inf")


def simulate_policy(
    fetches: list[Fetch], layers: list[int], capacity: int, policy: str, adaptive: bool = False, floor: int = 1,
    signal: str = "ghost",
) -> dict[int, int]:
    """Misses per layer of `policy` with `capacity` slots per layer (shared and rebalanced if adaptive)."""
    rebalancer = Rebalancer(floor=min(floor, capacity), window=_capacity.REBALANCE_WINDOW * len(layers),
                            signal=signal) if adaptive else None
    pool = Residency(capacity * len(layers), even_split(layers, capacity * len(layers)), lambda: make_policy(policy),
                     ghost_size=_capacity.GHOST_SIZE if adaptive else 0)
    misses = {layer: 0 for layer in layers}
    for layer, experts in fetches:
        keep = len(experts) <= pool.capacity[layer]
        pinned, missing = [], []
        for expert in experts:
            key = (layer, expert)
            if key not in pool:
                missing.append(key)
                continue
            pool.touch(key)
            if keep:
                pool.pin(key)
                pinned.append(key)
        hits = len(experts) - len(missing)
        misses[layer] += len(missing)
        for key in missing:
            try:
                pool.place(key, layer, pin=keep)
            except NoRoom:  # more experts than slots: what is pinned so far was used, let it go
                for held in pinned:
                    pool.unpin(held)
                pinned.clear()
                pool.place(key, layer, pin=keep)
            if keep:
                pinned.append(key)
        for held in pinned:
            pool.unpin(held)
        if rebalancer is not None:
            ghosts, pool.ghost_hits[layer] = pool.ghost_hits[layer], 0
            if keep:  # decode-sized requests only, as the store does
                rebalancer.record(layer, hits, len(experts), ghosts)
            if rebalancer.due():
                move = rebalancer.decide(pool.capacity)
                if move:
                    pool.move_capacity(*move)
    return misses


def belady(fetches: list[Fetch], capacity: int, shared_layers: int = 0) -> dict[int, int]:
    """Misses per layer of the offline optimum: per layer with `capacity` slots each, or with
    `shared_layers` > 0, one pool of capacity * shared_layers slots for all layers."""
    if shared_layers:
        return _belady_sequence(fetches, capacity * shared_layers)
    by_layer: dict[int, list[Fetch]] = {}
    for fetch in fetches:
        by_layer.setdefault(fetch[0], []).append(fetch)
    misses: dict[int, int] = {}
    for layer, sequence in by_layer.items():
        misses.update(_belady_sequence(sequence, capacity))
    return misses


def _belady_sequence(fetches: list[Fetch], capacity: int) -> dict[int, int]:
    # next_use[i][key]: index of the next fetch after i that asks for key (inf if none)
    next_use: list[dict[tuple[int, int], float]] = [{} for _ in fetches]
    upcoming: dict[tuple[int, int], float] = {}
    for index in range(len(fetches) - 1, -1, -1):
        layer, experts = fetches[index]
        for expert in experts:
            next_use[index][(layer, expert)] = upcoming.get((layer, expert), _NEVER)
        for expert in experts:
            upcoming[(layer, expert)] = index
    resident: dict[tuple[int, int], float] = {}  # key -> its next request
    misses: dict[int, int] = {}
    for index, (layer, experts) in enumerate(fetches):
        misses.setdefault(layer, 0)
        keys = [(layer, expert) for expert in experts]
        protected = set(keys) if len(keys) <= capacity else set()
        for key in keys:
            if key in resident:
                resident[key] = next_use[index][key]
        for key in keys:
            if key in resident:
                continue
            misses[layer] += 1
            if len(resident) >= capacity:
                victim = max((k for k in resident if k not in protected), key=lambda k: resident[k])
                del resident[victim]
            resident[key] = next_use[index][key]
    return misses


@dataclass
class ReplayRow:
    capacity: int  # slots per layer
    policy: str  # a policy name, "<policy>+adaptive", "belady" or "belady-global"
    misses: dict[int, int]
    tokens: int
    record_stride: int = 0

    @property
    def total(self) -> int:
        return sum(self.misses.values())

    def to_dict(self) -> dict:
        per_token = self.total / self.tokens if self.tokens else 0.0
        return {"capacity": self.capacity, "policy": self.policy, "misses": self.total,
                "misses_per_token": per_token, "bytes_per_token": per_token * self.record_stride,
                "misses_per_layer": {str(layer): m for layer, m in sorted(self.misses.items())}}


@dataclass
class ReplayReport:
    tokens: int
    requests: int
    rows: list[ReplayRow] = field(default_factory=list)

    def row(self, capacity: int, policy: str) -> ReplayRow:
        return next(r for r in self.rows if r.capacity == capacity and r.policy == policy)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "requests": self.requests, "rows": [r.to_dict() for r in self.rows]}

    def table(self) -> str:
        """Markdown: misses per token per (capacity, policy), and the ratio to Belady."""
        lines = ["| slots/layer | policy | misses | misses/token | vs Belady |", "| --- | --- | --- | --- | --- |"]
        for row in self.rows:
            best = self.row(row.capacity, "belady").total
            ratio = f"{row.total / best:.3f}" if best else "-"
            per_token = row.total / row.tokens if row.tokens else 0.0
            lines.append(f"| {row.capacity} | {row.policy} | {row.total} | {per_token:.2f} | {ratio} |")
        return "\n".join(lines)


def replay(
    trace: Trace, capacities: Iterable[int], policies: Iterable[str] | None = None, adaptive: bool = True,
    decode_only: bool = False,
) -> ReplayReport:
    """Every policy (fixed per-layer split, and rebalanced when `adaptive`) and Belady per capacity."""
    fetches = list(trace.fetches(decode_only))
    tokens = trace.tokens(decode_only)
    layers = trace.layers or sorted({layer for layer, _ in fetches})
    report = ReplayReport(tokens, sum(len(e) for _, e in fetches))
    for capacity in capacities:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 slot per layer, got {capacity}")
        add = lambda name, misses: report.rows.append(ReplayRow(capacity, name, misses, tokens, trace.record_stride))  # noqa: E731
        for name in policy_names(policies):
            add(name, simulate_policy(fetches, layers, capacity, name))
            if adaptive and len(layers) > 1:
                add(f"{name}+adaptive", simulate_policy(fetches, layers, capacity, name, adaptive=True,
                                                        floor=trace.top_k))
        add("belady", belady(fetches, capacity))
        add("belady-global", belady(fetches, capacity, shared_layers=len(layers)))
    return report


def replay_trace(
    trace_path, capacities: Iterable[int], policies: Iterable[str] | None = None, adaptive: bool = True,
    decode_only: bool = False,
) -> ReplayReport:
    """`flashpack trace replay`: load a trace file and replay it (see `replay`)."""
    return replay(Trace.load(trace_path), capacities, policies, adaptive, decode_only)
