"""The TieredStore's side of decode steps that find their experts on the device (TabledSlots).

A step publishes and holds the slot table (slot_table.py), runs against it, releases it, then
reports what it found, layer by layer: the experts on the device, and those it staged from the host
cache itself (`host_records`). The hold keeps every slot the table names as it is: reader and copy
jobs wait for the release, and on CUDA for the step's work to have run (transfers.py). Promotions
(when the store was built with `promote`; off by default, since on the H200 their copies and
bookkeeping cost more than the hits bought) are prefetches: a staged expert the device policy now
ranks above what it would evict is loaded into a device slot in the background.
"""

from __future__ import annotations

import torch

from flashpack.errors import FlashpackError
from flashpack.runtime.experts import HostRecords


class TableSteps:
    """Mixed into TieredStore; uses its pools, residency tables, lock, policies and stats."""

    def hold_slot_table(self) -> torch.Tensor:
        """Publish the device slot table (slot_table.py) and hold its slots: none is overwritten
        until `release_slot_table`, and on CUDA until the work enqueued before that has run."""
        with self._lock:
            if self._closed:
                raise FlashpackError("the expert store is closed")
            self._table_held = True
            return self._slot_table.publish()

    def _refresh_table(self, key: tuple[int, int]) -> None:
        """(under the lock) `key`'s slot-table code from its entries as they are now."""
        self._slot_table.refresh(key, self.device_slots.get(key), self.host_slots.get(key))

    @property
    def host_records(self) -> HostRecords | None:
        """The host cache as a decode step stages records from it (slot_table.py); None without
        staging rows."""
        if self._host_records is None and self.plan.staging_slots:
            base = min(self.host_pool.chunks, key=torch.Tensor.data_ptr)
            offsets = [(self.host_pool.slot(h).data_ptr() - base.data_ptr()) // 4 for h in range(self.host_pool.slots)]
            first = self.plan.device_slots
            self._host_records = HostRecords(
                source=base.view(-1).view(torch.int32),
                offsets=torch.tensor(offsets, dtype=torch.int64, device=self.device),
                staging=self.device_pool.tensor[first:first + self.plan.staging_slots].view(torch.int32),
                first_staging_slot=first, top_k=self.top_k,
            )
        return self._host_records

    def release_slot_table(self) -> None:
        """The work reading the held table's slots is enqueued (on the current stream)."""
        event = None
        if self._copy_stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        with self._changed:
            self._table_held, self._table_read = False, event
            self._changed.notify_all()

    def record_step(self, found: list[tuple[int, list[int], list[int], int]]) -> None:
        """Count what a decode step found through the slot table, (layer, experts on the device,
        experts staged from the host cache, records staged for the layer but not used: predicted
        wrongly) for each layer, under one lock: as requests and hits
        (the eviction policies see them as they see requests). With `promote`, a staged expert the
        device policy now ranks above what it would evict is loaded into a device slot in the
        background, as a prefetch (steps stage it until its copy lands)."""
        with self._changed:
            if self._closed:
                return
            for layer, experts, staged, unused in found:
                for expert in experts:
                    key = (layer, expert)
                    if key in self.device_slots:
                        self.device_slots.touch(key)
                    if key in self._prefetched:
                        self._prefetched.discard(key)
                        self.stats.bump(layer, prefetch_used=1)
                promote = []
                for expert in staged:
                    key = (layer, expert)
                    if key in self.host_slots:
                        self.host_slots.touch(key)
                    self.device_slots.policies[layer].note(key)
                    if self.promote and key not in self.device_slots and self.device_slots.worth_placing(key, layer):
                        promote.append(expert)
                self.stats.bump(layer, requests=len(experts) + len(staged), device_hits=len(experts),
                                host_hits=len(staged), bytes_host_to_device=(len(staged) + unused) * self.stride)
                if self.rebalancer is not None:
                    self._rebalance_locked(layer, len(experts), len(experts) + len(staged))
                self._prefetch_locked(layer, promote)
