"""One piece of a decode step as a CUDA graph: run eagerly once (compiling and warming its kernels),
captured the second time, replayed from then on with its inputs copied into the captured ones.

The eager run already takes the clones the capture will (and kept inputs of the layout the capture
meets: the previous piece's outputs), so a compiled piece meets at its capture exactly the strides
and aliasing it was compiled for: a guard that failed there would compile again inside the capture,
and TorchInductor's tuning of a new kernel synchronises the device, which a capture forbids."""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch


class CapturedCall:
    """fn(*tensors) -> tensor or tuple of tensors: eager once, then captured, then replayed.

    Inputs at the positions in `kept` are the very same tensors every call (the previous piece's
    outputs, buffers that live as long as the graphs): they are captured in place, so a chain of
    pieces hands its tensors on without a copy. The others are cloned at capture and copied into
    the clones before each replay (as a kept one is, should it ever come as another tensor)."""

    def __init__(self, fn: Callable, pool, kept: Collection[int] = ()):
        self.fn, self.pool, self.kept = fn, pool, frozenset(kept)
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[torch.Tensor] = []
        self.outputs = None

    def __call__(self, *inputs: torch.Tensor):
        self.calls += 1
        if self.calls == 1:
            self.inputs = [x if i in self.kept else x.clone() for i, x in enumerate(inputs)]
            return self.fn(*self.inputs)
        if self.graph is None:
            # kept inputs are captured as they come now (the previous piece's captured outputs, not
            # its eager ones), with the strides the eager run met
            self.inputs = [x if i in self.kept else static for i, (static, x) in enumerate(zip(self.inputs, inputs))]
        for static, x in zip(self.inputs, inputs):
            if x is not static:
                static.copy_(x)
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: the store's copy and reader threads keep landing records on their own
            # streams while a layer is captured; in the default (global) mode any CUDA call of
            # theirs invalidates the capture (seen on the H200 with a tiered store).
            with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
                self.outputs = self.fn(*self.inputs)
        self.graph.replay()
        return self.outputs
