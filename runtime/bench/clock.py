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


class LayerClock:
    """Time spent in each decoder layer of the decode steps: `begin()` before a step's first layer's
    work is issued, `lap(layer)` after each layer's (a lap taken twice for one layer in a step adds
    up), then `take()` returns {layer: seconds} summed since the last take, and clears. On a GPU the
    laps are CUDA events on the current stream, so a layer's time runs from the GPU finishing the
    work before it to finishing its own, whatever the host did meanwhile; `take` synchronizes. On a
    CPU, wall-clock time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list = []  # per step: [(None, first mark), (layer, mark), ...]

    def begin(self) -> None:
        self._marks.append([(None, self._mark())])

    def lap(self, layer: int) -> None:
        if not self._marks:
            raise RuntimeError("LayerClock.lap before begin")
        self._marks[-1].append((layer, self._mark()))

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def take(self) -> dict[int, float]:
        steps, self._marks = self._marks, []
        if self.cuda and steps:
            steps[-1][-1][1].synchronize()
        seconds: dict[int, float] = {}
        for marks in steps:
            for (_, before), (layer, after) in zip(marks, marks[1:]):
                elapsed = before.elapsed_time(after) / 1000 if self.cuda else after - before
                seconds[layer] = seconds.get(layer, 0.0) + elapsed
        return seconds
