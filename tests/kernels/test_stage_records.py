"""stage_records_triton against the reference: the rows with an offset get exactly those words,
the rows without one keep theirs; on a GPU also reading from pinned host memory, the source the
engine gives it (a slot of the store's host cache), with a wrong offset as a control."""

from __future__ import annotations

import pytest
import torch

from flashpack.runtime.kernels.reference import stage_records_reference

pytest.importorskip("triton")

WORDS = 5000  # more than one program's block (4096), not a multiple of it


def _case(device, source_device=None, pin=False):
    gen = torch.Generator().manual_seed(0)
    source = torch.randint(-2**31, 2**31 - 1, (7 * WORDS,), dtype=torch.int32, generator=gen)
    source = source.pin_memory() if pin else source.to(source_device or device)
    offsets = torch.tensor([3 * WORDS, -1, 0, 6 * WORDS, -1], dtype=torch.int64, device=device)
    target = torch.full((5, WORDS), 7, dtype=torch.int32, device=device)
    return source, offsets, target


@pytest.mark.parametrize("programs", [0, 3])  # one program per tile; 3 programs looping over 10 tiles
def test_staged_rows_match_the_reference(triton_device, programs):
    from flashpack.runtime.kernels.stage_records import stage_records_triton

    source, offsets, target = _case(triton_device)
    expected = stage_records_reference(source.cpu(), offsets.cpu(), target.cpu().clone())
    got = stage_records_triton(source, offsets, target, programs=programs)
    assert torch.equal(got.cpu(), expected)
    assert bool((got[1] == 7).all()) and bool((got[4] == 7).all())  # skipped rows untouched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory read in place needs a GPU")
def test_stages_from_pinned_host_memory_and_a_wrong_offset_shows():
    from flashpack.runtime.kernels.stage_records import stage_records_triton

    source, offsets, target = _case("cuda", pin=True)
    expected = stage_records_reference(source, offsets.cpu(), target.cpu().clone())
    assert torch.equal(stage_records_triton(source, offsets, target).cpu(), expected)
    shifted = torch.where(offsets >= 0, offsets + 1, offsets)
    assert not torch.equal(stage_records_triton(source, shifted, target.clone()).cpu(), expected)
