"""nvfp4_expert_swiglu_grouped (W4A16 tile GEMMs over tokens sorted by expert) against the reference.

Tolerances, max abs error / max |reference|:
  - precision="fp32" (IEEE dots; the interpreter's only mode): <= 1e-5 vs the float32 reference.
  - precision="bf16" (CUDA), float32 out: <= 1e-3 vs the reference rounding x and h to bf16 where
    the kernel does (summation order, and the odd h element rounding to the other bf16 neighbour,
    2^-8 of that element), and <= 1e-2 vs the pure float32 reference (x and h carry 2^-9 relative
    rounding into every product). A bf16 out adds its own 2^-8.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import nan_like, relative_error, routing

from flashpack.runtime.kernels.reference import expert_swiglu_reference

pytest.importorskip("triton")

# H, I, E, T, K: 40 tokens x 2 over 3 experts puts ~27 rows on each, i.e. 2 tiles of 16 per expert.
CASES = [(144, 80, 5, 7, 3), (80, 48, 3, 40, 2), (112, 96, 4, 5, 4)]
BLOCKS = dict(block_m=16, block_n=64, block_k=64)


def _run(x, bank, slots, weights, **kwargs):
    from flashpack.runtime.kernels.expert_grouped import nvfp4_expert_swiglu_grouped

    return nvfp4_expert_swiglu_grouped(x, bank, slots, weights, **{**BLOCKS, **kwargs})


def _case(make_bank, device, hidden, inter, experts, tokens, top_k):
    bank = make_bank(hidden, inter, experts, seed=hidden + tokens)
    slots, weights = routing(tokens, experts, top_k, seed=tokens, device=device)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(11)).to(device)
    return bank, slots, weights, x


@pytest.mark.parametrize("hidden,inter,experts,tokens,top_k", CASES[:2])
def test_pairs_filled_chunk_by_chunk_sum_to_the_reference(triton_device, make_bank, hidden, inter, experts, tokens,
                                                          top_k):
    """A prompt streamed in chunks: each call fills the pairs of its bank rows (the rest stay NaN
    until their chunk runs), with the grid sized by the chunk's bound; the sum over picks is the
    one-call result. The control: leaving out a chunk leaves NaN."""
    from flashpack.runtime.kernels.expert_grouped import nvfp4_expert_pairs_grouped

    bank, slots, weights, x = _case(make_bank, triton_device, hidden, inter, experts, tokens, top_k)
    pairs = nan_like((tokens * top_k, hidden), torch.float32, triton_device)
    for chunk in ([0], list(range(1, experts))):
        member = torch.isin(slots, torch.tensor(chunk, device=triton_device, dtype=slots.dtype))
        part = torch.where(member, slots, -1)
        bound = (int(member.sum()), len(set(slots[member].tolist())))
        nvfp4_expert_pairs_grouped(x, bank, part, weights, pairs, bound=bound, precision="fp32", **BLOCKS)
        assert torch.isnan(pairs[~member.flatten()]).all() == (chunk == [0])
    out = pairs.view(tokens, top_k, hidden).sum(1)
    assert relative_error(out, expert_swiglu_reference(x, bank, slots, weights)) <= 1e-5


@pytest.mark.parametrize("hidden,inter,experts,tokens,top_k", CASES)
def test_fp32_matches_reference(triton_device, make_bank, hidden, inter, experts, tokens, top_k):
    bank, slots, weights, x = _case(make_bank, triton_device, hidden, inter, experts, tokens, top_k)
    out = _run(x, bank, slots, weights, precision="fp32", out=nan_like(x.shape, torch.float32, triton_device))
    assert torch.isfinite(out).all()
    assert relative_error(out, expert_swiglu_reference(x, bank, slots, weights)) <= 1e-5


def test_swapped_nibbles_control(triton_device, make_bank):
    bank, slots, weights, x = _case(make_bank, triton_device, 80, 48, 3, 6, 2)
    swapped = make_bank(80, 48, 3, seed=80 + 6, swap_nibbles=True)
    expected = expert_swiglu_reference(x, bank, slots, weights)
    assert relative_error(_run(x, swapped, slots, weights, precision="fp32"), expected) > 0.1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tensor-core dots need CUDA")
@pytest.mark.parametrize("hidden,inter,experts,tokens,top_k", CASES + [(2560, 640, 16, 300, 10)])
def test_bf16_matches_reference(make_bank, hidden, inter, experts, tokens, top_k):
    bank, slots, weights, x = _case(make_bank, torch.device("cuda"), hidden, inter, experts, tokens, top_k)
    x = x.bfloat16()
    out = _run(x, bank, slots, weights, precision="bf16", out=nan_like(x.shape, torch.float32, "cuda"))
    emulated = expert_swiglu_reference(x, bank, slots, weights, act_dtype=torch.bfloat16, out_dtype=torch.float32)
    assert torch.isfinite(out).all()
    assert relative_error(out, emulated) <= 1e-3
    assert relative_error(out, expert_swiglu_reference(x, bank, slots, weights, out_dtype=torch.float32)) <= 1e-2
