"""Eviction policies: which resident expert of a partition leaves when a new one needs its slot.

A policy sees the requests of one partition (one layer of the device pool, or the whole host
cache) and, asked for a victim, names one of the resident keys the caller may evict (keys that
are pinned by a read or a computation in flight are skipped). Plain Python, no torch: the store
and the trace simulator use the very same objects.

    lru        least recently used
    lfu        least frequently used, counting every request since start (counts survive
               eviction, so a popular expert that was pushed out comes back with its history);
               ties go to the least recently used. The default: on skewed routing it misses less
               than LRU (bench: see the store's README table).
    lfu-decay  LFU whose counts halve every `half_life` requests: follows a workload that shifts
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Callable, Hashable, Iterable

from flashpack.errors import FlashpackError

Key = Hashable


class EvictionPolicy:
    name = "base"

    def admit(self, key: Key) -> None:
        """`key` became resident because it was requested (a miss)."""
        raise NotImplementedError

    def touch(self, key: Key) -> None:
        """`key` was requested and was resident (a hit)."""
        raise NotImplementedError

    def note(self, key: Key) -> None:
        """`key` was requested and served from elsewhere, not made resident here (history only)."""

    def prefers(self, key: Key, resident: Key) -> bool:
        """Whether `key` should take `resident`'s place (promoting an expert served elsewhere)."""
        return True

    def forget(self, key: Key) -> None:
        """`key` left the cache (evicted, moved or failed)."""
        raise NotImplementedError

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        """The resident key to evict among those `evictable` accepts, or None. A key it refuses
        may be passed over by later calls too, until `released` says it is evictable again."""
        raise NotImplementedError

    def released(self, key: Key) -> None:
        """`key`, which `evictable` may have refused, can be evicted again (its last pin went)."""

    def seed(self, key: Key, weight: float) -> None:
        """`key` was placed without a request (pre-warming). `weight` in [0, 1] is its popularity
        in the profile (1: the layer's hottest); callers seed coldest first."""
        self.admit(key)


class LRU(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # oldest first

    def admit(self, key: Key) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    touch = admit

    def forget(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        return next((key for key in self._order if evictable(key)), None)

    def seed(self, key: Key, weight: float) -> None:
        # Pre-warmed keys come coldest first, so the hottest is the most recent.
        self.admit(key)


class LFU(EvictionPolicy):
    name = "lfu"

    def __init__(self) -> None:
        self._counts: dict[Key, float] = {}  # every key ever requested: history survives eviction
        self._last: dict[Key, int] = {}  # resident keys -> tick of their last request
        self._heap: list[tuple[float, int, Key]] = []  # (count, tick, key); stale entries skipped
        # resident keys `victim` found pinned, out of the heap until `released`: a prompt streaming
        # a layer's experts pins the newest (least counted) keys, which every eviction would
        # otherwise pop and push back
        self._held: set[Key] = set()
        self._tick = 0

    def _bump(self, key: Key, amount: float = 1.0) -> None:
        self._count(key, amount)
        self._tick += 1
        self._last[key] = self._tick
        self._push(key)

    def _count(self, key: Key, amount: float) -> None:
        self._counts[key] = self._counts.get(key, 0.0) + amount

    def note(self, key: Key) -> None:
        self._count(key, 1.0)

    def prefers(self, key: Key, resident: Key) -> bool:
        return self.count(key) > self.count(resident)

    def _push(self, key: Key) -> None:
        heapq.heappush(self._heap, (self._counts[key], self._last[key], key))
        if len(self._heap) > 4 * len(self._last) + 64:  # drop stale entries now and then
            self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(self._counts[k], t, k) for k, t in self._last.items() if k not in self._held]
        heapq.heapify(self._heap)

    def admit(self, key: Key) -> None:
        self._bump(key)

    touch = admit

    def forget(self, key: Key) -> None:
        self._last.pop(key, None)
        self._held.discard(key)

    def victim(self, evictable: Callable[[Key], bool]) -> Key | None:
        """Least count, then least recent, among evictable residents: O(log n) amortised (a key
        met pinned leaves the heap until `released`)."""
        while self._heap:
            count, tick, key = self._heap[0]
            if self._last.get(key) != tick or self._counts.get(key) != count:
                heapq.heappop(self._heap)  # stale: the key was requested again or left
                continue
            if evictable(key):
                return key
            heapq.heappop(self._heap)
            self._held.add(key)
        return None

    def released(self, key: Key) -> None:
        if key in self._held:
            self._held.remove(key)
            if key in self._last:
                self._push(key)

    def seed(self, key: Key, weight: float) -> None:
        # A profile is a prior worth less than one request: it orders the pre-warmed keys among
        # themselves, and the first live request outweighs it, so a stale profile fades at once.
        self._tick += 1
        self._counts[key] = max(self._counts.get(key, 0.0), 0.5 * min(max(weight, 0.0), 1.0))
        self._last[key] = self._tick
        self._push(key)

    def count(self, key: Key) -> float:
        return self._counts.get(key, 0.0)


class DecayingLFU(LFU):
    """Counts weighted by 2^(t / half_life): the same order as halving every count each
    half_life requests, without touching every count; rescaled before floats overflow."""

    name = "lfu-decay"

    def __init__(self, half_life: int = 512) -> None:
        super().__init__()
        self._growth = 2.0 ** (1.0 / half_life)
        self._weight = 1.0

    def _count(self, key: Key, amount: float) -> None:
        self._weight *= self._growth
        if self._weight > 1e100:
            self._counts = {k: v / self._weight for k, v in self._counts.items()}
            self._weight = 1.0
            self._rebuild()
        super()._count(key, amount * self._weight)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRU, "lfu": LFU, "lfu-decay": DecayingLFU}
DEFAULT_POLICY = "lfu"


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise FlashpackError(f"unknown eviction policy {name!r}: choose one of {', '.join(POLICIES)}") from None


def policy_names(names: Iterable[str] | None = None) -> list[str]:
    names = list(names) if names else list(POLICIES)
    for name in names:
        if name not in POLICIES:
            raise FlashpackError(f"unknown eviction policy {name!r}: choose one of {', '.join(POLICIES)}")
    return names
