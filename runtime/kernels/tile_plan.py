"""The grouped experts' tile plan: (token, pick) pairs sorted by bank row, each row's run cut into
tiles of at most block_m sorted rows (expert_grouped.py's kernels take one tile a program).

    order [P] int32: the pair index of each sorted row (pairs with slot -1 sort last, in no tile)
    tiles [3, max_tiles] int32: (bank row, first sorted row, end sorted row) of each tile; tiles
                                past the real count have first == end and do nothing

Both forms stay on the device, without reading a count back to the host (so a CUDA graph can
hold them): the grid is sized by max_tiles = pairs // block_m + min(bank rows, pairs), a bound on
the real count, or by a caller's tighter `bound`. `plan_tiles_reference` is the plan in plain torch
operations, 36 of them, over the bank rows' counts. `plan_tiles` makes it from the sorted rows
instead, never touching the bank's rows (a resident bank holds every layer's experts: thousands):
the sort, a kernel marking the rows a tile begins at (a bank row's first sorted row and every
block_m-th after it, found by binary search in the sorted keys), their running count, and a kernel
placing tile t at the row where that count reaches t + 1; 10 operations and two launches. A prompt
step plans once in every MoE layer, and for a follow-up's few new tokens each layer's time is the
host's launches, not the GPU's work. They agree exactly (tests/kernels/test_tile_plan.py).
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
    flat = slots.reshape(-1)
    return torch.sort(torch.where(flat >= 0, flat, rows), stable=True)


def plan_tiles_reference(
    slots: torch.Tensor, num_experts: int, block_m: int, bound: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [T, K] -> (order, tiles) in torch operations."""
    keys, order = _sorted_pairs(slots, num_experts)
    keys = keys.long()
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


# Binary searches run this many halvings, enough for any pair count below 2^31, so that no build
# depends on a prompt's length (a search that has closed does nothing in the steps left).
SEARCH_STEPS = 32


@triton.jit
def _lower_bound(sorted_ptr, length, values, STEPS: tl.constexpr):
    """For each of `values`: the first index of ascending sorted[0:length] holding it or more."""
    low = tl.zeros(values.shape, dtype=tl.int64)
    high = tl.zeros(values.shape, dtype=tl.int64) + length
    for _ in range(STEPS):
        middle = (low + high) // 2
        open_ = low < high
        below = tl.load(sorted_ptr + middle, mask=open_, other=0) < values
        low = tl.where(open_ & below, middle + 1, low)
        high = tl.where(open_ & ~below, middle, high)
    return low


@triton.jit(do_not_specialize=["pairs"])
def _tile_starts_kernel(keys_ptr, starts_ptr, pairs, num_experts, block_m, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """starts[r] = 1 where a tile begins at sorted row r: a slotted row block_m rows on from the
    first row of its bank row's run, or that first row itself."""
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = row < pairs
    key = tl.load(keys_ptr + row, mask=inside, other=num_experts)
    run_start = _lower_bound(keys_ptr, pairs, key, STEPS)
    begins = inside & (key < num_experts) & ((row - run_start) % block_m == 0)
    tl.store(starts_ptr + row, begins.to(tl.int32), mask=inside)


# do_not_specialize: one build whatever a call's tile count (as expert_grouped.py's kernels: a
# prompt streamed in chunks would otherwise meet a new build mid-prompt).
@triton.jit(do_not_specialize=["max_tiles", "pairs"])
def _tiles_kernel(keys_ptr, begun_ptr, tiles_ptr, pairs, max_tiles, num_experts, block_m,
                  STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """Tile t begins at the sorted row where the running count of tile starts (begun) reaches t + 1;
    tiles past the count are (last bank row, slotted pairs, slotted pairs), as the reference's."""
    tile = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row = _lower_bound(begun_ptr, pairs, tile + 1, STEPS)
    real = row < pairs
    key = tl.load(keys_ptr + row, mask=real, other=0)
    run_end = _lower_bound(keys_ptr, pairs, key + 1, STEPS)
    slotted = _lower_bound(keys_ptr, pairs, tl.zeros([BLOCK], dtype=tl.int64) + num_experts, STEPS)
    expert = tl.where(real, key, num_experts - 1)
    first = tl.where(real, row, slotted)
    end = tl.where(real, tl.minimum(row + block_m, run_end), slotted)
    inside = tile < max_tiles
    tl.store(tiles_ptr + tile, expert.to(tl.int32), mask=inside)
    tl.store(tiles_ptr + max_tiles + tile, first.to(tl.int32), mask=inside)
    tl.store(tiles_ptr + 2 * max_tiles + tile, end.to(tl.int32), mask=inside)


PLAN_BLOCK = 128  # sorted rows, or tiles, a program


def plan_tiles(
    slots: torch.Tensor, num_experts: int, block_m: int, bound: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [T, K] -> (order, tiles), as plan_tiles_reference: the sort, a kernel marking the
    sorted rows a tile begins at, their running count, and a kernel placing each tile there."""
    keys, order = _sorted_pairs(slots, num_experts)
    pairs = keys.numel()
    starts = torch.empty(pairs, dtype=torch.int32, device=slots.device)
    _tile_starts_kernel[(triton.cdiv(pairs, PLAN_BLOCK),)](keys, starts, pairs, num_experts, block_m,
                                                          STEPS=SEARCH_STEPS, BLOCK=PLAN_BLOCK)
    begun = torch.cumsum(starts, 0)
    max_tiles = plan_size(pairs, num_experts, block_m, bound)
    tiles = torch.empty(3, max_tiles, dtype=torch.int32, device=slots.device)
    _tiles_kernel[(triton.cdiv(max_tiles, PLAN_BLOCK),)](keys, begun, tiles, pairs, max_tiles, num_experts, block_m,
                                                        STEPS=SEARCH_STEPS, BLOCK=PLAN_BLOCK)
    return order.to(torch.int32), tiles
