"""Which key sits in which slot of one pool: the bookkeeping of a tier, free of torch.

A pool has a fixed number of slots. Keys are grouped into partitions (the device pool: one per
layer; the host cache: one for everything), each with a soft capacity; the capacities sum to the
slot count. A key is pinned while a read, a copy or a computation uses its slot: pinned keys are
never evicted. A partition may run over its capacity for a moment (the layer being computed needs
more than its share, or capacity was just moved away from it); the next placement in a partition
that is over its capacity evicts from it first, so shares converge back.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable

from flashpack.runtime.store.policy import EvictionPolicy

Key = Hashable


class NoRoom(Exception):
    """Every slot of the pool is pinned: the caller must wait for a release or ask for less."""


@dataclass
class Entry:
    slot: int
    partition: Hashable
    pins: int = 0  # requests using the slot, and the load filling it while that is in flight
    ready: bool = False  # False while its bytes are still being read or copied in
    landed: object = None  # a device copy's CUDA event while the copy may still be running


class Residency:
    def __init__(
        self, slots: int, capacities: dict[Hashable, int], policy: Callable[[], EvictionPolicy], ghost_size: int = 0,
    ):
        if sum(capacities.values()) != slots:
            raise ValueError(f"partition capacities sum to {sum(capacities.values())}, the pool has {slots} slots")
        self.slots = slots
        self.capacity = dict(capacities)
        self.entries: dict[Key, Entry] = {}
        self.count = {partition: 0 for partition in capacities}
        self.pinned = {partition: 0 for partition in capacities}  # keys with pins > 0
        self.policies = {partition: policy() for partition in capacities}
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first
        # ghosts: the last `ghost_size` keys each partition evicted; a placement of one is a
        # ghost hit, a miss that that much more room would have turned into a hit
        self.ghost_size = ghost_size
        self._ghosts: dict[Hashable, OrderedDict] = {partition: OrderedDict() for partition in capacities}
        self.ghost_hits = {partition: 0 for partition in capacities}

    def __contains__(self, key: Key) -> bool:
        return key in self.entries

    def get(self, key: Key) -> Entry | None:
        return self.entries.get(key)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def unpinned(self, partition: Hashable) -> int:
        """How many keys of `partition` could be evicted now."""
        return self.count[partition] - self.pinned[partition]

    def touch(self, key: Key) -> None:
        self.policies[self.entries[key].partition].touch(key)

    def place(
        self, key: Key, partition: Hashable, pin: bool = True, seed: float | None = None, limit: int = 0,
        within_share: bool = False, count_ghost: bool = True,
    ) -> tuple[int, Key | None]:
        """Give `key` a slot in `partition`, evicting one unpinned key if needed.

        A partition at its capacity evicts its own victim; one below it takes a free slot or
        reclaims one from a partition over its capacity. A partition whose own keys are all pinned
        may take other partitions' slots until it holds `limit` keys (the store passes top_k: a
        layer may always hold one token's experts). Returns (slot, evicted key or None); raises
        NoRoom otherwise. `seed` places the key as pre-warming does (a profile weight, no request).
        `within_share` (prefetching) never goes beyond the partition's capacity: no free slot past
        it, no slot of a partition within its own share. `count_ghost=False` places a recently
        evicted key without counting a ghost hit (a placement that was no miss).
        """
        if key in self.entries:
            raise KeyError(f"{key!r} is already resident")
        evicted = None
        if not (self._free and self.count[partition] < self.capacity[partition]):
            evicted = self._choose_victim(partition, limit, within_share)
        if self.ghost_size and self._ghosts[partition].pop(key, False) is None and count_ghost:
            self.ghost_hits[partition] += 1  # counted before this placement's eviction adds a ghost
        slot = self._evict(evicted) if evicted is not None else self._free.pop()
        self.entries[key] = Entry(slot, partition, pins=1 if pin else 0)
        self.count[partition] += 1
        self.pinned[partition] += 1 if pin else 0
        if seed is None:
            self.policies[partition].admit(key)
        else:
            self.policies[partition].seed(key, seed)
        return slot, evicted

    def worth_placing(self, key: Key, partition: Hashable) -> bool:
        """Whether `key` would take a free slot of `partition`'s share, or evict a key its policy
        ranks below it (a promotion that is no worse than what it replaces)."""
        if self._free and self.count[partition] < self.capacity[partition]:
            return True
        victim = self._victim_in(partition)
        return victim is not None and self.policies[partition].prefers(key, victim)

    def _choose_victim(self, partition: Hashable, limit: int, within_share: bool = False) -> Key | None:
        """A key to evict for a placement in `partition`, None to take a free slot, or NoRoom."""
        count, capacity = self.count[partition], self.capacity[partition]
        if count >= capacity:
            victim = self._victim_in(partition)
            if victim is not None:
                return victim
            if within_share:
                raise NoRoom(f"partition {partition!r}: its share of {capacity} slots is pinned")
        if self._free:
            return None
        if count >= max(capacity, limit):
            raise NoRoom(f"partition {partition!r}: all {count} of its slots are pinned")
        others = sorted((p for p in self.capacity if p != partition), key=lambda p: self.capacity[p] - self.count[p])
        for other in others:  # first those that hold more than their share
            if self.count[other] > self.capacity[other]:
                victim = self._victim_in(other)
                if victim is not None:
                    return victim
        if within_share:
            raise NoRoom(f"partition {partition!r}: no slot of its share is free")
        for other in [partition, *others]:
            victim = self._victim_in(other)
            if victim is not None:
                return victim
        raise NoRoom(f"all {self.slots} slots are pinned")

    def _evict(self, key: Key) -> int:
        partition = self.entries[key].partition
        slot = self._release(key)
        if self.ghost_size:
            ghosts = self._ghosts[partition]
            ghosts[key] = None
            if len(ghosts) > self.ghost_size:
                ghosts.popitem(last=False)
        return slot

    def _victim_in(self, partition: Hashable) -> Key | None:
        if self.count[partition] == self.pinned[partition]:
            return None
        return self.policies[partition].victim(lambda key: self.entries[key].pins == 0)

    def _release(self, key: Key) -> int:
        entry = self.entries.pop(key)
        self.count[entry.partition] -= 1
        self.pinned[entry.partition] -= 1 if entry.pins else 0
        self.policies[entry.partition].forget(key)
        return entry.slot

    def drop(self, key: Key) -> None:
        """Remove `key` (a failed read, or an eviction the caller decided); its slot becomes free."""
        self._free.append(self._release(key))

    def pin(self, key: Key) -> None:
        entry = self.entries[key]
        entry.pins += 1
        self.pinned[entry.partition] += 1 if entry.pins == 1 else 0

    def unpin(self, key: Key) -> None:
        entry = self.entries[key]
        if entry.pins <= 0:
            raise RuntimeError(f"{key!r} is not pinned")
        entry.pins -= 1
        if entry.pins == 0:
            self.pinned[entry.partition] -= 1
            self.policies[entry.partition].released(key)

    def move_capacity(self, donor: Hashable, receiver: Hashable, slots: int = 1) -> list[Key]:
        """Shift `slots` of capacity; evicts the donor's victims now when they are unpinned
        (returned), otherwise the donor shrinks lazily on its next placements."""
        if slots > self.capacity[donor]:
            raise ValueError(f"partition {donor!r} has only {self.capacity[donor]} slots")
        self.capacity[donor] -= slots
        self.capacity[receiver] += slots
        evicted = []
        while self.count[donor] > self.capacity[donor]:
            victim = self._victim_in(donor)
            if victim is None:
                break
            self._free.append(self._evict(victim))
            evicted.append(victim)
        return evicted

    def check(self) -> None:
        """Invariants (tests call this): slots unique and in range, counts agree."""
        used = [e.slot for e in self.entries.values()]
        assert len(used) + len(self._free) == self.slots, (len(used), len(self._free), self.slots)
        assert len(set(used) | set(self._free)) == self.slots
        assert all(0 <= s < self.slots for s in used)
        for partition, count in self.count.items():
            assert count == sum(1 for e in self.entries.values() if e.partition == partition)
            pinned = sum(1 for e in self.entries.values() if e.partition == partition and e.pins)
            assert self.pinned[partition] == pinned
        assert sum(self.capacity.values()) == self.slots
