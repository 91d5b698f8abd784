"""router_top_k_triton against torch's softmax + topk + renormalise (router_top_k_reference).

The expert ids must be the same, in the same (descending) order; the weights agree to 1e-6
relative (float32 throughout; exp and the sums are computed differently, a few ulps apart).
Logits are random normals scaled so probabilities spread as a trained router's do; with 512
experts in float32 no two are equal, so the order is defined."""

from __future__ import annotations

import pytest
import torch

from flashpack.runtime.kernels.reference import router_top_k_reference

pytest.importorskip("triton")

WEIGHT_TOL = 1e-6


def _logits(rows: int, experts: int, dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    return (3 * torch.randn(rows, experts, generator=torch.Generator().manual_seed(seed))).to(device, dtype)


@pytest.mark.parametrize("num_warps", [4, 1])
@pytest.mark.parametrize("rows,experts,k,renormalise,dtype", [
    (1, 512, 10, True, torch.float32),   # the real router, one decode token
    (3, 40, 5, False, torch.bfloat16),   # not a power of two: masked lanes
    (2, 17, 17, True, torch.float32),    # k = E: every expert, in order
])
def test_matches_reference(triton_device, rows, experts, k, renormalise, dtype, num_warps):
    from flashpack.runtime.kernels.router_top_k import router_top_k_triton

    logits = _logits(rows, experts, dtype, triton_device)
    weights, ids = router_top_k_triton(logits, k, renormalise, num_warps=num_warps)
    want_weights, want_ids = router_top_k_reference(logits, k, renormalise)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), want_ids.cpu())
    assert ((weights - want_weights).abs().max() / want_weights.abs().max()).item() <= WEIGHT_TOL


def test_strided_rows(triton_device):
    """The router's logits are columns of a stacked projection's output: rows are strided."""
    from flashpack.runtime.kernels.router_top_k import router_top_k_triton

    stacked = _logits(2, 700, torch.float32, triton_device, seed=1)
    weights, ids = router_top_k_triton(stacked[:, :512], 10, True)
    want_weights, want_ids = router_top_k_reference(stacked[:, :512].contiguous(), 10, True)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    assert torch.allclose(weights, want_weights, rtol=WEIGHT_TOL, atol=0)


def test_ties_go_to_the_lowest_index(triton_device):
    """bfloat16 router logits tie often; equal probabilities are picked lowest index first (the
    set torch's radix select keeps at the k-th value), so a stable descending sort is the answer."""
    from flashpack.runtime.kernels.router_top_k import router_top_k_triton

    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.5, 3.0]], device=triton_device)
    weights, ids = router_top_k_triton(logits, 5, False)
    probs = torch.softmax(logits.float(), dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :5]
    assert ids.cpu().tolist() == order.cpu().tolist() == [[1, 3, 7, 2, 4]]
    assert torch.allclose(weights, probs.gather(-1, order), rtol=WEIGHT_TOL, atol=0)


def test_wrong_choice_control(triton_device):
    """A check that can fail: the kernel's answer for other logits (the least likely expert pushed
    to the top) must not pass as the reference's."""
    from flashpack.runtime.kernels.router_top_k import router_top_k_triton

    logits = _logits(1, 64, torch.float32, triton_device, seed=2)
    _, want_ids = router_top_k_reference(logits, 4, True)
    pushed = logits.clone()
    pushed[0, logits[0].argmin()] += 100
    _, ids = router_top_k_triton(pushed, 4, True)
    assert not torch.equal(ids.cpu(), want_ids.cpu())
