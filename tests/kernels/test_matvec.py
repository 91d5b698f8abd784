"""matvec (the decode projections' matrix-vector kernel) against F.linear in float64.

Tolerances: float32 weights and x, max abs error <= 1e-5 * max |reference| (float32 sums of the same
products in another order); bfloat16 weights and x with a bfloat16 output, 2^-7 (the output's
rounding: the interpreter truncates float32 -> bf16, the GPU rounds to nearest, 2^-8), the products
themselves exact in float32. FP8 rows are covered through fp8_linear (test_fp8_linear.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import nan_like, relative_error

pytest.importorskip("triton")


def _matvec(*args, **kwargs):
    from flashpack.runtime.kernels.matvec import matvec

    return matvec(*args, **kwargs)


def _case(rows, cols, tokens, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator).to(device, dtype)
    x = torch.randn(tokens, cols, generator=generator).to(device, dtype)
    return x, weight


@pytest.mark.parametrize("rows,cols,tokens,blocks", [
    (100, 150, 1, {}),  # neither a multiple of a block: masked rows and columns
    (37, 320, 2, {}),  # the default blocks divide 320 by 64
    (64, 96, 3, dict(block_r=8, block_c=32)),
    (100, 150, 5, {}),  # several tokens: one program of ROWS_AT_ONCE, three of its tokens masked
    (33, 2560, 7, {}),  # one row a program at one token: several tokens share it
    (40, 96, 9, {}),  # a full program of ROWS_AT_ONCE tokens, then one masked to a single token
    (24, 64, 4, dict(block_r=2, block_c=32)),  # four tokens a program of two rows
])
def test_float32_matches_linear(triton_device, rows, cols, tokens, blocks):
    x, weight = _case(rows, cols, tokens, torch.float32, triton_device)
    out = _matvec(x, weight, out=nan_like((tokens, rows), torch.float32, triton_device), **blocks)
    expected = F.linear(x.double(), weight.double())
    assert torch.isfinite(out).all()
    assert relative_error(out, expected) <= 1e-5  # observed ~1e-7


def test_bfloat16_with_leading_dims(triton_device):
    x, weight = _case(48, 160, 2, torch.bfloat16, triton_device, seed=1)
    out = _matvec(x.reshape(2, 1, 160), weight)
    assert out.shape == (2, 1, 48) and out.dtype == torch.bfloat16
    assert relative_error(out.reshape(2, 48), F.linear(x.double(), weight.double())) <= 2.0**-7


def test_a_row_off_by_one_fails(triton_device):
    """Control: the weights of the next row (a stride error) must fail the tolerance."""
    x, weight = _case(40, 64, 1, torch.float32, triton_device, seed=2)
    shifted = torch.cat([weight[1:], weight[:1]])
    assert relative_error(_matvec(x, shifted), F.linear(x.double(), weight.double())) > 0.1


def test_a_token_read_as_another_fails(triton_device):
    """Control for the several-token kernel: each token's output row must come from its own x row;
    the reference of x with two tokens swapped must fail the tolerance."""
    x, weight = _case(40, 64, 3, torch.float32, triton_device, seed=3)
    swapped = x[[0, 2, 1]]
    assert relative_error(_matvec(x, weight), F.linear(swapped.double(), weight.double())) > 0.1


def test_refuses_what_it_cannot_read(triton_device):
    x, weight = _case(16, 64, 1, torch.float32, triton_device)
    with pytest.raises(ValueError, match="do not fit"):
        _matvec(x, weight.t().contiguous().t())  # columns not contiguous
    with pytest.raises(ValueError, match="do not fit"):
        _matvec(x[:, :32], weight)


def test_blocks_keep_a_threads_loads_bounded():
    from flashpack.runtime.kernels.matvec import ELEMENTS_PER_THREAD, matvec_blocks, tokens_at_once

    for rows, cols in [(12352, 2560), (2560, 4096), (324, 10240), (10240, 320), (2560, 640), (100, 150)]:
        block_r, block_c = matvec_blocks(rows, cols)
        assert block_c <= 512 and (cols % block_c == 0 or block_c == 16)
        assert block_r == 1 or block_r * cols <= ELEMENTS_PER_THREAD * 128
        for tokens in (2, 3, 5, 8):  # a thread's sums over all of a program's tokens stay bounded
            block_r, block_c = matvec_blocks(rows, cols, tokens)
            assert block_c <= 512 and (cols % block_c == 0 or block_c == 16)
            assert block_r == 1 or block_r * cols * tokens_at_once(tokens) <= ELEMENTS_PER_THREAD * 128
    # the block-size sweep's best at the decode shapes on an H200: one row a program at >= 2560 inputs, more below
    assert matvec_blocks(12352, 2560) == (1, 512) and matvec_blocks(2560, 4096) == (1, 512)
    assert matvec_blocks(2560, 640) == (4, 128) and matvec_blocks(10240, 320) == (8, 64)
