"""ExpertHandle: one requested expert's device slot, ready now or once its copy lands.

The engine reads `layer`, `expert`, `slot` and `source`, waits and releases; the private fields are
admission.py's, which makes the handles and unpins their slots on release."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from flashpack.runtime.store.residency import Entry
from flashpack.runtime.store.tiers import SlotPool

WAIT_TIMEOUT_S = 600.0


@dataclass
class ExpertHandle:
    layer: int
    expert: int
    slot: int  # its row of the device pool (and of the store's ExpertBank)
    source: str  # "device", "host", "disk" or "joined"
    _pool: SlotPool  # the device pool
    _release: Callable[[list["ExpertHandle"]], None]  # the store's release of a batch of handles
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
        landed = self.loaded(timeout)
        if landed is not None:
            torch.cuda.current_stream(self._pool.device).wait_event(landed)
        return self._pool.slot(self.slot)

    def loaded(self, timeout: float | None = WAIT_TIMEOUT_S) -> torch.cuda.Event | None:
        """Wait until the load is done (on CUDA: its copy enqueued); the event work reading the slot
        must wait for (its copy landing), None where there is none. A batch's copies share one
        event, so a chunk of handles makes its stream wait once per batch, not once per handle."""
        if self._future is not None:
            self._future.result(timeout)
        return self._entry.landed

    def release(self) -> None:
        self._release([self])
