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


class RegionClock:
    """Time spent inside marked regions of a run: `start()` ... `stop()`, any number of times, then
    `take()` returns the seconds since the last take. On a GPU the regions are timed on the device
    (CUDA events on the current stream): the time from the GPU reaching `start` to reaching `stop`,
    whatever the host did meanwhile; `take` synchronizes. On a CPU, wall-clock time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list = []  # CUDA events or perf_counter readings, start and stop in turn

    def start(self) -> None:
        self._mark()

    def stop(self) -> None:
        self._mark()

    def _mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def take(self) -> float:
        if len(self._marks) % 2:
            raise RuntimeError("RegionClock.take inside a region (start without stop)")
        pairs = list(zip(self._marks[::2], self._marks[1::2]))
        self._marks = []
        if self.cuda:
            if pairs:
                pairs[-1][1].synchronize()
            return sum(begin.elapsed_time(end) for begin, end in pairs) / 1000
        return sum(end - begin for begin, end in pairs)
