"""nvfp4_expert_swiglu (matvec, float32 throughout) against the dequantise-then-matmul reference.

Tolerance: max abs error <= 1e-5 * max |reference| (both float32; only summation order differs,
observed ~4e-7). bf16 x is widened exactly, so the same bound holds with a float32 `out`; a bf16
`out` adds its own rounding: 2^-8 relative on the GPU (round to nearest), 2^-7 under the triton 3.6
interpreter, which truncates float32 -> bf16.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import nan_like, relative_error, routing

from flashpack.runtime.kernels.reference import expert_swiglu_reference

pytest.importorskip("triton")

# H, I, E, T, K, x dtype. Blocks below never divide H or I, so every loop has a masked tail.
CASES = [(144, 80, 5, 1, 3, torch.float32), (80, 48, 3, 3, 2, torch.bfloat16), (112, 96, 4, 2, 4, torch.float32)]
BLOCKS = dict(block_i=64, block_h=128, block_o=64, block_down_in=64)
FP32_TOL = 1e-5


def _run(x, bank, slots, weights, **kwargs):
    from flashpack.runtime.kernels.expert_decode import nvfp4_expert_swiglu

    return nvfp4_expert_swiglu(x, bank, slots, weights, **{**BLOCKS, **kwargs})


@pytest.mark.parametrize("hidden,inter,experts,tokens,top_k,dtype", CASES)
def test_matches_reference(triton_device, make_bank, hidden, inter, experts, tokens, top_k, dtype):
    bank = make_bank(hidden, inter, experts, seed=hidden)
    slots, weights = routing(tokens, experts, top_k, seed=tokens, device=triton_device)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(7)).to(triton_device, dtype)
    expected = expert_swiglu_reference(x, bank, slots, weights, out_dtype=torch.float32)
    h = nan_like((tokens * top_k, inter), torch.float32, triton_device)
    out = _run(x, bank, slots, weights, out=nan_like((tokens, hidden), torch.float32, triton_device), h=h)
    assert torch.isfinite(out).all() and torch.isfinite(h).all()
    assert relative_error(out, expected) <= FP32_TOL
    if dtype == torch.bfloat16:
        assert relative_error(_run(x, bank, slots, weights), expected) <= 2.0**-7


@pytest.mark.parametrize("exponent", [-24, 24])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu(g), g < -88: exp(-g) = inf, sigmoid 0
def test_input_range(triton_device, make_bank, exponent):
    """x scaled by 2^-24 or 2^24 (h by about 2^-48 or 2^48) keeps the float32 bound: the decoded
    nibbles (times 2^-126, so 0.5 is the subnormal 2^-127) must meet x only where the product is
    normal and finite. numpy keeps subnormals, so a wrong scaling shows here as lost precision or
    inf rather than as a flush: x scaled by 2^20 or 2^100 instead of 2^64 fails here (tried), by 1
    everywhere."""
    bank = make_bank(144, 80, 3, seed=9)
    slots, weights = routing(2, 3, 2, seed=10, device=triton_device)
    x = (torch.randn(2, 144, generator=torch.Generator().manual_seed(11)) * 2.0**exponent).to(triton_device)
    expected = expert_swiglu_reference(x, bank, slots, weights, out_dtype=torch.float32)
    assert relative_error(_run(x, bank, slots, weights), expected) <= FP32_TOL


def test_single_token_vector_api(triton_device, make_bank):
    bank = make_bank(80, 48, 3, seed=1)
    slots, weights = routing(1, 3, 2, seed=2, device=triton_device)
    x = torch.randn(80, generator=torch.Generator().manual_seed(3)).to(triton_device)
    out = _run(x, bank, slots[0], weights[0])
    assert out.shape == (80,)
    assert relative_error(out, expert_swiglu_reference(x[None], bank, slots, weights)[0]) <= FP32_TOL


def test_swapped_nibbles_control(triton_device, make_bank):
    """The same experts with each byte's nibbles swapped must not pass: the kernel reads element
    2j from the low nibble, as FORMAT.md says, and the tolerance is tight enough to tell."""
    bank, swapped = make_bank(80, 48, 3, seed=5), make_bank(80, 48, 3, seed=5, swap_nibbles=True)
    slots, weights = routing(2, 3, 2, seed=6, device=triton_device)
    x = torch.randn(2, 80, generator=torch.Generator().manual_seed(8)).to(triton_device)
    expected = expert_swiglu_reference(x, bank, slots, weights)
    assert relative_error(_run(x, swapped, slots, weights), expected) > 0.1
    assert relative_error(_run(x, bank, slots, weights), expected) <= FP32_TOL
