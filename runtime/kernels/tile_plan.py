"""The grouped experts' tile plan: (token, pick) pairs sorted by bank row, each row's run cut into
tiles of at most block_m sorted rows (expert_grouped.py's kernels take one tile a program).

    order [P] int32: the pair index of each sorted row (pairs with slot -1 sort last, in no tile)
    tiles [3, max_tiles] int32: (bank row, first sorted row, end sorted row) of each tile; tiles
                                past the real count have first == end and do nothing

Both forms stay on the device, without reading a count back to the host (so a CUDA graph can
hold them): the grid is sized by max_tiles = pairs // block_m + min(bank rows, pairs), a bound on
the real count, or by a caller's tighter `bound`. `plan_tiles_reference` is the plan in plain torch
operations, some thirty launches. `plan_tiles` is the same plan from the sort, one searchsorted,
four operations on the per-row counts and one Triton kernel (a binary search per tile in the rows'
cumulative tile counts): a prompt step plans once in every MoE layer, and for a follow-up's few
new tokens each layer's time is the host's launches, not the GPU's work. They agree exactly
(tests/kernels/test_tile_plan.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def plan_size(pairs: int, rows: int, block_m: int, bound: tuple[int, int] | None) -> int:
    """max_tiles for `pairs` pairs over a bank of `rows` rows; `bound` = (pairs with a slot,
    distinct slots among them) where the caller knows them."""
    computed, used = (pairs, min(rows, pairs)) if bound is None else bound
    return max(1, computed // block_m + used)


def _sorted_pairs(slots: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each pair's key, sorted ascending and stably; the pair index of each): slot -1 keys as
    `rows`, after every bank row."""
    flat = slots.reshape(-1).long()
    keyed = torch.where(flat >= 0, flat, rows)
    return torch.sort(keyed, stable=True)


def plan_tiles_reference(
    slots: torch.Tensor, num_experts: int, block_m: int, bound: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [T, K] -> (order, tiles) in torch operations."""
    keys, order = _sorted_pairs(slots, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=slots.device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))  # bincount would sync with the host
    counts = counts[:num_experts]
    ends = torch.cumsum(counts, 0)
    tiles_per = (counts + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles_per, 0)
    tile = torch.arange(plan_size(keys.numel(), num_experts, block_m, bound), device=slots.device)
    expert = torch.searchsorted(tile_ends, tile, right=True).clamp(max=num_experts - 1)
    local = tile - (tile_ends[expert] - tiles_per[expert])
    first = ends[expert] - counts[expert] + local * block_m
    end = torch.minimum(first + block_m, ends[expert])
    first = torch.where(tile < tile_ends[-1], first, end)
    return order.to(torch.int32), torch.stack([expert, first, end]).to(torch.int32)


# do_not_specialize: one build whatever a call's tile count (as expert_grouped.py's kernels: a
# prompt streamed in chunks would otherwise meet a new build mid-prompt).
@triton.jit(do_not_specialize=["max_tiles"])
def _tiles_kernel(starts_ptr, tiles_per_ptr, tile_ends_ptr, tiles_ptr, max_tiles, num_experts, block_m,
                  SEARCH_STEPS: tl.constexpr, BLOCK_T: tl.constexpr):
    """Tiles t of this program: the bank row is the first whose cumulative tile count passes t
    (searchsorted right, clamped to the last row), the rows follow from where that row's run starts."""
    tile = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # upper bound of `tile` in tile_ends (ascending, num_experts long): the count of entries <= tile
    low = tl.zeros([BLOCK_T], dtype=tl.int64)
    high = tl.zeros([BLOCK_T], dtype=tl.int64) + num_experts
    for _ in range(SEARCH_STEPS):
        middle = (low + high) // 2
        open_ = low < high
        below = tl.load(tile_ends_ptr + middle, mask=open_ & (middle < num_experts), other=0) <= tile
        low = tl.where(open_ & below, middle + 1, low)
        high = tl.where(open_ & ~below, middle, high)
    expert = tl.minimum(low, num_experts - 1)
    total = tl.load(tile_ends_ptr + num_experts - 1)
    tiles_per = tl.load(tiles_per_ptr + expert)
    local = tile - (tl.load(tile_ends_ptr + expert) - tiles_per)
    first = tl.load(starts_ptr + expert) + local * block_m
    end = tl.minimum(first + block_m, tl.load(starts_ptr + expert + 1))
    first = tl.where(tile < total, first, end)
    inside = tile < max_tiles
    tl.store(tiles_ptr + tile, expert.to(tl.int32), mask=inside)
    tl.store(tiles_ptr + max_tiles + tile, first.to(tl.int32), mask=inside)
    tl.store(tiles_ptr + 2 * max_tiles + tile, end.to(tl.int32), mask=inside)


PLAN_BLOCK_T = 128  # tiles a program


def plan_tiles(
    slots: torch.Tensor, num_experts: int, block_m: int, bound: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [T, K] -> (order, tiles), as plan_tiles_reference, the tiles by one kernel."""
    keys, order = _sorted_pairs(slots, num_experts)
    # starts[e]: the sorted row where bank row e's run begins (starts[num_experts]: the pairs with a slot)
    starts = torch.searchsorted(keys, torch.arange(num_experts + 1, device=slots.device))
    tiles_per = (starts.diff() + block_m - 1) // block_m
    tile_ends = torch.cumsum(tiles_per, 0)
    max_tiles = plan_size(keys.numel(), num_experts, block_m, bound)
    tiles = torch.empty(3, max_tiles, dtype=torch.int32, device=slots.device)
    _tiles_kernel[(triton.cdiv(max_tiles, PLAN_BLOCK_T),)](
        starts, tiles_per, tile_ends, tiles, max_tiles, num_experts, block_m,
        SEARCH_STEPS=num_experts.bit_length() + 1, BLOCK_T=PLAN_BLOCK_T,
    )
    return order.to(torch.int32), tiles
