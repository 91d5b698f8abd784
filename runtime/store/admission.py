"""Admission: placing requests, prefetches and read-aheads in the tiers, and starting their loads.

Under the placement's lock a request takes, expert by expert, a device hit (pinned, ready now),
joins a load already in flight, or places the expert in a device slot (evicting by policy) and
starts its load: a copy from the host cache when the record is there, else a disk read into a new
host slot and then the copy. The loads' copies from the host cache are started once the lock is
let go: a decode layer's few by the calling thread at once (handed to the copy thread, they waited
for the GIL while this thread went on in Python; bench/HISTORY.md), a prompt's many by the copy
thread, which enqueues them while this thread launches the chunk before's kernels
(StoreConfig.copy_on_requesting_thread). The copy stream runs copies in the order they were
enqueued, so a layer's own copies, started first, still go ahead of its guesses'.

Prefetches and read-aheads are guesses: they never block, take only free slots or unpinned ones of
their own layer's share, leave a host-cache reserve for requests, and read in the prefetch lane.
A slot is reused only after the compute that read it has finished (an event recorded at release).
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future

import torch

from flashpack.errors import FlashpackError
from flashpack.runtime.store.handles import WAIT_TIMEOUT_S, ExpertHandle
from flashpack.runtime.store.placement import HOST, Copy, Key, Placement
from flashpack.runtime.store.residency import NoRoom
from flashpack.runtime.store.stats import StoreStats
from flashpack.runtime.store.tiers import SlotPool
from flashpack.runtime.store.transfers import Transfers


class Admission:
    def __init__(self, placement: Placement, transfers: Transfers, device_pool: SlotPool, stats: StoreStats,
                 top_k: int, copy_on_requesting_thread: bool):
        self._device_pool = device_pool  # the handles' bytes
        self._release = self.release  # bound once: every handle holds it
        self._placement, self._transfers, self._stats = placement, transfers, stats
        # the placement's tables, looked up on every expert a request places
        self._device, self._host = placement.device_slots, placement.host_slots
        self._changed = placement.changed
        self._top_k = top_k
        self._copy_on_requesting_thread = copy_on_requesting_thread
        self._cuda = device_pool.device.type == "cuda"

    def request(
        self, layer: int, experts: list[int], partial: bool, prewarm: dict[int, float] | None = None,
        max_misses: int | None = None, block: bool = True,
    ) -> tuple[list[ExpertHandle], list[int]]:
        """Handles for a prefix of `experts` (all of them unless `partial` and the layer's slots
        run out, or `max_misses` experts not on the device were admitted), and the experts left
        over; their slots stay pinned until released. `prewarm` ({expert: profile weight}) places
        them as pre-warming does: not counted as requests, policies seeded with the weights.
        `block=False` never waits for room: it may return no handles at all (staging the next
        chunk of a stream). Raises FlashpackError when a whole request cannot be held at once."""
        if self._placement.closed:
            raise FlashpackError("the expert store is closed")
        handles: list[ExpertHandle] = []
        copies: list[Copy] = []  # host-cache hits, copied as one batch (transfers.py)
        try:
            with self._changed:
                admitted = self._admit_prefix(layer, experts, partial, prewarm, max_misses, block, handles, copies)
        finally:  # loads placed are always started: a failed request may have joiners
            self._start_copies(copies, prewarm=prewarm is not None)
        return handles, experts[admitted:]

    def prefetch(self, layer: int, experts: list[int]) -> int:
        """Start loading `experts` of `layer` for a request expected soon; returns the loads started
        (TieredStore.prefetch says how a guess is placed and counted)."""
        copies: list[Copy] = []
        try:
            with self._changed:
                return 0 if self._placement.closed else self._place_prefetches(layer, experts, copies)
        finally:
            self._start_copies(copies, low=True)

    def prefetch_locked(self, layer: int, experts: list[int]) -> int:
        """(under the lock: a decode step's promotions) `prefetch`, its copies to the copy thread."""
        copies: list[Copy] = []
        try:
            return self._place_prefetches(layer, experts, copies)
        finally:
            self._transfers.submit_copies(copies, low=True)

    def read_ahead(self, layer: int, experts: list[int]) -> int:
        """Start reading the disk-only records of `experts` into the host cache; returns the reads
        started (TieredStore.read_ahead)."""
        with self._changed:
            if self._placement.closed:
                return 0
            started = 0
            for expert in experts:
                key = (layer, expert)
                if key in self._host or key in self._device:
                    continue
                if not self._host_room_for_prefetch():
                    break
                self._placement.place_host(key, seed=0.0)
                self._transfers.read([key], guess=True)
                self._placement.mark_read_ahead(key)
                started += 1
            if started:
                self._stats.bump(layer, read_ahead_issued=started)
            return started

    def prewarm_host(self, keys: list[Key], weights: dict[Key, float]) -> list[Future]:
        """(pre-warming) Place `keys` not in the host cache yet there, in this order, seeded with
        their profile weights, and read them in runs of contiguous records; returns the reads."""
        placed = {}
        with self._changed:
            for key in keys:
                if key in self._host:
                    continue
                placed[key] = self._placement.place_host(key, seed=weights.get(key, 0.0))
                self._stats.bump(key[0], prewarmed_host=1)
        self._transfers.read_runs(list(placed))
        return list(placed.values())

    def release(self, handles: list[ExpertHandle]) -> None:
        """Unpin the handles' slots (each once), under one lock and one CUDA event: a decode layer
        releases its top-k together, and per-handle events and wake-ups cost more than the lookups."""
        handles = [handle for handle in handles if not handle._released]
        if not handles:
            return
        event = None
        if self._cuda:  # the slots may be overwritten only after their readers ran
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device_pool.device))
        with self._changed:
            for handle in handles:
                handle._released = True
                key = (handle.layer, handle.expert)
                if self._device.get(key) is handle._entry:
                    self._device.unpin(key)
                    if event is not None:
                        self._transfers.slot_freed(handle.slot, event)
            self._changed.notify_all()

    # ---- placing (under the lock) -------------------------------------------------------------

    def _start_copies(self, copies: list[Copy], prewarm: bool = False, low: bool = False) -> None:
        """(not under the lock) A request's or a prefetch's host-cache copies: up to top_k (a decode
        layer's) on this thread, unless the config hands them to the copy thread; more there."""
        if copies and len(copies) <= self._top_k and not prewarm and self._copy_on_requesting_thread:
            batch = list(copies)
            copies.clear()
            self._transfers.copy(batch)
        else:
            self._transfers.submit_copies(copies, low=low, prewarm=prewarm)

    def _admit_prefix(
        self, layer: int, experts: list[int], partial: bool, prewarm: dict[int, float] | None,
        max_misses: int | None, block: bool, handles: list[ExpertHandle], copies: list[Copy],
    ) -> int:
        """`request`'s placing: handles for `experts` in order into `handles`, their host-cache
        copies into `copies`; returns how many experts were taken."""
        tally: Counter = Counter()  # the request's counts, added to the stats once
        try:
            return self._admit_each(layer, experts, partial, prewarm, max_misses, block, handles, copies, tally)
        finally:
            if tally:
                self._stats.bump(layer, **tally)

    def _admit_each(
        self, layer: int, experts: list[int], partial: bool, prewarm: dict[int, float] | None,
        max_misses: int | None, block: bool, handles: list[ExpertHandle], copies: list[Copy], tally: Counter,
    ) -> int:
        index = misses = 0
        while index < len(experts):
            key = (layer, experts[index])
            miss = max_misses is not None and key not in self._device
            if miss and misses >= max_misses:
                break
            try:
                handles.append(self._admit(key, prewarm, copies, tally))
            except NoRoom:
                if (handles and partial) or not block:
                    break
                if partial and self._try_admit_anywhere(key, prewarm, handles, copies, tally):
                    index, misses = index + 1, misses + miss
                    continue
                if not (self._placement.busy() or self._pins() > len(handles)):
                    self._unpin_all(handles)
                    raise FlashpackError(
                        f"layer {layer}: cannot hold {len(experts)} experts at once "
                        f"({self._device.capacity[layer]} slots); use fetch()"
                    ) from None
                # loads in flight or other requests hold the slots: wait for a release, with this
                # request's copies started (a release may wait on them)
                self._transfers.submit_copies(copies, prewarm=prewarm is not None)
                if not self._changed.wait(WAIT_TIMEOUT_S):
                    self._unpin_all(handles)
                    raise FlashpackError(f"layer {layer}: timed out waiting for a free expert slot")
                continue
            index, misses = index + 1, misses + miss
        return index

    def _try_admit_anywhere(self, key: Key, prewarm, handles: list[ExpertHandle], copies: list[Copy],
                            tally: Counter) -> bool:
        """A fetch that cannot place even one expert in its layer's share (the layer's slots are
        pinned by earlier requests) takes any unpinned slot rather than wait."""
        try:
            handles.append(self._admit(key, prewarm, copies, tally, limit=self._device.slots))
        except NoRoom:
            return False
        return True

    def _pins(self) -> int:
        return sum(self._device.pinned.values())

    def _unpin_all(self, handles: list[ExpertHandle]) -> None:
        for handle in handles:
            handle._released = True
            if self._device.get((handle.layer, handle.expert)) is handle._entry:
                self._device.unpin((handle.layer, handle.expert))

    def _admit(self, key: Key, prewarm: dict[int, float] | None, copies: list[Copy], tally: Counter,
               limit: int | None = None) -> ExpertHandle:
        layer, expert = key
        entry = self._device.get(key)
        count = tally.update if prewarm is None else (lambda **kw: None)
        seed = None if prewarm is None else prewarm.get(expert, 0.0)
        if entry is not None:
            self._device.touch(key)
            self._device.pin(key)
            if prewarm is None and self._placement.use_prefetch(key):  # a prefetch guessed right
                count(prefetch_used=1)
                if key in self._host:
                    self._host.touch(key)  # the request its host entry was placed without
            if entry.ready:
                count(requests=1, device_hits=1)
                return ExpertHandle(layer, expert, entry.slot, "device", self._device_pool, self._release, entry)
            count(requests=1, joined=1)
            self._transfers.promote(key)  # a guess still queued for the disk: the request waits for it now
            return ExpertHandle(layer, expert, entry.slot, "joined", self._device_pool, self._release, entry,
                                self._placement.inflight[key])
        if key not in self._host and self._host.free_slots == 0 and self._host.unpinned(HOST) == 0:
            raise NoRoom("every host buffer is in use")  # checked before the device slot is taken
        slot, evicted = self._device.place(key, layer, pin=True, limit=limit or self._top_k, seed=seed)
        self._placement.evicted_device(evicted)
        entry = self._device.get(key)
        self._device.pin(key)  # the request's pin (place's is the load's)
        future, source = self._start_load(key, slot, copies, seed=seed, prewarm=prewarm is not None)
        if prewarm is not None:
            self._stats.bump(layer, prewarmed_device=1, **({"prewarmed_host": 1} if source == "disk" else {}))
        count(requests=1, **{"host_hits" if source == "host" else "disk_reads": 1})
        return ExpertHandle(layer, expert, slot, source, self._device_pool, self._release, entry, future)

    def _start_load(
        self, key: Key, slot: int, copies: list[Copy], seed: float | None = None, prewarm: bool = False,
        prefetch: bool = False,
    ) -> tuple[Future, str]:
        """Fill device slot `slot`, just placed for `key` and pinned by this load: a copy from the
        host cache when the record is there (added to `copies`, which the caller starts as one
        batch), a copy once its read lands when the host cache is being filled with it, else a
        disk read into a new host slot, then the copy. Returns the load's future and where it
        comes from ("host" or "disk"). A prefetch neither touches nor ranks host entries as a
        request would."""
        future: Future = Future()
        self._placement.inflight[key] = future
        host_entry = self._host.get(key)
        if host_entry is not None:
            if not prefetch:
                self._host.touch(key)
            self._host.pin(key)
            if self._placement.use_read_ahead(key):
                self._stats.bump(key[0], read_ahead_used=1)
            if host_entry.ready:
                copies.append(Copy(key, host_entry, slot, future))
            else:  # its read is in flight (pre-warming the host tier, or read ahead): copy when it lands
                self._transfers.copy_when_read(self._placement.host_loads[key], Copy(key, host_entry, slot, future),
                                               prewarm, low=prefetch)
                if not prefetch:
                    self._transfers.promote(key)  # a read still queued as a guess: a request waits for it now
            return future, "host"
        self._placement.place_host(key, seed=0.0 if prefetch else seed)
        self._transfers.read([key], (slot, future), prewarm, guess=prefetch)
        return future, "disk"

    def _place_prefetches(self, layer: int, experts: list[int], copies: list[Copy]) -> int:
        started = from_disk = 0
        for expert in experts:
            key = (layer, expert)
            if key in self._device:
                continue
            if key not in self._host and not self._host_room_for_prefetch():
                continue  # a host-cache hit further on may still go
            try:
                slot, evicted = self._device.place(key, layer, pin=True, seed=0.0, within_share=True,
                                                   count_ghost=False)
            except NoRoom:
                break  # the layer's share is full of pinned entries
            self._placement.evicted_device(evicted)
            _, source = self._start_load(key, slot, copies, prefetch=True)
            self._placement.mark_prefetched(key)
            started, from_disk = started + 1, from_disk + (source == "disk")
        if started:
            self._stats.bump(layer, prefetch_issued=started, prefetch_from_disk=from_disk)
        return started

    def _host_room_for_prefetch(self) -> bool:
        """A prefetch disk read takes a host buffer only while `top_k` more stay available."""
        available = self._host.free_slots + self._host.unpinned(HOST)
        return available > min(self._top_k, self._host.slots)
