"""fp8_linear_triton (matvec for few tokens, tile GEMM for more) against the dequantise-then-matmul
reference. Tolerance: max abs error <= 1e-5 * max |reference| in float32 (matvec, and the tile
kernel at precision="fp32"); at precision="bf16" (CUDA) <= 1e-5 vs the reference with x rounded to
bf16 (e4m3 -> bf16 is exact), and <= 1e-2 vs the float32 reference. A bf16 output adds 2^-7 (the
interpreter truncates float32 -> bf16; the GPU rounds to nearest, 2^-8).
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import nan_like, relative_error

from flashpack.convert.nvfp4 import quantize_fp8_rows
from flashpack.runtime.kernels.reference import fp8_linear_reference

pytest.importorskip("triton")

ROWS, COLS = 100, 150  # neither divides a block, COLS not even a multiple of 16
BLOCKS = dict(block_r=64, block_c=64, block_m=16, block_n=64, block_k=64)


def _matrix(device, seed=0):
    values, scale = quantize_fp8_rows(torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed)))
    return values.to(device), scale.to(device)


def _run(x, values, scale, **kwargs):
    from flashpack.runtime.kernels.fp8_linear import fp8_linear_triton

    return fp8_linear_triton(x, values, scale, **{**BLOCKS, **kwargs})


@pytest.mark.parametrize("tokens", [1, 3, 7, 9])
def test_fp32_matches_reference(triton_device, tokens):
    """1, 3 and 7 tokens take the matvec kernel, 9 the tile kernel (matvec_max_tokens=8)."""
    values, scale = _matrix(triton_device)
    x = torch.randn(tokens, COLS, generator=torch.Generator().manual_seed(tokens)).to(triton_device)
    out = _run(x, values, scale, precision="fp32", out=nan_like((tokens, ROWS), torch.float32, triton_device))
    assert torch.isfinite(out).all()
    assert relative_error(out, fp8_linear_reference(x, values, scale)) <= 1e-5


@pytest.mark.parametrize("tokens", [3, 16, 17])
def test_default_tiles_match_reference(triton_device, tokens):
    """The tile kernel at its own tiles (tile_blocks): 16 tokens by 32 rows up to FEW_TOKENS, then a
    prompt's 128 by 128 (17 tokens: one partly filled tile)."""
    from flashpack.runtime.kernels.fp8_linear import fp8_linear_triton
    from flashpack.runtime.kernels.tile_linear import FEW_TOKENS, tile_blocks

    assert tile_blocks(FEW_TOKENS)["block_m"] == 16 and tile_blocks(FEW_TOKENS + 1)["block_m"] == 128
    values, scale = _matrix(triton_device, seed=6)
    x = torch.randn(tokens, COLS, generator=torch.Generator().manual_seed(tokens)).to(triton_device)
    out = fp8_linear_triton(x, values, scale, precision="fp32", matvec_max_tokens=0,
                            out=nan_like((tokens, ROWS), torch.float32, triton_device))
    assert relative_error(out, fp8_linear_reference(x, values, scale)) <= 1e-5


def test_leading_dims_and_bf16_output(triton_device):
    values, scale = _matrix(triton_device, seed=1)
    x = torch.randn(2, 1, COLS, generator=torch.Generator().manual_seed(2)).to(triton_device, torch.bfloat16)
    out = _run(x, values, scale)
    assert out.shape == (2, 1, ROWS) and out.dtype == torch.bfloat16
    assert relative_error(out, fp8_linear_reference(x, values, scale, out_dtype=torch.float32)) <= 2.0**-7


def test_row_scale_control(triton_device):
    """Scales applied to the wrong axis (here: rows reversed) must fail the tolerance."""
    values, scale = _matrix(triton_device, seed=3)
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(4)).to(triton_device)
    assert relative_error(_run(x, values, scale.flip(0)), fp8_linear_reference(x, values, scale)) > 0.1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tensor-core dots need CUDA")
@pytest.mark.parametrize("tokens", [3, 9, 16, 300])  # the tile kernel's, at its own tiles
def test_bf16_matches_reference(tokens):
    from flashpack.runtime.kernels.fp8_linear import fp8_linear_triton

    values, scale = _matrix("cuda")
    x = torch.randn(tokens, COLS, generator=torch.Generator().manual_seed(5)).cuda()
    out = fp8_linear_triton(x, values, scale, precision="bf16", matvec_max_tokens=0)
    assert relative_error(out, fp8_linear_reference(x, values, scale, act_dtype=torch.bfloat16)) <= 1e-5
    assert relative_error(out, fp8_linear_reference(x, values, scale)) <= 1e-2
