"""What a request may pay for on first use, as process-wide counts a bench reads before and after
it: memory segments torch's CUDA allocator took from the driver (each a cudaMalloc), and Python
frames TorchDynamo compiled (each traced, then built or loaded from the compile caches)."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters


def device_segments_allocated() -> int:
    """Segments torch's CUDA allocator has taken from the driver so far (0 without CUDA)."""
    return torch.cuda.memory_stats().get("segment.all.allocated", 0) if torch.cuda.is_available() else 0


def frames_compiled() -> int:
    """Frames TorchDynamo has compiled in this process so far."""
    return counters["frames"]["ok"]
