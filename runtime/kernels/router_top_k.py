"""The MoE router's choice in one launch: softmax over the experts, top-k, renormalise.

torch spends three to four launches on it (softmax, a radix select and a sort for `topk`, the
renormalising sum and divide); on an H200 the select and sort alone took about 11 us a decode
step's layer (bench/results/profile-decode-resident-run10-h200.txt), for 512 logits. One program a row
holds the row in registers, takes the maximum k times (the lowest index among equal
probabilities) and writes the weights and ids in descending order, as `torch.topk` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _router_top_k_kernel(
    logits_ptr, weights_ptr, ids_ptr, row_stride,
    E: tl.constexpr, K: tl.constexpr, BLOCK_E: tl.constexpr, K_POW2: tl.constexpr, RENORMALISE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    logits = tl.load(logits_ptr + row * row_stride + experts, mask=valid, other=-float("inf")).to(tl.float32)
    exp = tl.exp(logits - tl.max(logits, axis=0))
    probs = exp / tl.sum(exp, axis=0)
    remaining = tl.where(valid, probs, -1.0)  # probabilities are >= 0: -1 is never picked
    picks = tl.arange(0, K_POW2)
    weights = tl.zeros([K_POW2], dtype=tl.float32)
    ids = tl.zeros([K_POW2], dtype=tl.int64)
    for i in tl.static_range(K):
        best = tl.max(remaining, axis=0)
        index = tl.min(tl.where(remaining == best, experts, BLOCK_E), axis=0)
        weights = tl.where(picks == i, best, weights)
        ids = tl.where(picks == i, index.to(tl.int64), ids)
        remaining = tl.where(experts == index, -1.0, remaining)
    if RENORMALISE:
        weights = weights / tl.sum(weights, axis=0)  # lanes past K hold 0
    tl.store(weights_ptr + row * K + picks, weights, mask=picks < K)
    tl.store(ids_ptr + row * K + picks, ids, mask=picks < K)


def router_top_k_triton(
    logits: torch.Tensor, k: int, renormalise: bool, num_warps: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (rows may be strided) -> (weights float32 [T, k], expert ids int64 [T, k]).
    One warp needs no barrier between the k rounds (65 in the PTX at 4 warps, none at 1): 3.3 us a
    call on an H200 against 4.1 at 4 warps (`bench/kernels.py --only router`)."""
    rows, experts = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(rows, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=logits.device)
    if rows:
        _router_top_k_kernel[(rows,)](
            logits, weights, ids, logits.stride(0), experts, k,
            BLOCK_E=triton.next_power_of_2(experts), K_POW2=triton.next_power_of_2(k), RENORMALISE=renormalise,
            num_warps=num_warps,
        )
    return weights, ids
