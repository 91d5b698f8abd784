"""Per-layer capacity of the device pool: an even split at start, then moved as decoding goes.

Every `window` fetches the rebalancer scores each layer over that window (smoothed across
windows) and moves `step` slots from the layer that needs room least to the one that needs it
most. It never shrinks a layer below `floor` (top_k when the pool allows it: the layer then
always holds one token's experts). Moves are few and small on purpose: published offline tests
found rebalancing worth 0.4-2.9 % fewer misses, and fewer swaps per adaptation worth more
(LESSONS.md). Plain Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REBALANCE_WINDOW = 32  # fetches per layer between decisions (about 32 tokens of decode)
GHOST_SIZE = 4  # recently evicted keys remembered per layer for the "ghost" signal


def even_split(layers: list[int], slots: int) -> dict[int, int]:
    """`slots` over `layers` as evenly as integers allow (earlier layers get the remainder)."""
    base, extra = divmod(slots, len(layers))
    return {layer: base + (1 if index < extra else 0) for index, layer in enumerate(layers)}


@dataclass
class Rebalancer:
    """Moves `step` slots per decision between layers.

    signal "ghost" (default): a layer's gain from more room is its ghost hits, misses on keys it
    evicted recently (`Residency` keeps `ghost_size` of them per layer): hits it would have had
    with that many more slots. Slots go from the layer with the fewest ghost hits per request to
    the one with the most: marginal utility, which is what equalising misses needs.
    signal "hit-rate": from the highest hit rate to the lowest (the rule published by the
    sglang offload build). On traces whose layers differ in skew it moves slots towards uniform
    layers, where they buy little; bench/store.py measures both.
    """

    floor: int
    window: int = 512  # fetches between decisions
    step: int = 1  # slots moved per decision
    signal: str = "ghost"
    min_gap: float = 0.0  # score difference below which nothing moves
    smoothing: float = 0.5  # weight of the newest window in the smoothed scores
    _hits: dict[int, int] = field(default_factory=dict)
    _ghost_hits: dict[int, int] = field(default_factory=dict)
    _requests: dict[int, int] = field(default_factory=dict)
    _scores: dict[int, float] = field(default_factory=dict)
    _fetches: int = 0
    moves: int = 0

    def __post_init__(self) -> None:
        if self.signal not in ("ghost", "hit-rate"):
            raise ValueError(f"unknown rebalancing signal {self.signal!r}")
        if self.signal == "hit-rate" and self.min_gap == 0.0:
            self.min_gap = 0.05

    def record(self, layer: int, hits: int, requests: int, ghost_hits: int = 0) -> None:
        self._hits[layer] = self._hits.get(layer, 0) + hits
        self._ghost_hits[layer] = self._ghost_hits.get(layer, 0) + ghost_hits
        self._requests[layer] = self._requests.get(layer, 0) + requests
        self._fetches += 1

    def due(self) -> bool:
        return self._fetches >= self.window

    def decide(self, capacity: dict[int, int]) -> tuple[int, int, int] | None:
        """(donor, receiver, slots) for the window just closed, or None; resets the window."""
        for layer, requests in self._requests.items():
            if requests:
                # higher score = more in need of room
                if self.signal == "ghost":
                    score = self._ghost_hits.get(layer, 0) / requests
                else:
                    score = 1.0 - self._hits.get(layer, 0) / requests
                old = self._scores.get(layer, score)
                self._scores[layer] = self.smoothing * score + (1 - self.smoothing) * old
        active = set(self._requests)
        self._hits, self._ghost_hits, self._requests, self._fetches = {}, {}, {}, 0
        # a layer nobody asked for this window (an MTP layer in plain decoding) needs no room
        score = lambda layer: self._scores[layer] if layer in active else -1.0  # noqa: E731
        donors = [layer for layer in capacity if capacity[layer] - self.step >= self.floor]
        receivers = [layer for layer in capacity if layer in active]
        if not donors or not receivers:
            return None
        donor = min(donors, key=score)
        receiver = max(receivers, key=score)
        if donor == receiver or score(receiver) - score(donor) <= self.min_gap:
            return None
        self.moves += 1
        return donor, receiver, self.step
