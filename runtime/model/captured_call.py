"""One piece of a decode step as a CUDA graph: run eagerly once (compiling and warming its kernels),
captured the second time, replayed from then on with its inputs copied into the captured ones."""

from __future__ import annotations

from collections.abc import Callable

import torch


class CapturedCall:
    """fn(*tensors) -> tensor or tuple of tensors: eager once, then captured, then replayed."""

    def __init__(self, fn: Callable, pool):
        self.fn, self.pool = fn, pool
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[torch.Tensor] = []
        self.outputs = None

    def __call__(self, *inputs: torch.Tensor):
        self.calls += 1
        if self.calls == 1:
            return self.fn(*inputs)
        if self.graph is None:
            self.inputs = [x.clone() for x in inputs]
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: the store's copy and reader threads keep landing records on their own
            # streams while a layer is captured; in the default (global) mode any CUDA call of
            # theirs invalidates the capture (seen on the H200 with a tiered store).
            with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
                self.outputs = self.fn(*self.inputs)
        else:
            for static, x in zip(self.inputs, inputs):
                static.copy_(x)
        self.graph.replay()
        return self.outputs
