"""runtime/bench/first_use.py: the counts a bench reads around a request move with what it paid for."""

from __future__ import annotations

import torch

from flashpack.runtime.bench.first_use import device_segments_allocated, frames_compiled


def test_frames_compiled_counts_a_new_shape_once():
    """A function compiled for one shape and called at another is compiled again (dynamic=False);
    the same shape again compiles nothing (the control: the count does not just grow per call)."""
    torch._dynamo.reset()
    twice_plus_one = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    before = frames_compiled()
    twice_plus_one(torch.ones(3))
    assert frames_compiled() == before + 1
    twice_plus_one(torch.ones(3))
    assert frames_compiled() == before + 1
    twice_plus_one(torch.ones(5))
    assert frames_compiled() == before + 2


def test_device_segments_count_the_allocator_taking_memory_from_the_driver():
    """On CUDA, a block larger than any cached one takes a segment; without CUDA the count stays 0."""
    if not torch.cuda.is_available():
        assert device_segments_allocated() == 0
        return
    torch.cuda.empty_cache()  # cached free segments go back, so the block below needs a new one
    before = device_segments_allocated()
    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    assert device_segments_allocated() > before
    del block
