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

The store is composed of parts, each owning its state:

    placement   which record is where in both tiers, loads in flight, guesses; the one lock
    admission   places requests, prefetches and read-aheads, starts their loads, releases slots
    transfers   the reader threads (two lanes), the copy thread and stream: moves bytes, publishes
    steps       the slot table's hold and what decode steps found through it

A request larger than the layer's share of the pool (a prefill) streams: its hits first, then its
misses half the layer's share at a time, each chunk's loads started before the previous chunk is
handed out. A request for an expert already in flight joins it; disk reads for requests go ahead
of prefetch reads (lanes.py). A failed read or a corrupt record fails the requests waiting on it
with a FlashpackError naming layer and expert, and frees its slots; everything else goes on.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import closing

import torch

from flashpack.errors import FlashpackError
from flashpack.layout.pack import Pack
from flashpack.layout.records import PROJECTIONS, decode_record
from flashpack.runtime.experts import ExpertWeights, HostRecords
from flashpack.runtime.kernels.bank import ExpertBank
from flashpack.runtime.store.admission import Admission
from flashpack.runtime.store.budget import StorePlan, served_records
from flashpack.runtime.store.config import StoreConfig
from flashpack.runtime.store.handles import ExpertHandle
from flashpack.runtime.store.placement import Placement
from flashpack.runtime.store.prewarm import prewarm_store
from flashpack.runtime.store.slot_table import SlotTable
from flashpack.runtime.store.stats import StoreStats
from flashpack.runtime.store.table_steps import TableSteps
from flashpack.runtime.store.tiers import SlotPool
from flashpack.runtime.store.transfers import Transfers


class TieredStore:
    def __init__(
        self, pack: Pack, plan: StorePlan, config: StoreConfig = StoreConfig(), device: torch.device | str = "cpu",
        *, poison: bool = False, layers: list[int] | None = None,
    ):
        """`config`: policy, rebalance, promote, the reader's and the copies' settings (budgets and
        hot set are build_store's). `layers`: the layers whose experts it serves (default: every
        layer the pack has records for); the others take no share of the tiers. `poison`: fill the
        pools with NaN-scale bytes, so a slot read before its copy lands fails loudly (tests)."""
        self.pack, self.plan, self.config, self.device = pack, plan, config, torch.device(device)
        self.geometry = pack.manifest.geometry
        self.stride = pack.manifest.document["experts"]["record_stride"]
        if plan.record_stride != self.stride:
            raise ValueError(f"plan is for records of {plan.record_stride} bytes, the pack's are {self.stride}")
        records = served_records(pack, layers)
        self.layers = sorted({r.layer for r in records})
        self.top_k = pack.manifest.config.num_experts_per_tok
        self.stats = StoreStats()
        self._cuda = self.device.type == "cuda"
        self.device_pool = SlotPool(plan.device_slots + plan.staging_slots, self.stride, self.device, poison=poison)
        self.host_pool = SlotPool(plan.host_slots, self.stride, "cpu", host=True, pin=self._cuda, poison=poison)
        table = SlotTable(max(self.layers) + 1, pack.manifest.config.num_experts, self.device)
        self.placement = Placement(plan, self.layers, self.top_k, config.policy, config.rebalance, table, self.stats)
        self.transfers = Transfers(pack, sorted({r.file for r in records}), config, self.placement,
                                   self.device_pool, self.host_pool, self.stats)
        self.admission = Admission(self.placement, self.transfers, self.device_pool, self.stats, self.top_k,
                                   config.copy_on_requesting_thread)
        self.steps = TableSteps(self.placement, self.admission, plan, self.device_pool, self.host_pool,
                                self.stats, self.top_k, config.promote)
        self._bank: ExpertBank | None = None

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
        hits first, as a chunk of their own, then its misses half the layer's share at a time; each
        chunk's loads are started before the previous chunk is yielded, so reads and copies overlap
        the consumer's work (the first misses load while the consumer works on the hits). A
        chunk's slots are released when the consumer asks for the next chunk, or closes
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
        device_slots = self.placement.device_slots
        streaming = len(experts) > max(self.top_k, device_slots.capacity[layer])
        remaining = list(experts)
        if streaming:
            remaining.sort(key=lambda e: (layer, e) not in device_slots)  # resident first (a hint)
        # half the layer's share a chunk: the chunk computed and the one loading fit side by side,
        # and a prompt makes few round trips (each a lock, a copy job and thread hand-offs)
        misses = max(1, device_slots.capacity[layer] // 2) if streaming else None
        # the hits alone first: with the first misses in their chunk, the hits' kernels would wait for
        # those copies, and hits and misses filling the share would leave no room to stage the next
        # chunk, so the link would idle while the host issued the chunk and admitted the next
        first = 0 if streaming and (layer, remaining[0]) in device_slots else misses
        hits_before = self.stats.layer(layer).device_hits
        current: list[ExpertHandle] = []
        staged: list[ExpertHandle] = []
        try:
            while True:
                while not current and remaining:  # blocks for room (a release) when there is none
                    current, remaining = self.admission.request(layer, remaining, partial=True, max_misses=first)
                    first = misses
                if not current:
                    break
                if remaining:  # start the next chunk's loads, without waiting for room, first
                    staged, remaining = self.admission.request(layer, remaining, partial=True, max_misses=misses,
                                                               block=False)
                self._look_ahead(prefetch_after, read_ahead)
                prefetch_after = read_ahead = None
                self._await(current)
                yield current
                self.admission.release(current)
                current, staged = staged, []
        finally:
            self.admission.release(current)
            self.admission.release(staged)
        self.placement.streamed(layer, hits_before, len(experts), prefill=streaming)

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
                if self._cuda:
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
        return self.admission.prefetch(layer, experts)

    def read_ahead(self, layer: int, experts: list[int]) -> int:
        """Start reading the records of `experts` of `layer` that are only on disk into the host
        cache, for a layer expected after the next one; returns the reads started. A disk read takes
        about as long as a decode layer, so a guess one layer ahead often lands late; this one has
        two. Low priority, like prefetch: never blocks, takes no device slot, leaves the host-cache
        reserve, reads in the prefetch lane (a request that comes to wait for one moves it to the
        required lane). Counted as read_ahead_issued; a later load (a request or a prefetch) that takes the
        record from the host cache counts read_ahead_used, an eviction before that read_ahead_wasted."""
        return self.admission.read_ahead(layer, experts)

    def _look_ahead(self, prefetch_after: tuple[int, list[int]] | None,
                    read_ahead: tuple[int, list[int]] | None) -> None:
        if prefetch_after is not None:
            self.prefetch(*prefetch_after)
        if read_ahead is not None:
            self.read_ahead(*read_ahead)

    def _await(self, handles: list[ExpertHandle]) -> None:
        """Wait for every handle's load; raise the first failure (after waiting for the rest). On
        CUDA the current stream waits for each distinct copy event once (a prompt's chunk shares a
        few: one a copy job)."""
        start, failure = time.perf_counter(), None
        landed: dict[int, torch.cuda.Event] = {}
        try:
            for handle in handles:
                try:
                    event = handle.loaded()
                except FlashpackError as error:
                    failure = failure or error
                    continue
                if event is not None:
                    landed.setdefault(id(event), event)
            if landed:
                stream = torch.cuda.current_stream(self.device_pool.device)
                for event in landed.values():
                    stream.wait_event(event)
        finally:
            self.stats.add_time("wait_seconds", time.perf_counter() - start)
        if failure is not None:
            raise failure

    # ---- asynchronous API -------------------------------------------------------------------

    def request(self, layer: int, experts: Iterable[int]) -> list[ExpertHandle]:
        """Start loading `experts`; their slots stay pinned until `wait` or `release`.

        Raises FlashpackError when the layer cannot hold them all at once (use `fetch`)."""
        handles, _ = self.admission.request(layer, list(experts), partial=False)
        return handles

    def wait(self, handles: list[ExpertHandle]) -> dict[int, ExpertWeights]:
        """Block until every handle's copy landed; dequantise; release the slots."""
        try:
            self._await(handles)
            return {handle.expert: self._dequantize(handle, self.device_pool.slot(handle.slot)) for handle in handles}
        finally:
            self.admission.release(handles)

    def _dequantize(self, handle: ExpertHandle, raw: torch.Tensor) -> ExpertWeights:
        decoded = decode_record(self.geometry, raw[:self.geometry.length],
                                where=f"layer {handle.layer} expert {handle.expert}")
        return ExpertWeights(*(decoded.dequantize(p) for p in PROJECTIONS))

    # ---- decode steps through the slot table (TabledSlots, table_steps.py) ---------------------

    def hold_slot_table(self) -> torch.Tensor:
        """int32 [layers, experts]: where each expert is (runtime/experts.py's codes), its slots held
        until `release_slot_table` (on CUDA until the work enqueued before that has run)."""
        return self.steps.hold()

    def release_slot_table(self) -> None:
        self.steps.release()

    @property
    def host_records(self) -> HostRecords | None:
        return self.steps.host_records

    def record_step(self, found: list[tuple[int, list[int], list[int], int]]) -> None:
        """Count what a decode step found through the slot table (TableSteps.record)."""
        self.steps.record(found)

    # ---- pre-warming, lifecycle ---------------------------------------------------------------

    def prewarm(self, ranked: dict[int, list[int]], counts: dict[int, list[int]] | None = None) -> dict[str, int]:
        """Fill the device pool, then the host cache, with each layer's hottest experts.

        `ranked[layer]` lists experts hottest first. Host loads are read in runs of records that
        are contiguous on disk (a `--reorder`ed pack reads each layer's hot set sequentially).
        Returns how many records went to each tier."""
        return prewarm_store(self.admission, self.placement, self.stats, ranked, counts)

    def close(self) -> None:
        if self.placement.closed:
            return
        self.placement.close()
        self.transfers.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def check_budgets(self) -> None:
        """Assert the pools are the sizes the plan allowed and the bookkeeping is consistent."""
        assert self.device_pool.nbytes == self.plan.device_pool_bytes
        assert self.host_pool.nbytes == self.plan.host_pool_bytes
        self.placement.check()
