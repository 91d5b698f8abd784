"""The grouped experts' tile plan (runtime/kernels/tile_plan.py): the kernel's plan equals the torch
operations' exactly (integers), on random routings with and without unslotted pairs and bounds,
over banks of a few rows and of thousands (a resident bank holds every layer's experts); and both
cover every slotted pair once, in tiles of one bank row and at most block_m rows. On the GPU where
there is one, else in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import routing

pytest.importorskip("triton")


def _plans():
    from flashpack.runtime.kernels.tile_plan import plan_tiles, plan_tiles_reference

    return {"kernel": plan_tiles, "reference": plan_tiles_reference}


def _slots(tokens: int, rows: int, top_k: int, seed: int, unslotted: float = 0.0) -> torch.Tensor:
    """[tokens, top_k] distinct bank rows a token; a share `unslotted` of the pairs set to -1 (a
    chunk of a prompt streamed through a store holds some of its rows only)."""
    generator = torch.Generator().manual_seed(seed)
    slots = torch.rand(tokens, rows, generator=generator).argsort(dim=-1)[:, :top_k].to(torch.int32)
    dropped = torch.rand(tokens, top_k, generator=generator) < unslotted
    return torch.where(dropped, -1, slots)


def _bound(slots: torch.Tensor) -> tuple[int, int]:
    kept = slots[slots >= 0]
    return kept.numel(), int(kept.unique().numel())


@pytest.mark.parametrize("tokens,rows,top_k,block_m,unslotted,bounded", [
    (13, 6, 3, 4, 0.0, False), (13, 6, 3, 4, 0.5, True), (1, 5, 2, 16, 0.0, False), (92, 512, 10, 64, 0.0, False),
    (92, 8192, 10, 16, 0.0, False), (300, 64, 8, 64, 0.3, True), (40, 3, 2, 16, 1.0, False),
])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_the_kernels_plan_is_the_torch_plan(triton_device, tokens, rows, top_k, block_m, unslotted, bounded, dtype):
    plans = _plans()
    slots = _slots(tokens, rows, top_k, seed=tokens + rows, unslotted=unslotted).to(triton_device, dtype)
    bound = _bound(slots) if bounded else None
    order, tiles = plans["kernel"](slots, rows, block_m, bound)
    expected_order, expected_tiles = plans["reference"](slots, rows, block_m, bound)
    assert order.dtype == tiles.dtype == torch.int32
    assert torch.equal(order, expected_order)
    assert torch.equal(tiles, expected_tiles)


def test_control_a_plan_cut_at_other_rows_differs(triton_device):
    """The equality above can fail: with runs longer than a tile (92 tokens' three picks over six
    bank rows, ~46 pairs a row), a block_m off by one plans other tiles."""
    plans = _plans()
    slots = _slots(92, 6, 3, seed=3).to(triton_device)
    assert not torch.equal(plans["kernel"](slots, 6, 15)[1][:, :8], plans["reference"](slots, 6, 16)[1][:, :8])


@pytest.mark.parametrize("plan", ["kernel", "reference"])
def test_plan_tiles_covers_every_pair_once(triton_device, plan):
    slots, _ = routing(13, 6, 3, seed=0, device=triton_device)
    order, tiles = _plans()[plan](slots, 6, 4)
    flat = slots.reshape(-1).long()
    assert sorted(order.tolist()) == list(range(flat.numel()))
    seen = []
    for expert, first, end in tiles.T.tolist():
        assert end - first <= 4
        rows = list(range(first, end))
        assert all(flat[order[r]] == expert for r in rows)
        seen += rows
    assert sorted(seen) == list(range(flat.numel()))


@pytest.mark.parametrize("plan", ["kernel", "reference"])
def test_plan_tiles_skips_unslotted_pairs_and_sizes_the_grid_to_a_bound(triton_device, plan):
    slots, _ = routing(13, 6, 3, seed=1, device=triton_device)
    slots = torch.where(slots % 2 == 0, slots, -1)  # a chunk holding the even bank rows only
    flat = slots.reshape(-1).long()
    kept = (flat >= 0).nonzero().flatten().tolist()
    bound = (len(kept), len(set(flat[kept].tolist())))
    order, tiles = _plans()[plan](slots, 6, 4, bound)
    assert tiles.shape[1] == bound[0] // 4 + bound[1]
    seen = []
    for expert, first, end in tiles.T.tolist():
        rows = list(range(first, end))
        assert all(flat[order[r]] == expert for r in rows)
        seen += [order[r].item() for r in rows]
    assert sorted(seen) == kept
