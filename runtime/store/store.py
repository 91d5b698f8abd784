"""TieredStore: the engine's expert source over a device slot pool, a pinned host cache and the pack.

    bank                                   the device pool as one ExpertBank (slot s = bank row s)
    stream(layer, experts) -> chunks       lists of ready handles (.expert, .slot) covering every
                                           expert once; the kernels read the bank rows in place
    prefetch(layer, experts) -> loads      start loading a layer expected next; never blocks
    read_ahead(layer, experts) -> reads    start reading disk-only records of a layer expected later
                                           into the host cache; never blocks
    fetch(layer, experts) -> {expert: ExpertWeights}   stream, dequantised (the plain path)
    request(layer, experts) -> handles     device hit: ready now; host hit: one copy in flight;
                                           miss: O_DIRECT read (reader threads) then a copy
    wait(handles) -> {expert: ExpertWeights}   blocks on the copies, dequantises, releases slots
    hold_slot_table() -> table, release_slot_table(), record_step(found)
                                           a decode step looks slots up on the device
                                           and counts what it used (table_steps.py)

A request larger than the layer's share of the pool (a prefill) streams: its hits first, then its
misses half the layer's share at a time, each chunk's loads started before the previous chunk is
handed out.

Residency (which key is where, pins, policies, per-layer capacity) lives in `Residency` objects
guarded by one lock; reader and copy threads only move bytes and then publish, under that lock,
that a slot is ready. A slot being loaded is pinned by its load, so it cannot be evicted before
it lands even when every request for it has gone. A request for an expert already in flight
joins it. Disk reads for requests go ahead of prefetch reads (lanes.py). Copies to the device run
on their own CUDA stream, enqueued by the calling thread for a decode layer's few records and by the
copy thread for a prompt's many; a slot is reused only after the compute that read it has finished
(an event recorded at release). A failed read or a corrupt record fails the requests waiting on it
with a FlashpackError naming layer and expert, and frees its slots; everything else goes on.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass

import torch

from flashpack.errors import FlashpackError
from flashpack.layout.pack import Pack
from flashpack.layout.records import PROJECTIONS, decode_record
from flashpack.runtime.experts import ExpertWeights, HostRecords
from flashpack.runtime.kernels.bank import ExpertBank
from flashpack.runtime.store.budget import StorePlan, served_records
from flashpack.runtime.store.capacity import GHOST_SIZE, REBALANCE_WINDOW, Rebalancer, even_split
from flashpack.runtime.store.lanes import ReadLanes
from flashpack.runtime.store.policy import DEFAULT_POLICY, make_policy
from flashpack.runtime.store.reader import RecordReader
from flashpack.runtime.store.residency import Entry, NoRoom, Residency
from flashpack.runtime.store.slot_table import SlotTable
from flashpack.runtime.store.stats import StoreStats
from flashpack.runtime.store.tiers import SlotPool
from flashpack.runtime.store.table_steps import TableSteps
from flashpack.runtime.store.transfers import Copy, TransferJobs

HOST = 0  # the host cache's single partition
WAIT_TIMEOUT_S = 600.0

# Whether a decode layer's host-cache copies (its request's and its prefetch's) are enqueued by the
# calling thread (_start_copies); False hands them to the copy thread as before session 12: the
# control bench/h200.sh's `copy-thread` stage benches.
COPY_ON_REQUESTING_THREAD = True


@dataclass
class ExpertHandle:
    """One requested expert: its device slot, ready now or once its copy lands."""

    layer: int
    expert: int
    slot: int
    source: str  # "device", "host", "disk" or "joined"
    _store: "TieredStore"
    _entry: Entry
    _future: Future | None = None
    _released: bool = False

    def ready(self) -> bool:
        """The load is done (on CUDA: its copy is enqueued; `wait` orders the stream after it)."""
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = WAIT_TIMEOUT_S) -> torch.Tensor:
        """The record's bytes in the device pool, uint8 [stride]; raises FlashpackError on failure.

        On CUDA the bytes are in place for work enqueued afterwards on the caller's current
        stream: that stream is made to wait for the copy (no host sync)."""
        if self._future is not None:
            self._future.result(timeout)
        landed = self._entry.landed
        if landed is not None:
            torch.cuda.current_stream(self._store.device).wait_event(landed)
        return self._store.device_pool.slot(self.slot)

    def release(self) -> None:
        self._store._release([self])


class TieredStore(TransferJobs, TableSteps):
    def __init__(
        self,
        pack: Pack,
        plan: StorePlan,
        device: torch.device | str = "cpu",
        policy: str = DEFAULT_POLICY,
        host_policy: str | None = None,
        verify_records: bool = True,
        reader_threads: int = 8,
        direct_io: bool = True,
        rebalance: bool = True,
        poison: bool = False,
        layers: list[int] | None = None,
        promote: bool = False,
    ):
        """`layers`: the layers whose experts it serves (default: every layer the pack has records
        for); the others take no share of the tiers. `promote`: a decode step's staged expert that
        now outranks what it would evict is loaded into a device slot (table_steps.py)."""
        self.pack, self.plan, self.device = pack, plan, torch.device(device)
        self.geometry = pack.manifest.geometry
        self.stride = pack.manifest.document["experts"]["record_stride"]
        if plan.record_stride != self.stride:
            raise ValueError(f"plan is for records of {plan.record_stride} bytes, the pack's are {self.stride}")
        records = served_records(pack, layers)
        self.layers = sorted({r.layer for r in records})
        self.top_k = pack.manifest.config.num_experts_per_tok
        self.verify_records, self.promote = verify_records, promote
        self.stats = StoreStats()
        cuda = self.device.type == "cuda"
        self.device_pool = SlotPool(plan.device_slots + plan.staging_slots, self.stride, self.device, poison=poison)
        self.host_pool = SlotPool(plan.host_slots, self.stride, "cpu", host=True, pin=cuda, poison=poison)
        self.device_slots = Residency(plan.device_slots, even_split(self.layers, plan.device_slots),
                                      lambda: make_policy(policy), ghost_size=GHOST_SIZE if rebalance else 0)
        self.host_slots = Residency(plan.host_slots, {HOST: plan.host_slots},
                                    lambda: make_policy(host_policy or policy))
        floor = min(self.top_k, plan.device_slots // len(self.layers))
        self.rebalancer = Rebalancer(floor=floor, window=REBALANCE_WINDOW * len(self.layers)) if rebalance else None
        self.reader = RecordReader(pack.root, sorted({r.file for r in records}), direct=direct_io,
                                   callers=reader_threads)
        self._readers = ReadLanes(reader_threads)
        # one copy thread, its own two lanes: a request's copies go ahead of prefetch copies queued
        # by the layer before (a through-store decode layer otherwise waits behind the guesses)
        self._copier = ReadLanes(1, name="flashpack-copy")
        self._lander = ThreadPoolExecutor(1, thread_name_prefix="flashpack-land") if cuda else None
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._slot_free_events: dict[int, torch.cuda.Event] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a slot was released or a load finished
        self._inflight: dict[tuple[int, int], Future] = {}  # device loads not yet ready
        self._host_loads: dict[tuple[int, int], Future] = {}  # host loads not yet ready
        self._verified: set[tuple[int, int]] = set()
        self._prefetched: set[tuple[int, int]] = set()  # placed by prefetch, no request used them yet
        self._read_ahead: set[tuple[int, int]] = set()  # host entries read ahead, no load took them yet
        self._landing = 0  # CUDA copies published whose host slot is not free yet
        self._slot_table = SlotTable(max(self.layers) + 1, pack.manifest.config.num_experts, self.device)
        self._table_held = False  # a step reading the published table is being enqueued
        self._table_read: torch.cuda.Event | None = None  # completes when the last such step has run
        self._host_records: HostRecords | None = None
        self._bank: ExpertBank | None = None
        self._closed = False

    # ---- the engine's calls ------------------------------------------------------------------

    @property
    def bank(self) -> ExpertBank:
        """The whole device pool as one ExpertBank: a handle's `slot` is its bank row. (No
        slot_table: experts come and go, so this is an ExpertSlots source, not ResidentSlots.)"""
        if self._bank is None:
            self._bank = ExpertBank.from_pool(self.device_pool.tensor, self.geometry)
        return self._bank

    def stream(
        self, layer: int, experts: list[int], prefetch_after: tuple[int, list[int]] | None = None,
        read_ahead: tuple[int, list[int]] | None = None,
    ) -> Iterator[list[ExpertHandle]]:
        """Ready handles for `experts` of `layer`, chunk by chunk, each expert once.

        A request that fits the layer's share is one chunk. A larger one (a prefill) yields its
        hits first, then its misses half the layer's share at a time; each chunk's loads are
        started before the previous chunk is yielded, so reads and copies overlap the consumer's
        work. A chunk's slots are released when the consumer asks for the next chunk, or closes
        the generator (use `contextlib.closing`, or let an exception end the loop): kernels
        reading them must be enqueued by then (on CUDA the release records an event on the
        current stream).
        `prefetch_after` (layer, experts): a prefetch started once the first chunk's loads are
        queued, before waiting for them, so a guess's disk reads and copies run while this layer's
        land, behind them in the lanes; `read_ahead` (layer, experts): `read_ahead` called then too.
        Counted like requests; raises FlashpackError naming layer and expert on a failed load."""
        if not experts:
            self._look_ahead(prefetch_after, read_ahead)
            return
        streaming = len(experts) > max(self.top_k, self.device_slots.capacity[layer])
        remaining = list(experts)
        if streaming:
            remaining.sort(key=lambda e: (layer, e) not in self.device_slots)  # resident first (a hint)
        # half the layer's share a chunk: the chunk computed and the one loading fit side by side,
        # and a prompt makes few round trips (each a lock, a copy job and thread hand-offs)
        misses = max(1, self.device_slots.capacity[layer] // 2) if streaming else None
        hits_before = self.stats.layer(layer).device_hits
        current: list[ExpertHandle] = []
        staged: list[ExpertHandle] = []
        try:
            while True:
                while not current and remaining:  # blocks for room (a release) when there is none
                    current, remaining = self._request(layer, remaining, partial=True, max_misses=misses)
                if not current:
                    break
                if remaining:  # start the next chunk's loads, without waiting for room, first
                    staged, remaining = self._request(layer, remaining, partial=True, max_misses=misses, block=False)
                self._look_ahead(prefetch_after, read_ahead)
                prefetch_after = read_ahead = None
                self._await(current)
                yield current
                self._release(current)
                current, staged = staged, []
        finally:
            self._release(current)
            self._release(staged)
        if self.rebalancer is not None:
            # decode-sized requests only: a prefill streams every expert through the layer's
            # slots, and its misses and ghost hits say nothing about the room decoding needs
            if not streaming:
                self._rebalance(layer, self.stats.layer(layer).device_hits - hits_before, len(experts))
            else:
                with self._lock:
                    self.device_slots.ghost_hits[layer] = 0

    def fetch(self, layer: int, experts: list[int]) -> dict[int, ExpertWeights]:
        """Dequantised weights of `experts` of `layer` (on the store's device)."""
        fetched: dict[int, ExpertWeights] = {}
        with closing(self.stream(layer, experts)) as chunks:
            for handles in chunks:
                for handle in handles:
                    fetched[handle.expert] = self._dequantize(handle, self.device_pool.slot(handle.slot))
        return fetched

    def load(self, layer: int, experts: list[int]) -> None:
        """Make `experts` resident on the device and wait until their bytes are there, without
        dequantising (what fetch moves, for benchmarks and warm-up); counted like fetch."""
        with closing(self.stream(layer, experts)) as chunks:
            for _ in chunks:
                if self._copy_stream is not None:
                    torch.cuda.current_stream(self.device).synchronize()

    def prefetch(self, layer: int, experts: list[int]) -> int:
        """Start loading `experts` of `layer` for a request expected soon; returns the loads started.

        Low priority: never blocks or waits for a slot; uses only the layer's own share of the
        pool (free slots within it, or its own unpinned entries evicted by policy), never a
        pinned entry; leaves a host-cache reserve for requests; its disk reads queue behind
        required reads. Host-cache hits start the copy at once. Resident or in-flight experts
        are skipped. Entries are unpinned once they land. Counted as prefetch_issued, not as
        requests; a later request that finds one counts prefetch_used, an eviction before that
        prefetch_wasted."""
        copies: list[Copy] = []
        try:
            with self._changed:
                return 0 if self._closed else self._place_prefetches(layer, experts, copies)
        finally:
            self._start_copies(copies, low=True)

    def _prefetch_locked(self, layer: int, experts: list[int]) -> int:
        """(under the lock: a decode step's promotions, table_steps.py) `prefetch`, its copies to
        the copy thread."""
        copies: list[Copy] = []
        try:
            return self._place_prefetches(layer, experts, copies)
        finally:
            self._submit_copies(copies, low=True)

    def _place_prefetches(self, layer: int, experts: list[int], copies: list[Copy]) -> int:
        started = from_disk = 0
        for expert in experts:
            key = (layer, expert)
            if key in self.device_slots:
                continue
            if key not in self.host_slots and not self._host_room_for_prefetch():
                continue  # a host-cache hit further on may still go
            try:
                slot, evicted = self.device_slots.place(key, layer, pin=True, seed=0.0, within_share=True,
                                                        count_ghost=False)
            except NoRoom:
                break  # the layer's share is full of pinned entries
            self._evicted_device(evicted)
            _, source = self._start_load(key, slot, copies, prefetch=True)
            self._prefetched.add(key)
            started, from_disk = started + 1, from_disk + (source == "disk")
        if started:
            self.stats.bump(layer, prefetch_issued=started, prefetch_from_disk=from_disk)
        return started

    def _host_room_for_prefetch(self) -> bool:
        """A prefetch disk read takes a host buffer only while `top_k` more stay available."""
        available = self.host_slots.free_slots + self.host_slots.unpinned(HOST)
        return available > min(self.top_k, self.host_slots.slots)

    def read_ahead(self, layer: int, experts: list[int]) -> int:
        """Start reading the records of `experts` of `layer` that are only on disk into the host
        cache, for a layer expected after the next one; returns the reads started. A disk read takes
        about as long as a decode layer, so a guess one layer ahead often lands late; this one has
        two. Low priority, like prefetch: never blocks, takes no device slot, leaves the host-cache
        reserve, reads in the prefetch lane (a request that comes to wait for one moves it to the
        required lane). Counted as read_ahead_issued; a later load (a request or a prefetch) that takes the
        record from the host cache counts read_ahead_used, an eviction before that read_ahead_wasted."""
        with self._changed:
            if self._closed:
                return 0
            started = 0
            for expert in experts:
                key = (layer, expert)
                if key in self.host_slots or key in self.device_slots:
                    continue
                if not self._host_room_for_prefetch():
                    break
                self._place_host(key, seed=0.0)
                self._host_loads[key] = Future()
                self._readers.submit(self._read_job, [key], low=True, key=key)
                self._read_ahead.add(key)
                started += 1
            if started:
                self.stats.bump(layer, read_ahead_issued=started)
            return started

    def _look_ahead(self, prefetch_after: tuple[int, list[int]] | None,
                    read_ahead: tuple[int, list[int]] | None) -> None:
        if prefetch_after is not None:
            self.prefetch(*prefetch_after)
        if read_ahead is not None:
            self.read_ahead(*read_ahead)

    def _await(self, handles: list[ExpertHandle]) -> None:
        """Wait for every handle's load; raise the first failure (after waiting for the rest)."""
        start, failure = time.perf_counter(), None
        try:
            for handle in handles:
                try:
                    handle.wait()
                except FlashpackError as error:
                    failure = failure or error
        finally:
            self.stats.add_time("wait_seconds", time.perf_counter() - start)
        if failure is not None:
            raise failure

    # ---- asynchronous API -------------------------------------------------------------------

    def request(self, layer: int, experts: Iterable[int]) -> list[ExpertHandle]:
        """Start loading `experts`; their slots stay pinned until `wait` or `release`.

        Raises FlashpackError when the layer cannot hold them all at once (use `fetch`)."""
        handles, left = self._request(layer, list(experts), partial=False)
        return handles

    def wait(self, handles: list[ExpertHandle]) -> dict[int, ExpertWeights]:
        """Block until every handle's copy landed; dequantise; release the slots."""
        try:
            self._await(handles)
            return {handle.expert: self._dequantize(handle, self.device_pool.slot(handle.slot)) for handle in handles}
        finally:
            self._release(handles)

    def _dequantize(self, handle: ExpertHandle, raw: torch.Tensor) -> ExpertWeights:
        decoded = decode_record(self.geometry, raw[:self.geometry.length],
                                where=f"layer {handle.layer} expert {handle.expert}")
        return ExpertWeights(*(decoded.dequantize(p) for p in PROJECTIONS))

    # ---- placing requests (under the lock) --------------------------------------------------

    def _request(
        self, layer: int, experts: list[int], partial: bool, prewarm: dict[int, float] | None = None,
        max_misses: int | None = None, block: bool = True,
    ):
        """Handles for a prefix of `experts` (all of them unless `partial` and the layer's slots
        run out, or `max_misses` experts not on the device were admitted), and the experts left
        over. `prewarm` ({expert: profile weight}) places them as pre-warming does: not counted
        as requests, policies seeded with the weights. `block=False` never waits for room: it
        may return no handles at all (staging the next chunk of a stream)."""
        if self._closed:
            raise FlashpackError("the expert store is closed")
        handles: list[ExpertHandle] = []
        copies: list[Copy] = []  # host-cache hits, copied as one batch (transfers.py)
        try:
            with self._changed:
                admitted = self._admit_prefix(layer, experts, partial, prewarm, max_misses, block, handles, copies)
        finally:  # loads placed are always started: a failed request may have joiners
            self._start_copies(copies, prewarm=prewarm is not None)
        return handles, experts[admitted:]

    def _start_copies(self, copies: list[Copy], prewarm: bool = False, low: bool = False) -> None:
        """(not under the lock) A request's or a prefetch's host-cache copies. A decode layer's few
        (up to top_k) are enqueued by the calling thread at once: handed to the copy thread, they
        waited for the GIL while this thread went on in Python (0.9-2.4 ms between a layer's expert
        ids and its first copy in run 27's 8/32 profile; bench/store_overhead.py on the H200 machine:
        1,286 us of store time a decode layer this way against 1,811); the copy stream runs them in
        the order they were enqueued, so a layer's own copies, started first, still go ahead of its
        guesses'. A prompt's chunks go to the copy thread, which enqueues them while this thread
        launches the chunk before's kernels."""
        if copies and len(copies) <= self.top_k and not prewarm and COPY_ON_REQUESTING_THREAD:
            batch = list(copies)
            copies.clear()
            self._copy_job(batch)
        else:
            self._submit_copies(copies, low=low, prewarm=prewarm)

    def _admit_prefix(
        self, layer: int, experts: list[int], partial: bool, prewarm: dict[int, float] | None,
        max_misses: int | None, block: bool, handles: list[ExpertHandle], copies: list[Copy],
    ) -> int:
        """(under the lock) `_request`'s placing: handles for `experts` in order into `handles`, their
        host-cache copies into `copies`; returns how many experts were taken."""
        tally: Counter = Counter()  # the request's counts, added to the stats once
        try:
            return self._admit_each(layer, experts, partial, prewarm, max_misses, block, handles, copies, tally)
        finally:
            if tally:
                self.stats.bump(layer, **tally)

    def _admit_each(
        self, layer: int, experts: list[int], partial: bool, prewarm: dict[int, float] | None,
        max_misses: int | None, block: bool, handles: list[ExpertHandle], copies: list[Copy], tally: Counter,
    ) -> int:
        index = misses = 0
        while index < len(experts):
            key = (layer, experts[index])
            miss = max_misses is not None and key not in self.device_slots
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
                if not (self._inflight or self._host_loads or self._landing or self._pins() > len(handles)):
                    self._unpin_all(handles)
                    raise FlashpackError(
                        f"layer {layer}: cannot hold {len(experts)} experts at once "
                        f"({self.device_slots.capacity[layer]} slots); use fetch()"
                    ) from None
                # loads in flight or other requests hold the slots: wait for a release, with this
                # request's copies started (a release may wait on them)
                self._submit_copies(copies, prewarm=prewarm is not None)
                if not self._changed.wait(WAIT_TIMEOUT_S):
                    self._unpin_all(handles)
                    raise FlashpackError(f"layer {layer}: timed out waiting for a free expert slot")
                continue
            index, misses = index + 1, misses + miss
        return index

    def _try_admit_anywhere(self, key: tuple[int, int], prewarm, handles: list[ExpertHandle],
                            copies: list[Copy], tally: Counter) -> bool:
        """A fetch that cannot place even one expert in its layer's share (the layer's slots are
        pinned by earlier requests) takes any unpinned slot rather than wait."""
        try:
            handles.append(self._admit(key, prewarm, copies, tally, limit=self.device_slots.slots))
        except NoRoom:
            return False
        return True

    def _pins(self) -> int:
        return sum(self.device_slots.pinned.values())

    def _unpin_all(self, handles: list[ExpertHandle]) -> None:
        for handle in handles:
            handle._released = True
            if self.device_slots.get((handle.layer, handle.expert)) is handle._entry:
                self.device_slots.unpin((handle.layer, handle.expert))

    def _admit(self, key: tuple[int, int], prewarm: dict[int, float] | None, copies: list[Copy], tally: Counter,
               limit: int | None = None) -> ExpertHandle:
        layer, expert = key
        entry = self.device_slots.get(key)
        count = tally.update if prewarm is None else (lambda **kw: None)
        seed = None if prewarm is None else prewarm.get(expert, 0.0)
        if entry is not None:
            self.device_slots.touch(key)
            self.device_slots.pin(key)
            if prewarm is None and key in self._prefetched:  # a prefetch guessed right
                self._prefetched.discard(key)
                count(prefetch_used=1)
                if key in self.host_slots:
                    self.host_slots.touch(key)  # the request its host entry was placed without
            if entry.ready:
                count(requests=1, device_hits=1)
                return ExpertHandle(layer, expert, entry.slot, "device", self, entry)
            count(requests=1, joined=1)
            self._readers.promote(key)  # a guess still queued for the disk: the request waits for it now
            return ExpertHandle(layer, expert, entry.slot, "joined", self, entry, self._inflight[key])
        if key not in self.host_slots and self.host_slots.free_slots == 0 and self.host_slots.unpinned(HOST) == 0:
            raise NoRoom("every host buffer is in use")  # checked before the device slot is taken
        slot, evicted = self.device_slots.place(key, layer, pin=True, limit=limit or self.top_k, seed=seed)
        self._evicted_device(evicted)
        entry = self.device_slots.get(key)
        self.device_slots.pin(key)  # the request's pin (place's is the load's)
        future, source = self._start_load(key, slot, copies, seed=seed, prewarm=prewarm is not None)
        if prewarm is not None:
            self.stats.bump(layer, prewarmed_device=1, **({"prewarmed_host": 1} if source == "disk" else {}))
        count(requests=1, **{"host_hits" if source == "host" else "disk_reads": 1})
        return ExpertHandle(layer, expert, slot, source, self, entry, future)

    def _start_load(
        self, key: tuple[int, int], slot: int, copies: list[Copy], seed: float | None = None, prewarm: bool = False,
        prefetch: bool = False,
    ) -> tuple[Future, str]:
        """Fill device slot `slot`, just placed for `key` and pinned by this load: a copy from the
        host cache when the record is there (added to `copies`, which the caller submits as one
        batch), a copy once its read lands when the host cache is being filled with it, else a
        disk read into a new host slot, then the copy. Returns the load's future and where it
        comes from ("host" or "disk"). A prefetch neither touches nor ranks host entries as a
        request would."""
        future: Future = Future()
        self._inflight[key] = future
        host_entry = self.host_slots.get(key)
        if host_entry is not None:
            if not prefetch:
                self.host_slots.touch(key)
            self.host_slots.pin(key)
            if key in self._read_ahead:
                self._read_ahead.discard(key)
                self.stats.bump(key[0], read_ahead_used=1)
            if host_entry.ready:
                copies.append(Copy(key, host_entry, slot, future))
            else:  # its read is in flight (pre-warming the host tier, or read ahead): copy when it lands
                copy = lambda load: self._copier.submit(  # noqa: E731
                    self._copy_job, [Copy(key, host_entry, slot, future)], load, prewarm, low=prefetch)
                self._host_loads[key].add_done_callback(copy)
                if not prefetch:
                    self._readers.promote(key)  # a read still queued as a guess: a request waits for it now
            return future, "host"
        self._place_host(key, seed=0.0 if prefetch else seed)
        self._host_loads[key] = Future()
        self._readers.submit(self._read_job, [key], (slot, future), prewarm, low=prefetch, key=key)
        return future, "disk"

    def _submit_copies(self, copies: list[Copy], low: bool = False, prewarm: bool = False) -> None:
        """Hand `copies` to the copy thread as one job (`low`: a prefetch's), and empty the list."""
        if copies:
            self._copier.submit(self._copy_job, list(copies), None, prewarm, low=low)
            copies.clear()

    def _evicted_device(self, key: tuple[int, int] | None) -> None:
        """Count a device eviction (a prefetch that no request used is wasted)."""
        if key is None:
            return
        self._refresh_table(key)
        self.stats.bump(key[0], evictions_device=1)
        if key in self._prefetched:
            self._prefetched.discard(key)
            self.stats.bump(key[0], prefetch_wasted=1)

    def _place_host(self, key: tuple[int, int], seed: float | None = None) -> int:
        host_slot, evicted = self.host_slots.place(key, HOST, pin=True, seed=seed)
        if evicted is not None:
            self._refresh_table(evicted)
            self.stats.bump(evicted[0], evictions_host=1)
            if evicted in self._read_ahead:
                self._read_ahead.discard(evicted)
                self.stats.bump(evicted[0], read_ahead_wasted=1)
        return host_slot

    def _release(self, handles: list[ExpertHandle]) -> None:
        """Unpin the handles' slots (each once), under one lock and one CUDA event: a decode layer
        releases its top-k together, and per-handle events and wake-ups cost more than the lookups."""
        handles = [handle for handle in handles if not handle._released]
        if not handles:
            return
        event = None
        if self._copy_stream is not None:  # the slots may be overwritten only after their readers ran
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        with self._changed:
            for handle in handles:
                handle._released = True
                key = (handle.layer, handle.expert)
                if self.device_slots.get(key) is handle._entry:
                    self.device_slots.unpin(key)
                    if event is not None:
                        self._slot_free_events[handle.slot] = event
            self._changed.notify_all()

    # ---- capacity, pre-warming, lifecycle ---------------------------------------------------

    def _rebalance(self, layer: int, hits: int, requests: int) -> None:
        with self._changed:
            self._rebalance_locked(layer, hits, requests)

    def _rebalance_locked(self, layer: int, hits: int, requests: int) -> None:
        ghosts, self.device_slots.ghost_hits[layer] = self.device_slots.ghost_hits[layer], 0
        self.rebalancer.record(layer, hits, requests, ghosts)
        if not self.rebalancer.due():
            return
        move = self.rebalancer.decide(self.device_slots.capacity)
        if move is not None:
            for key in self.device_slots.move_capacity(*move):
                self._evicted_device(key)

    def prewarm(self, ranked: dict[int, list[int]], counts: dict[int, list[int]] | None = None) -> dict[str, int]:
        """Fill the device pool, then the host cache, with each layer's hottest experts.

        `ranked[layer]` lists experts hottest first. Host loads are read in runs of records that
        are contiguous on disk (a `--reorder`ed pack reads each layer's hot set sequentially).
        Returns how many records went to each tier."""
        from flashpack.runtime.store.prewarm import prewarm_store

        return prewarm_store(self, ranked, counts)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._readers.shutdown(wait=True)
        self._copier.shutdown(wait=True)
        if self._lander is not None:
            self._lander.shutdown(wait=True)
        self.reader.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_budgets(self) -> None:
        """Assert the pools are the sizes the plan allowed and the bookkeeping is consistent."""
        assert self.device_pool.nbytes == self.plan.device_pool_bytes
        assert self.host_pool.nbytes == self.plan.host_pool_bytes
        with self._lock:
            self.device_slots.check()
            self.host_slots.check()
