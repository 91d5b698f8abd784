"""A step's small host tensors (a token's PLE rows, its experts' slots) onto the device without the
host waiting for the copy, through pinned buffers reused from a ring."""

from __future__ import annotations

import torch

RING_DEPTH = 8  # buffers a ring cycles through; a decode layer stages one to three tensors a token
MIN_BUFFER_BYTES = 4096


class PinnedStaging:
    """Copies small host tensors to a GPU from pinned buffers it keeps. A copy from pageable memory is
    synchronous (the host stages it and waits for the GPU to take it); one from pinned memory is only
    queued. Pinning a fresh tensor each time (`Tensor.pin_memory()`) takes PyTorch's caching host
    allocator 30-1000 us with the GIL held (an 8/32 decode profile on the H200: up to 1 ms, four times a step,
    stalling the store's copy and reader threads), so each buffer here is pinned once and reused once
    the copy that last read it has run (its event, long done when the ring comes round)."""

    def __init__(self, depth: int = RING_DEPTH):
        self._buffers: list[torch.Tensor | None] = [None] * depth
        self._copied: list[torch.cuda.Event | None] = [None] * depth
        self._next = 0

    def to_device(self, tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        """`tensor`, on the host, copied to `device` (on a GPU: queued on the current stream)."""
        device = torch.device(device)
        if device.type != "cuda":
            return tensor.to(device)
        index = self._next
        self._next = (index + 1) % len(self._buffers)
        copied = self._copied[index]
        if copied is not None:
            copied.synchronize()
        nbytes = tensor.numel() * tensor.element_size()
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[index] = torch.empty(max(nbytes, MIN_BUFFER_BYTES), dtype=torch.uint8,
                                                        pin_memory=True)
        staged = buffer[:nbytes].view(tensor.dtype).view(tensor.shape)
        staged.copy_(tensor)
        out = staged.to(device, non_blocking=True)
        if copied is None:
            copied = self._copied[index] = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(device))
        return out
