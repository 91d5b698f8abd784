"""Triton: copy records from host memory into device rows, reading them over PCIe from the kernel.

A decode step that finds an expert in the store's pinned host cache, not on the device, stages
it into one of a few device rows and runs the expert kernel on that row, all inside the step's
CUDA graph: no host round trip, no copy thread. Pinned host memory is mapped into the device's
address space (unified addressing), so the kernel reads it as it reads device memory; a slot's
address is its byte offset from the base of the host pool's lowest chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # int32 words: 16 KiB per tile
PROGRAMS = 0  # 0: one program per tile; n: n programs, each copying every n-th tile


@triton.jit
def _stage_kernel(
    source, offsets, target, words, tiles_per_row, tiles, programs, steps: tl.constexpr, BLOCK: tl.constexpr,
):
    # A few long-lived programs leave the rest of the GPU to the compute a staging on a side
    # stream overlaps; each keeps one tile (16 KiB by default) in flight over PCIe at a time.
    for step in range(steps):  # cdiv(tiles, programs); a constexpr: the interpreter loops over no argument
        tile = tl.program_id(0) + step * programs
        row = tile // tiles_per_row
        # int64 words from `source`; -1: nothing to stage in this row (or a tile past the end)
        offset = tl.load(offsets + row, mask=tile < tiles, other=-1)
        if offset >= 0:
            offset = tl.multiple_of(offset, 4)
            column = (tile % tiles_per_row) * BLOCK + tl.arange(0, BLOCK)
            keep = column < words
            values = tl.load(source + offset + column, mask=keep)
            tl.store(target + row * words + column, values, mask=keep)


def stage_records_triton(
    source: torch.Tensor, offsets: torch.Tensor, target: torch.Tensor, block: int = BLOCK, num_warps: int = 4,
    programs: int = PROGRAMS,
) -> torch.Tensor:
    """source int32 [N] (pinned host memory on CUDA); offsets int64 [K] in int32 words, -1 to skip;
    target int32 [K, words]: target[k] = source[offsets[k]:offsets[k] + words] where offsets[k] >= 0.
    `programs` bounds how many SMs' worth of programs it occupies (0: one per tile); `block`,
    `num_warps` and `programs` are swept by bench/kernels.py."""
    rows, words = target.shape
    tiles_per_row = triton.cdiv(words, block)
    tiles = rows * tiles_per_row
    programs = min(programs, tiles) if programs else tiles
    _stage_kernel[(programs,)](source, offsets, target, words, tiles_per_row, tiles, programs,
                               triton.cdiv(tiles, programs), BLOCK=block, num_warps=num_warps)
    return target
