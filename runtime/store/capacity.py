"""Per-layer capacity of the device pool: an even split at start, then moved as decoding goes.

Every `window` fetches the rebalancer compares the layers' hit rates over that window (smoothed
across windows) and moves `step` slots from the layer with the highest hit rate to the one with
the lowest, when they differ by more than `min_gap`. It never shrinks a layer below `floor`
(top_k when the pool allows it: the layer then always holds one token's experts). Moves are few
and small on purpose: published offline tests found rebalancing worth 0.4-2.9 % fewer misses,
and fewer swaps per adaptation worth more (LESSONS.md). Plain Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def even_split(layers: list[int], slots: int) -> dict[int, int]:
    """`slots` over `layers` as evenly as integers allow (earlier layers get the remainder)."""
    base, extra = divmod(slots, len(layers))
    return {layer: base + (1 if index < extra else 0) for index, layer in enumerate(layers)}


def weighted_split(layers: list[int], slots: int, weights: dict[int, float], floor: int) -> dict[int, int]:
    """`slots` in proportion to `weights` (e.g. experts a hot set needs per layer), each >= floor."""
    floor = min(floor, slots // len(layers))
    spare = slots - floor * len(layers)
    total = sum(max(weights.get(layer, 0.0), 0.0) for layer in layers)
    if total <= 0:
        return even_split(layers, slots)
    shares = {layer: floor + int(spare * max(weights.get(layer, 0.0), 0.0) / total) for layer in layers}
    left = slots - sum(shares.values())
    for layer in sorted(layers, key=lambda l: -weights.get(l, 0.0))[:left]:
        shares[layer] += 1
    return shares


@dataclass
class Rebalancer:
    floor: int
    window: int = 512  # fetches between decisions
    step: int = 1  # slots moved per decision
    min_gap: float = 0.05  # hit-rate difference below which nothing moves
    smoothing: float = 0.5  # weight of the newest window in the smoothed rates
    _hits: dict[int, int] = field(default_factory=dict)
    _requests: dict[int, int] = field(default_factory=dict)
    _rates: dict[int, float] = field(default_factory=dict)
    _fetches: int = 0
    moves: int = 0

    def record(self, layer: int, hits: int, requests: int) -> None:
        self._hits[layer] = self._hits.get(layer, 0) + hits
        self._requests[layer] = self._requests.get(layer, 0) + requests
        self._fetches += 1

    def due(self) -> bool:
        return self._fetches >= self.window

    def decide(self, capacity: dict[int, int]) -> tuple[int, int, int] | None:
        """(donor, receiver, slots) for the window just closed, or None; resets the window."""
        for layer, requests in self._requests.items():
            if requests:
                rate = self._hits.get(layer, 0) / requests
                old = self._rates.get(layer, rate)
                self._rates[layer] = self.smoothing * rate + (1 - self.smoothing) * old
        self._hits, self._requests, self._fetches = {}, {}, 0
        rated = [layer for layer in capacity if layer in self._rates]
        donors = [layer for layer in rated if capacity[layer] - self.step >= self.floor]
        if not donors or len(rated) < 2:
            return None
        donor = max(donors, key=lambda layer: self._rates[layer])
        receiver = min(rated, key=lambda layer: self._rates[layer])
        if donor == receiver or self._rates[donor] - self._rates[receiver] <= self.min_gap:
            return None
        self.moves += 1
        return donor, receiver, self.step
