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

BLOCK = 4096  # int32 words: 16 KiB per program


@triton.jit
def _stage_kernel(source, offsets, target, words, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offset = tl.load(offsets + row)  # int64 words from `source`, -1: nothing to stage in this row
    if offset >= 0:
        offset = tl.multiple_of(offset, 4)
        column = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = column < words
        values = tl.load(source + offset + column, mask=keep)
        tl.store(target + row * words + column, values, mask=keep)


def stage_records_triton(
    source: torch.Tensor, offsets: torch.Tensor, target: torch.Tensor, block: int = BLOCK, num_warps: int = 4,
) -> torch.Tensor:
    """source int32 [N] (pinned host memory on CUDA); offsets int64 [K] in int32 words, -1 to skip;
    target int32 [K, words]: target[k] = source[offsets[k]:offsets[k] + words] where offsets[k] >= 0.
    `block` and `num_warps` are for bench/kernels.py's sweep."""
    rows, words = target.shape
    grid = (rows, triton.cdiv(words, block))
    _stage_kernel[grid](source, offsets, target, words, BLOCK=block, num_warps=num_warps)
    return target
