"""Wall-clock timing that means what it says on a GPU: synchronize before reading the clock."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """(fn(), seconds), with the device's queued work drained before and after."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 1) -> float:
    for _ in range(warmup):
        timed(fn, device)
    return statistics.median(timed(fn, device)[1] for _ in range(repeats))
