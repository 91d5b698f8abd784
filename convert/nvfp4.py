"""Encoding BF16/FP32 weights into NVFP4 and row-scaled FP8: the standard two-level recipe.

Global scale = amax / (6 * 448), so that the largest block scale lands on FP8's largest value;
block scale = FP8(block_amax / 6 / global); each value rounds to the nearest E2M1 code of
value / (block_scale * global), ties to the even code, as ModelOpt and the hardware convert do.
Decoding lives in `flashpack.layout.nvfp4`, which readers use without the converter.
"""

from __future__ import annotations

import torch

from flashpack.layout.nvfp4 import FP8_MAX, NVFP4_BLOCK, NVFP4Tensor, dequantize_nvfp4  # noqa: F401

E2M1_MAX = 6.0
# Midpoints between neighbouring E2M1 magnitudes; a tie goes to the even code of the pair.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# Rows are encoded a chunk at a time: each elementwise pass then runs in cache, and its temporaries
# (a few bytes per element) stay small enough for malloc to reuse rather than map fresh pages.
_CHUNK_ELEMENTS = 1 << 16


def quantize_nvfp4(weight: torch.Tensor) -> NVFP4Tensor:
    """float [out, in] (in a multiple of 16) -> NVFP4Tensor."""
    if weight.dim() != 2 or weight.shape[1] % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs a 2-D weight whose rows are a multiple of 16, got {tuple(weight.shape)}")
    chunks = weight.split(max(1, _CHUNK_ELEMENTS // weight.shape[1]))
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
    """float32 [r, in/16]; abs and max are exact in any float dtype, so the cast can come last."""
    return rows.abs().unflatten(-1, (-1, NVFP4_BLOCK)).amax(dim=-1).float()


def _encode(rows: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """uint8 [r, in/2]: E2M1 codes of rows / divisor (one per block), element 2i in the low nibble."""
    scaled = (rows.float().unflatten(-1, (-1, NVFP4_BLOCK)) / divisor.unsqueeze(-1)).flatten(-2)
    # Only a nonzero code carries the sign, i.e. values below the first midpoint's negative.
    negative = scaled < -_MIDPOINTS[0]
    magnitude = scaled.abs_()
    codes = torch.zeros_like(magnitude, dtype=torch.uint8)
    for index, midpoint in enumerate(_MIDPOINTS):
        # Between codes `index` and `index + 1` the tie belongs to whichever is even.
        codes += magnitude > midpoint if index % 2 == 0 else magnitude >= midpoint
    codes |= negative.to(torch.uint8) << 3
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


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
