"""The memory of the tiers: fixed pools of record-sized slots, allocated once at start.

`SlotPool` is `slots` x `stride` bytes on one device: the device pool in GPU memory (a plain
tensor on CPU, so CI runs the same logic), the host cache in pinned, page-aligned RAM that
O_DIRECT reads land in. Pools never grow: the bytes a tier may use are fixed when the store is
built, which is how budgets are kept. The device pool is one uint8 [slots, stride] tensor
(`SlotPool.tensor`): the expert kernels view it whole as an `ExpertBank`, slot s = bank row s.
Host memory is reserved in chunks (1 GiB by default): one huge pinned allocation at once can stall
for seconds (LESSONS.md).
"""

from __future__ import annotations

import torch

from flashpack.runtime.store.reader import aligned_empty

POISON = 0xFF  # every FP8 scale byte 0xFF is NaN: a slot used before its copy lands fails loudly


class SlotPool:
    def __init__(
        self, slots: int, stride: int, device: torch.device | str, host: bool = False, pin: bool = False,
        chunk_bytes: int = 1 << 30, poison: bool = False,
    ):
        self.slots, self.stride, self.device = slots, stride, torch.device(device)
        self.per_chunk = max(1, chunk_bytes // stride) if host else max(1, slots)  # device: one tensor
        self._chunks: list[torch.Tensor] = []
        for first in range(0, slots, self.per_chunk):
            count = min(self.per_chunk, slots - first)
            if host:
                chunk = aligned_empty(count * stride, pin=pin).view(count, stride)
            else:
                chunk = torch.empty((count, stride), dtype=torch.uint8, device=self.device)
            if poison:
                chunk.fill_(POISON)
            self._chunks.append(chunk)
        # one view a slot, made once: a decode layer's copies take two views a record, and making a
        # view costs microseconds of the host's time a layer waits through
        self._views = [row for chunk in self._chunks for row in chunk.unbind(0)]

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated for slots (what the budget check asserts on)."""
        return sum(chunk.numel() for chunk in self._chunks)

    @property
    def chunks(self) -> list[torch.Tensor]:
        """uint8 [count, stride] tensors, in slot order, together holding every slot."""
        return list(self._chunks)

    @property
    def tensor(self) -> torch.Tensor:
        """uint8 [slots, stride]: the whole pool as one tensor (always so for a device pool)."""
        if len(self._chunks) != 1:
            raise ValueError(f"this pool is reserved in {len(self._chunks)} chunks, not one tensor")
        return self._chunks[0]

    def slot(self, index: int) -> torch.Tensor:
        """uint8 [stride]: the slot's bytes (a view)."""
        if not 0 <= index < self.slots:
            raise IndexError(f"slot {index} out of range (pool of {self.slots})")
        return self._views[index]
