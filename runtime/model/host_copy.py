"""A step's small host tensors (a token's PLE rows, its experts' slots) onto the device without the
host waiting for the copy."""

from __future__ import annotations

import torch


def to_device_async(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor`, on the host, copied to `device`. To a GPU through pinned memory: a copy from pageable
    memory is synchronous (the host stages it and waits for the GPU to take it), one from pinned
    memory is only queued, and PyTorch's caching host allocator keeps the pinned block until it has run."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
