"""Encoding BF16/FP32 weights into NVFP4 and row-scaled FP8: the standard two-level recipe.

Global scale = amax / (6 * 448), so that the largest block scale lands on FP8's largest value;
block scale = FP8(block_amax / 6 / global); each value rounds to the nearest E2M1 code of
value / (block_scale * global), ties to the even code, as ModelOpt and the hardware convert do.
Decoding lives in `flashpack.layout.nvfp4`, which readers use without the converter.
"""

from __future__ import annotations

import struct

import torch
import torch.nn.functional as F
from flashpack.layout.nvfp4 import FP8_MAX, NVFP4_BLOCK, NVFP4Tensor, dequantize_nvfp4  # noqa: F401

E2M1_MAX = 6.0
# Rows are encoded a chunk at a time: each elementwise pass then runs in cache, and its temporaries
# stay small enough for malloc to reuse rather than map fresh pages (a page fault per 4 KB).
_CHUNK_ELEMENTS = 1 << 17


def _grid(step: float, zero_code: int) -> tuple[float, int]:
    """(a float32 whose ulp is `step`, its bits less the code at the grid's zero)."""
    magic = step * 2.0**23
    return magic, struct.unpack("<i", struct.pack("<f", magic))[0] - zero_code


# E2M1 magnitudes lie on three grids: steps of 0.5 below 2 (codes 0-4), of 1 below 4 (codes 4-6),
# of 2 above (codes 6-7). Adding a float whose ulp is the step rounds to that grid, ties to the even
# multiple, which is the even code; the sum's bits then count steps.
_GRIDS = (_grid(0.5, 0), _grid(1.0, 2), _grid(2.0, 4))


def quantize_nvfp4(weight: torch.Tensor) -> NVFP4Tensor:
    """float [out, in] (in a multiple of 16) -> NVFP4Tensor."""
    if weight.dim() != 2 or weight.shape[1] % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs a 2-D weight whose rows are a multiple of 16, got {tuple(weight.shape)}")
    chunks = weight.contiguous().split(max(1, _CHUNK_ELEMENTS // weight.shape[1]))
    block_amax = torch.cat([_block_amax(chunk) for chunk in chunks])
    amax = block_amax.max()
    global_scale = amax / (E2M1_MAX * FP8_MAX) if amax > 0 else torch.tensor(1.0)
    block_scale = (block_amax / (E2M1_MAX * global_scale)).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    effective = block_scale.float() * global_scale
    # A block whose scale underflows to zero encodes as zeros: its values divided by inf.
    divisor = torch.where(effective > 0, effective, torch.inf)
    divisors = divisor.split([chunk.shape[0] for chunk in chunks])
    packed = torch.cat([_encode(chunk, part) for chunk, part in zip(chunks, divisors)])
    return NVFP4Tensor(packed=packed, block_scale=block_scale, global_scale=global_scale.float().reshape(()))


def _block_amax(rows: torch.Tensor) -> torch.Tensor:
    """float32 [r, in/16]. max_pool1d takes each block's max in one pass (amax over a trailing dim
    of 16 is twice as slow on CPU); abs and max are exact in any float dtype."""
    return F.max_pool1d(rows.abs().float().view(1, 1, -1), NVFP4_BLOCK).view(rows.shape[0], -1)


def _encode(rows: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """uint8 [r, in/2]: E2M1 codes of rows / divisor (one per block), element 2i in the low nibble."""
    scaled = (rows.float().unflatten(-1, (-1, NVFP4_BLOCK)) / divisor.unsqueeze(-1)).flatten(-2)
    sign = (scaled.view(torch.int32) >> 28) & 8  # the float's sign bit, as the code's bit 3
    codes = _e2m1_codes(scaled.abs_().nan_to_num_(nan=0.0))
    codes |= sign & ((codes + 7) & 8)  # only a nonzero code keeps its sign
    pairs = codes.to(torch.uint8).view(torch.int16)  # little-endian: element 2i in the low byte
    return (pairs | (pairs >> 4)).to(torch.uint8)


def _e2m1_codes(magnitude: torch.Tensor) -> torch.Tensor:
    """int32 magnitude codes 0-7. A value's own grid gives the smallest code of the three (the others
    round it up, or count from a lower zero), so the code is their minimum; integer ops, since
    float comparisons producing bool masks are the slowest elementwise ops on CPU."""
    codes = None
    for magic, offset in _GRIDS:
        grid = (magnitude + magic).view(torch.int32)
        grid -= offset
        codes = grid if codes is None else torch.minimum(codes, grid, out=codes)
    return codes.clamp_(max=7)


def nvfp4_error_bound(weight: torch.Tensor) -> torch.Tensor:
    """float32 [out, in]: the most a round trip may move each element.

    Rounding to the nearest E2M1 value errs by at most half the widest gap (4 -> 6), i.e. one block
    scale S; S itself is FP8-rounded to within 2^-4 of block_amax/6, and when it rounds down the
    clamp at 6*S costs at most block_amax - 6*S <= block_amax * 2^-4 < S. So
    |w - deq(w)| <= block_amax / 6 * (1 + 2^-4), plus FP8's subnormal step for tiny blocks.
    """
    x = weight.float()
    amax = x.abs().max()
    global_scale = amax / (E2M1_MAX * FP8_MAX) if amax > 0 else torch.tensor(1.0)
    block_amax = x.unflatten(-1, (-1, NVFP4_BLOCK)).abs().amax(dim=-1, keepdim=True)
    subnormal_step = 2.0**-9 * global_scale
    bound = block_amax / E2M1_MAX * (1 + 2.0**-4) + E2M1_MAX * subnormal_step
    return bound.expand(*block_amax.shape[:-1], NVFP4_BLOCK).flatten(-2)


def quantize_fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [rows, cols] -> (float8_e4m3fn [rows, cols], float32 [rows]) with row amax at 448."""
    x = weight.float()
    row_amax = x.abs().amax(dim=-1)
    scale = torch.where(row_amax > 0, row_amax / FP8_MAX, torch.ones_like(row_amax))
    return (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def fp8_rows_error_bound(weight: torch.Tensor) -> torch.Tensor:
    """float32 [rows, cols]: e4m3 keeps 3 mantissa bits (relative 2^-4 when rounding to nearest)
    down to 2^-6; below that the absolute step is 2^-9 of the scale, so half of it bounds the error."""
    x = weight.float()
    row_amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(row_amax > 0, row_amax / FP8_MAX, torch.ones_like(row_amax))
    return x.abs() * 2.0**-4 + scale * 2.0**-10
