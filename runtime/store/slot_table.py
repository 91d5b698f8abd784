"""Where each expert is, published to the device for decode steps that look it up there.

A decode step needs no host round trip when it finds its experts without asking the store: it
looks them up on the device (runtime/engine/decode_graphs.py) like a resident source's slot
table, runs the ones in the pinned host cache from staging rows it copies them into itself
(kernels.stage_records), and reports the experts it found nowhere, for the step to be redone
through the store. This table is the store's side of that, int32 [layers, experts], with the
codes runtime/experts.py defines (a device slot, a host slot, or on disk).

The store refreshes a key's code under its lock whenever one of its entries changes (a slot
filled, a copy landed, a slot evicted: placement.py), and `publish` copies a snapshot of the table
to the device before each such step that follows a refresh (the device table is only read there).
Only safe mistakes are possible. A device slot is named once its copy has landed (until then the
expert is staged from the host cache, so a step never waits for a copy in flight); an entry
cleared after the publish makes a miss, not a wrong read; and the store overwrites neither a
device slot nor a host slot until the step that read the table has run (TieredStore's
`hold_slot_table` and `release_slot_table`).
"""

from __future__ import annotations

import torch

from flashpack.runtime.experts import ON_DISK, host_code
from flashpack.runtime.store.residency import Entry


class SlotTable:
    def __init__(self, layers: int, experts: int, device: torch.device):
        cuda = device.type == "cuda"
        self.host = torch.full((layers, experts), ON_DISK, dtype=torch.int32)
        # refreshes write through a NumPy view of the same memory: 0.2 us an element where a tensor's
        # __setitem__ takes 5 (the 2-core development VM), and a prompt refreshes each of its hundreds
        # of records a layer a few times, under the store's lock
        self._codes = self.host.numpy()
        self.device = torch.full((layers, experts), ON_DISK, dtype=torch.int32, device=device)
        # the copy to the device reads a snapshot taken under the store's lock: a step sees one
        # state of the table, not one the store's threads edit while the copy runs
        self._snapshot = torch.empty_like(self.host, pin_memory=cuda)
        self._snapshot_read: torch.cuda.Event | None = None
        self._stale = True  # refreshed since the last publish

    def refresh(self, key: tuple[int, int], device: Entry | None, host: Entry | None) -> None:
        """Set `key`'s code from its entries in the device pool and the host cache (None: none
        there). A device slot counts once its copy has landed (`Entry.landed` is None again):
        until then the step stages the expert from the host cache, and never waits for a copy."""
        if device is not None and device.ready and device.landed is None:
            self._codes[key] = device.slot
        elif host is not None and host.ready:
            self._codes[key] = host_code(host.slot)
        else:
            self._codes[key] = ON_DISK
        self._stale = True

    def publish(self) -> torch.Tensor:
        """Copy the table to the device (on CUDA: on the current stream) if a refresh came since the
        last copy; returns the device table. Steady decode often changes nothing between steps, and
        each copy is host time before the step's first layer."""
        if not self._stale:
            return self.device
        self._stale = False
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
