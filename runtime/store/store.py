"""TieredStore: the engine's ExpertFetcher over a device slot pool, a pinned host cache and the pack.

    request(layer, experts) -> handles     device hit: ready now; host hit: one copy in flight;
                                           miss: O_DIRECT read (reader threads) then a copy
    wait(handles) -> {expert: ExpertWeights}   blocks on the copies, dequantises, releases slots
    fetch(layer, experts) = wait(request(...)), in chunks when a prefill asks for more experts
                                           than the layer's share of the pool

Residency (which key is where, pins, policies, per-layer capacity) lives in `Residency` objects
guarded by one lock; reader and copy threads only move bytes and then publish, under that lock,
that a slot is ready. A request for an expert already in flight joins it. Copies to the device run
on their own CUDA stream; a slot is reused only after the compute that read it has finished (an
event recorded at release). A failed read or a corrupt record fails the requests waiting on it
with a FlashpackError naming layer and expert, and frees its slots; everything else goes on.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable

import torch

from flashpack.errors import FlashpackError
from flashpack.layout.pack import Pack
from flashpack.layout.records import PROJECTIONS, decode_record
from flashpack.runtime.experts import ExpertWeights
from flashpack.runtime.store.budget import StorePlan
from flashpack.runtime.store.capacity import GHOST_SIZE, REBALANCE_WINDOW, Rebalancer, even_split
from flashpack.runtime.store.policy import DEFAULT_POLICY, make_policy
from flashpack.runtime.store.reader import RecordReader
from flashpack.runtime.store.residency import Entry, NoRoom, Residency
from flashpack.runtime.store.stats import StoreStats
from flashpack.runtime.store.tiers import SlotPool
from flashpack.runtime.store.transfers import TransferJobs

HOST = 0  # the host cache's single partition
WAIT_TIMEOUT_S = 600.0


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
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = WAIT_TIMEOUT_S) -> torch.Tensor:
        """The record's bytes in the device pool, uint8 [stride]; raises FlashpackError on failure."""
        if self._future is not None:
            self._future.result(timeout)
        return self._store.device_pool.slot(self.slot)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._store._release(self)


class TieredStore(TransferJobs):
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
    ):
        self.pack, self.plan, self.device = pack, plan, torch.device(device)
        self.geometry = pack.manifest.geometry
        self.stride = pack.manifest.document["experts"]["record_stride"]
        if plan.record_stride != self.stride:
            raise ValueError(f"plan is for records of {plan.record_stride} bytes, the pack's are {self.stride}")
        records = pack.manifest.expert_records()
        self.layers = sorted({r.layer for r in records})
        self.top_k = pack.manifest.config.num_experts_per_tok
        self.verify_records = verify_records
        self.stats = StoreStats()
        cuda = self.device.type == "cuda"
        self.device_pool = SlotPool(plan.device_slots, self.stride, self.device, poison=poison)
        self.host_pool = SlotPool(plan.host_slots, self.stride, "cpu", host=True, pin=cuda, poison=poison)
        self.device_slots = Residency(plan.device_slots, even_split(self.layers, plan.device_slots),
                                      lambda: make_policy(policy), ghost_size=GHOST_SIZE if rebalance else 0)
        self.host_slots = Residency(plan.host_slots, {HOST: plan.host_slots},
                                    lambda: make_policy(host_policy or policy))
        floor = min(self.top_k, plan.device_slots // len(self.layers))
        self.rebalancer = Rebalancer(floor=floor, window=REBALANCE_WINDOW * len(self.layers)) if rebalance else None
        self.reader = RecordReader(pack.root, sorted({r.file for r in records}), direct=direct_io)
        self._readers = ThreadPoolExecutor(reader_threads, thread_name_prefix="flashpack-read")
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="flashpack-copy")
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._slot_free_events: dict[int, torch.cuda.Event] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a slot was released or a load finished
        self._inflight: dict[tuple[int, int], Future] = {}  # device loads not yet ready
        self._host_loads: dict[tuple[int, int], Future] = {}  # host loads not yet ready
        self._verified: set[tuple[int, int]] = set()
        self._closed = False

    # ---- the ExpertFetcher call -------------------------------------------------------------

    def fetch(self, layer: int, experts: list[int]) -> dict[int, ExpertWeights]:
        """Dequantised weights of `experts` of `layer` (on the store's device)."""
        fetched: dict[int, ExpertWeights] = {}
        self._in_chunks(layer, experts, lambda handles: fetched.update(self.wait(handles)))
        return fetched

    def load(self, layer: int, experts: list[int]) -> None:
        """Make `experts` resident on the device and wait for them, without dequantising (what
        fetch moves, for benchmarks and warm-up); counted like fetch."""
        self._in_chunks(layer, experts, self._wait_raw)

    def _in_chunks(self, layer: int, experts: list[int], consume) -> None:
        """Request what the layer can hold, consume it (which releases), repeat.

        A request larger than the layer's share (a prefill) takes its hits first, then streams
        its misses a few at a time: pinning a whole share's worth of cold experts at once would
        evict the layer's hot set, which decoding needs right after."""
        remaining = list(experts)
        before = self.stats.layer(layer).device_hits
        streaming = len(remaining) > max(self.top_k, self.device_slots.capacity[layer])
        if streaming:
            remaining.sort(key=lambda e: (layer, e) not in self.device_slots)  # resident first (a hint)
        misses = max(1, min(self.top_k, self.device_slots.capacity[layer] // 2)) if streaming else None
        while remaining:
            handles, remaining = self._request(layer, remaining, partial=True, max_misses=misses)
            consume(handles)
        if self.rebalancer is not None:
            # decode-sized requests only: a prefill streams every expert through the layer's
            # slots, and its misses and ghost hits say nothing about the room decoding needs
            if len(experts) <= max(self.top_k, self.device_slots.capacity[layer]):
                self._rebalance(layer, self.stats.layer(layer).device_hits - before, len(experts))
            else:
                with self._lock:
                    self.device_slots.ghost_hits[layer] = 0

    def _wait_raw(self, handles: list[ExpertHandle]) -> None:
        start, failure = time.perf_counter(), None
        try:
            for handle in handles:
                try:
                    handle.wait()
                except FlashpackError as error:
                    failure = failure or error
        finally:
            self.stats.add_time("wait_seconds", time.perf_counter() - start)
            for handle in handles:
                handle.release()
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
        fetched, failure, waited = {}, None, 0.0
        try:
            for handle in handles:
                start = time.perf_counter()
                try:
                    raw = handle.wait()
                except FlashpackError as error:
                    failure = failure or error
                    continue
                finally:
                    waited += time.perf_counter() - start
                fetched[handle.expert] = self._dequantize(handle, raw)
        finally:
            self.stats.add_time("wait_seconds", waited)
            for handle in handles:
                handle.release()
        if failure is not None:
            raise failure
        return fetched

    def _dequantize(self, handle: ExpertHandle, raw: torch.Tensor) -> ExpertWeights:
        decoded = decode_record(self.geometry, raw[:self.geometry.length],
                                where=f"layer {handle.layer} expert {handle.expert}")
        return ExpertWeights(*(decoded.dequantize(p) for p in PROJECTIONS))

    # ---- placing requests (under the lock) --------------------------------------------------

    def _request(
        self, layer: int, experts: list[int], partial: bool, prewarm: dict[int, float] | None = None,
        max_misses: int | None = None,
    ):
        """Handles for a prefix of `experts` (all of them unless `partial` and the layer's slots
        run out, or `max_misses` experts not on the device were admitted), and the experts left
        over. `prewarm` ({expert: profile weight}) places them as pre-warming does: not counted
        as requests, policies seeded with the weights."""
        if self._closed:
            raise FlashpackError("the expert store is closed")
        handles: list[ExpertHandle] = []
        with self._changed:
            index = admitted = 0
            while index < len(experts):
                key = (layer, experts[index])
                if max_misses is not None and key not in self.device_slots:
                    if admitted >= max_misses:
                        break
                    admitted += 1
                try:
                    handles.append(self._admit(key, prewarm))
                except NoRoom:
                    if handles and partial:
                        break
                    if partial and self._try_admit_anywhere(key, prewarm, handles):
                        index += 1
                        continue
                    if self._inflight or self._host_loads or self._pins() > len(handles):
                        # loads in flight or other requests hold the slots: wait for a release
                        if not self._changed.wait(WAIT_TIMEOUT_S):
                            self._unpin_all(handles)
                            raise FlashpackError(f"layer {layer}: timed out waiting for a free expert slot")
                        continue
                    self._unpin_all(handles)
                    raise FlashpackError(
                        f"layer {layer}: cannot hold {len(experts)} experts at once "
                        f"({self.device_slots.capacity[layer]} slots); use fetch()"
                    ) from None
                index += 1
        return handles, experts[index:]

    def _try_admit_anywhere(self, key: tuple[int, int], prewarm, handles: list[ExpertHandle]) -> bool:
        """A fetch that cannot place even one expert in its layer's share (the layer's slots are
        pinned by earlier requests, e.g. a prefetch) takes any unpinned slot rather than wait."""
        try:
            handles.append(self._admit(key, prewarm, limit=self.device_slots.slots))
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

    def _admit(self, key: tuple[int, int], prewarm: dict[int, float] | None, limit: int | None = None) -> ExpertHandle:
        layer, expert = key
        entry = self.device_slots.get(key)
        count = (lambda **kw: self.stats.bump(layer, **kw)) if prewarm is None else (lambda **kw: None)
        seed = None if prewarm is None else prewarm.get(expert, 0.0)
        if entry is not None:
            self.device_slots.touch(key)
            self.device_slots.pin(key)
            if entry.ready:
                count(requests=1, device_hits=1)
                return ExpertHandle(layer, expert, entry.slot, "device", self, entry)
            count(requests=1, joined=1)
            return ExpertHandle(layer, expert, entry.slot, "joined", self, entry, self._inflight[key])
        host_entry = self.host_slots.get(key)
        if host_entry is None and self.host_slots.free_slots == 0 and self.host_slots.unpinned(HOST) == 0:
            raise NoRoom("every host buffer is in use")  # checked before the device slot is taken
        slot, evicted = self.device_slots.place(key, layer, pin=True, limit=limit or self.top_k, seed=seed)
        if evicted is not None:
            self.stats.bump(evicted[0], evictions_device=1)
        entry = self.device_slots.get(key)
        future: Future = Future()
        self._inflight[key] = future
        if host_entry is not None:
            self.host_slots.touch(key)
            self.host_slots.pin(key)
            if prewarm is not None:
                self.stats.bump(layer, prewarmed_device=1)
            count(requests=1, host_hits=1)
            source = "host"
            if host_entry.ready:
                self._copier.submit(self._copy_job, key, host_entry, slot, future, None, prewarm is not None)
            else:  # its read is in flight (pre-warming the host tier): copy when it lands
                copy = lambda load: self._copier.submit(  # noqa: E731
                    self._copy_job, key, host_entry, slot, future, load, prewarm is not None)
                self._host_loads[key].add_done_callback(copy)
        else:
            self._place_host(key, seed=seed)
            host_entry = self.host_slots.get(key)
            if prewarm is not None:
                self.stats.bump(layer, prewarmed_device=1, prewarmed_host=1)
            count(requests=1, disk_reads=1)
            source = "disk"
            self._host_loads[key] = Future()
            self._readers.submit(self._read_job, [key], (slot, future), prewarm is not None)
        return ExpertHandle(layer, expert, slot, source, self, entry, future)

    def _place_host(self, key: tuple[int, int], seed: float | None = None) -> int:
        host_slot, evicted = self.host_slots.place(key, HOST, pin=True, seed=seed)
        if evicted is not None:
            self.stats.bump(evicted[0], evictions_host=1)
        return host_slot

    def _release(self, handle: ExpertHandle) -> None:
        key = (handle.layer, handle.expert)
        event = None
        if self._copy_stream is not None:  # the slot may be overwritten only after its readers ran
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        with self._changed:
            if self.device_slots.get(key) is handle._entry:
                self.device_slots.unpin(key)
                if event is not None:
                    self._slot_free_events[handle.slot] = event
            self._changed.notify_all()

    # ---- capacity, pre-warming, lifecycle ---------------------------------------------------

    def _rebalance(self, layer: int, hits: int, requests: int) -> None:
        with self._changed:
            ghosts, self.device_slots.ghost_hits[layer] = self.device_slots.ghost_hits[layer], 0
            self.rebalancer.record(layer, hits, requests, ghosts)
            if not self.rebalancer.due():
                return
            move = self.rebalancer.decide(self.device_slots.capacity)
            if move is not None:
                for key in self.device_slots.move_capacity(*move):
                    self.stats.bump(key[0], evictions_device=1)

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
