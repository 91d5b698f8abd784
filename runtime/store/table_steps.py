"""TableSteps: the store's side of decode steps that find their experts on the device (TabledSlots).

A step publishes and holds the slot table (slot_table.py), runs against it, releases it, then
reports what it found, layer by layer: the experts on the device, and those it staged from the host
cache itself (`host_records`). The hold keeps every slot the table names as it is: reader and copy
jobs wait for the release, and on CUDA for the step's work to have run (transfers.py). Promotions
(StoreConfig.promote; off by default, since on the H200 their copies and bookkeeping cost more than
the hits bought) are prefetches: a staged expert the device policy now ranks above what it would
evict is loaded into a device slot in the background.
"""

from __future__ import annotations

import torch

from flashpack.runtime.experts import HostRecords
from flashpack.runtime.store.admission import Admission
from flashpack.runtime.store.budget import StorePlan
from flashpack.runtime.store.placement import Placement
from flashpack.runtime.store.stats import StoreStats
from flashpack.runtime.store.tiers import SlotPool


class TableSteps:
    def __init__(self, placement: Placement, admission: Admission, plan: StorePlan, device_pool: SlotPool,
                 host_pool: SlotPool, stats: StoreStats, top_k: int, promote: bool):
        self._placement, self._admission, self._stats = placement, admission, stats
        self._plan, self._device_pool, self._host_pool = plan, device_pool, host_pool
        self._top_k, self._promote = top_k, promote
        self._stride = plan.record_stride
        self._cuda = device_pool.device.type == "cuda"
        self._host_records: HostRecords | None = None

    def hold(self) -> torch.Tensor:
        """Publish the device slot table and hold its slots: none is overwritten until `release`, and
        on CUDA until the work enqueued before that has run."""
        return self._placement.hold_table()

    def release(self) -> None:
        """The work reading the held table's slots is enqueued (on the current stream)."""
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device_pool.device))
        self._placement.release_table(event)

    @property
    def host_records(self) -> HostRecords | None:
        """The host cache as a decode step stages records from it; None without staging rows."""
        if self._host_records is None and self._plan.staging_slots:
            host = self._host_pool
            base = min(host.chunks, key=torch.Tensor.data_ptr)
            offsets = [(host.slot(h).data_ptr() - base.data_ptr()) // 4 for h in range(host.slots)]
            first = self._plan.device_slots
            self._host_records = HostRecords(
                source=base.view(-1).view(torch.int32),
                offsets=torch.tensor(offsets, dtype=torch.int64, device=self._device_pool.device),
                staging=self._device_pool.tensor[first:first + self._plan.staging_slots].view(torch.int32),
                first_staging_slot=first, top_k=self._top_k,
            )
        return self._host_records

    def record(self, found: list[tuple[int, list[int], list[int], int]]) -> None:
        """Count what a decode step found, (layer, experts on the device, experts staged from the
        host cache, records staged for the layer but not used: predicted wrongly) for each layer,
        under one lock: as requests and hits (the eviction policies see them as they see requests),
        and feed the rebalancer; then the promotions."""
        placement, device_slots, host_slots = self._placement, self._placement.device_slots, self._placement.host_slots
        with placement.changed:
            if placement.closed:
                return
            for layer, experts, staged, unused in found:
                for expert in experts:
                    key = (layer, expert)
                    if key in device_slots:
                        device_slots.touch(key)
                    if placement.use_prefetch(key):
                        self._stats.bump(layer, prefetch_used=1)
                promote = []
                for expert in staged:
                    key = (layer, expert)
                    if key in host_slots:
                        host_slots.touch(key)
                    device_slots.policies[layer].note(key)
                    if self._promote and key not in device_slots and device_slots.worth_placing(key, layer):
                        promote.append(expert)
                self._stats.bump(layer, requests=len(experts) + len(staged), device_hits=len(experts),
                                 host_hits=len(staged), bytes_host_to_device=(len(staged) + unused) * self._stride)
                placement.rebalance(layer, len(experts), len(experts) + len(staged))
                self._admission.prefetch_locked(layer, promote)
