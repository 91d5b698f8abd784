"""CapturedCall on a GPU: eager, captured, replayed; inputs copied into the captured ones, `kept`
inputs captured in place, so a chain of calls hands tensors on without copies. Exact (integer
valued float32 arithmetic); each step's new input would leave a stale result if it were not copied,
and a kept input that comes as another tensor must be copied in as well."""

from __future__ import annotations

import pytest
import torch

from flashpack.runtime.engine.captured_call import CapturedCall

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_a_chain_of_calls_hands_its_outputs_on_in_place():
    pool = torch.cuda.graph_pool_handle()
    scale = torch.full((4,), 3.0, device="cuda")  # a buffer every call reads: kept
    first = CapturedCall(lambda x, s: (x * s + 1,), pool, kept=(1,))
    second = CapturedCall(lambda y, s: (y * s,), pool, kept=(0, 1))
    for step in range(5):
        x = torch.arange(4, dtype=torch.float32, device="cuda") + step  # a new tensor each step: copied
        (y,) = first(x, scale)
        (z,) = second(y, scale)
        assert torch.equal(z, (x * 3 + 1) * 3), step
    assert first.graph is not None and second.inputs[0] is y  # captured in place, not a clone
    moved = torch.ones(4, device="cuda")  # a kept input that comes as another tensor is copied in
    (z,) = second(moved, scale)
    assert torch.equal(z, torch.full((4,), 3.0, device="cuda"))



def test_the_capture_meets_the_inputs_its_eager_run_compiled_for():
    """An input with gaps is cloned (contiguous: clone keeps only dense strides) for the capture; the eager run takes that clone
    too, so a compiled piece is not compiled again inside the capture (where TorchInductor's tuning
    would synchronise). Control: the piece compiled for the original strides would count two frames."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    piece = torch.compile(lambda x: (x * 2 + 1,), backend=counter, dynamic=False)
    call = CapturedCall(piece, torch.cuda.graph_pool_handle())
    for step in range(4):
        x = (torch.arange(24, dtype=torch.float32, device="cuda").view(3, 8) + step)[:, ::2]  # strides (8, 2)
        (y,) = call(x)
        assert torch.equal(y, x * 2 + 1), step
    assert call.graph is not None and counter.frame_count == 1
    piece(torch.zeros(3, 8, device="cuda")[:, ::2])  # control: the original strides are another frame
    assert counter.frame_count == 2
