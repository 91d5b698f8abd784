"""Where each expert is, published to the device for decode steps that look it up there.

A decode step needs no host round trip when it finds its experts without asking the store: it
looks them up on the device (runtime/model/decode_graphs.py) like a resident source's slot
table, runs the ones in the pinned host cache from staging rows it copies them into itself
(kernels.stage_records), and reports the experts it found nowhere, for the step to be redone
through the store. This table is the store's side of that, int32 [layers, experts], with the
codes runtime/experts.py defines (a device slot, a host slot, or on disk).

The store edits the host copy under its lock (a slot filled, a slot evicted) and `publish` copies
a snapshot of it to the device before each such step. Only safe mistakes are possible. A device
slot is named once its copy has landed (until then the expert is staged from the host cache, so
a step never waits for a copy in flight); an entry cleared after the publish makes a miss, not a
wrong read; and the store overwrites neither a device slot nor a host slot until the step that
read the table has run (TieredStore's `hold_slot_table` and `release_slot_table`).
"""

from __future__ import annotations

import torch

from flashpack.runtime.experts import ON_DISK, host_code


class SlotTable:
    def __init__(self, layers: int, experts: int, device: torch.device):
        cuda = device.type == "cuda"
        self.host = torch.full((layers, experts), ON_DISK, dtype=torch.int32)
        self.device = torch.full((layers, experts), ON_DISK, dtype=torch.int32, device=device)
        # the copy to the device reads a snapshot taken under the store's lock: a step sees one
        # state of the table, not one the store's threads edit while the copy runs
        self._snapshot = torch.empty_like(self.host, pin_memory=cuda)
        self._snapshot_read: torch.cuda.Event | None = None
        self._device_slots: dict[tuple[int, int], int] = {}
        self._host_slots: dict[tuple[int, int], int] = {}
        self._landing: dict[tuple[int, int], int] = {}  # device copies in flight: their slots

    def fill_device(self, key: tuple[int, int], slot: int, landing: bool = False) -> None:
        """`key`'s bytes are in device `slot`, or will be once `landed(key)` says so."""
        if landing:
            self._landing[key] = slot
            return
        self._device_slots[key] = slot
        self._update(key)

    def landed(self, key: tuple[int, int], slot: int) -> None:
        """`key`'s copy into device `slot` has completed (a stale call, for a slot the key has left
        since, changes nothing)."""
        if self._landing.get(key) == slot:
            self.fill_device(key, self._landing.pop(key))

    def clear_device(self, key: tuple[int, int]) -> None:
        """`key` is leaving its device slot: before the slot is given to another expert."""
        self._device_slots.pop(key, None)
        self._landing.pop(key, None)
        self._update(key)

    def fill_host(self, key: tuple[int, int], host_slot: int) -> None:
        """`key`'s bytes are in host slot `host_slot`."""
        self._host_slots[key] = host_slot
        self._update(key)

    def clear_host(self, key: tuple[int, int]) -> None:
        """`key` is leaving its host slot: before the slot is read over."""
        self._host_slots.pop(key, None)
        self._update(key)

    def _update(self, key: tuple[int, int]) -> None:
        if key in self._device_slots:
            self.host[key] = self._device_slots[key]
        elif key in self._host_slots:
            self.host[key] = host_code(self._host_slots[key])
        else:
            self.host[key] = ON_DISK

    def publish(self) -> torch.Tensor:
        """Copy the table to the device (on CUDA: on the current stream); returns the device table."""
        if not self.device.is_cuda:
            self.device.copy_(self.host)
            return self.device
        if self._snapshot_read is not None:
            self._snapshot_read.synchronize()  # the last publish's copy (long done after a step)
        self._snapshot.copy_(self.host)
        stream = torch.cuda.current_stream(self.device.device)
        self.device.copy_(self._snapshot, non_blocking=True)
        self._snapshot_read = torch.cuda.Event()
        self._snapshot_read.record(stream)
        return self.device
