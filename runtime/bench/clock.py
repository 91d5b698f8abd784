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


def _mark(cuda: bool):
    """A point in time: a CUDA event recorded on the current stream, or the host's clock."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


BEFORE_LAYERS = "before"
BEFORE_LAYERS_HOST = "before, host"


class LayerClock:
    """Time spent in each decoder layer of the decode steps: `begin()` before a step's first layer's
    work is issued, `lap(layer)` after each layer's (a lap taken twice for one layer in a step adds
    up), then `take()` returns {layer: seconds} summed since the last take, and clears. On a GPU the
    laps are CUDA events on the current stream, so a layer's time runs from the GPU finishing the
    work before it to finishing its own, whatever the host did meanwhile; `take` synchronizes. On a
    CPU, wall-clock time.

    `step()` at the start of a step (the device idle, its last step read back) adds
    {BEFORE_LAYERS: seconds} from there to `begin()`: the host's work before it has the layers
    issued (the token's embedding and PLE rows, binding, launching), which the device waits through;
    and {BEFORE_LAYERS_HOST: seconds}, the host's own clock over the same span. The two agree where
    the host is what the device waits for; the device's longer means the work queued before the
    first layer (copies, the embedding) ran past the host's part."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list = []  # per step: [(None, first mark), (layer, mark), ...]
        self._stepped_at: float | None = None  # step()'s host time, until begin()
        self._host_before = 0.0  # host seconds from step() to begin(), summed since the last take

    def step(self) -> None:
        self._marks.append([(None, _mark(self.cuda))])
        self._stepped_at = time.perf_counter()

    def begin(self) -> None:
        if self._stepped_at is not None:
            self._marks[-1].append((BEFORE_LAYERS, _mark(self.cuda)))
            self._host_before += time.perf_counter() - self._stepped_at
            self._stepped_at = None
        else:
            self._marks.append([(None, _mark(self.cuda))])

    def lap(self, layer: int) -> None:
        if not self._marks:
            raise RuntimeError("LayerClock.lap before begin")
        self._marks[-1].append((layer, _mark(self.cuda)))

    def take(self) -> dict[int | str, float]:
        steps, self._marks, self._stepped_at = self._marks, [], None
        host_before, self._host_before = self._host_before, 0.0
        if self.cuda and steps:
            steps[-1][-1][1].synchronize()
        seconds: dict[int | str, float] = {}
        for marks in steps:
            for (_, before), (layer, after) in zip(marks, marks[1:]):
                elapsed = before.elapsed_time(after) / 1000 if self.cuda else after - before
                seconds[layer] = seconds.get(layer, 0.0) + elapsed
        if BEFORE_LAYERS in seconds:
            seconds[BEFORE_LAYERS_HOST] = host_before
        return seconds


class LayerSpan:
    """The seconds a model's decoder layers take in the steps of a prompt, from the first layer's
    start to the last one's end, summed over the steps since the last `take()`: what a bench scales
    to more layers, apart from what a request does once whatever the layer count (encoding and
    hashing the prompt, the embedding, the head, choosing the token). Hooks on the first and last
    layers time the eager steps, a wrapper on CheckedGraphs.run a prompt's chunks (nested spans
    count once); only while `on`, and never inside a CUDA graph's capture or a compile's trace
    (the warm-up's and the graphs' own runs of the layers). On a GPU the marks are CUDA events on
    the current stream, the device's time, which the host's launches pace where they are the
    slower; on a CPU the wall clock."""

    def __init__(self, model, checked=None):
        self.cuda = model.device.type == "cuda"
        self.on = False
        self._depth = 0
        self._spans: list[list] = []  # [start, end]: end None while open
        model.layers[0].register_forward_pre_hook(lambda *_: self._start())
        model.layers[-1].register_forward_hook(lambda *_: self._end())
        if checked is not None:
            run = checked.run

            def spanned(*args, **kwargs):
                self._start()
                try:
                    return run(*args, **kwargs)
                finally:
                    self._end()

            checked.run = spanned

    def _counting(self) -> bool:
        if not self.on or torch.compiler.is_compiling():
            return False
        return not (self.cuda and torch.cuda.is_current_stream_capturing())

    def _start(self) -> None:
        if self._counting():
            self._depth += 1
            if self._depth == 1:
                self._spans.append([_mark(self.cuda), None])

    def _end(self) -> None:
        if self._counting() and self._depth:
            self._depth -= 1
            if not self._depth:
                self._spans[-1][1] = _mark(self.cuda)

    def take(self) -> float:
        """The closed spans' seconds since the last take (an open one, a step cut short, is
        dropped); clears them."""
        spans = [(start, end) for start, end in self._spans if end is not None]
        self._spans, self._depth = [], 0
        if self.cuda and spans:
            spans[-1][1].synchronize()
        return sum(start.elapsed_time(end) / 1000 if self.cuda else end - start for start, end in spans)
