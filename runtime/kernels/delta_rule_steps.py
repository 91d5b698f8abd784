"""Triton: the gated delta rule over a speculative step's few tokens in one launch, keeping the
state after each token.

A checked step's rollback needs DeltaNet's recurrent state after every one of its T tokens
(`DeltaNetState.rewind`). flash-linear-attention's recurrent kernel returns only the final state:
run once a token, with the states stacked, that is T launches and a copy of all T states a layer.
Here one program a (value head, block of BV value columns) holds its [K, BV] slice of the
state in registers, runs the T tokens and stores the state after each, as well as each output.

Each token's arithmetic is that of fla's kernel (fla/ops/gated_delta_rule/fused_recurrent.py) for
one token, operation for operation, with its block shape and one warp. It is not bit for bit the
same: on an H100 the outputs or states of a step of 2-16 tokens differ from fla's, run a token at a
time, in some bits (bench/results/kernels-delta-steps-run81-h100.json; most likely the unrolled loop
compiled otherwise), and the GPU test holds the float32 states to 1e-5 relative of fla's. A checked
step already rounds otherwise than one-token steps elsewhere (its projections run other kernels), so
greedy speculation on a GPU agrees with plain decoding up to near-ties. The plain form is
`recurrent_gated_delta_rule(each=True)` in runtime/model/delta_rule.py;
tests/kernels/test_delta_rule_steps.py compares the two, and on a GPU this kernel with fla's token by
token. 7.4 us for 5 tokens against 61.9 us for fla's five calls and the stack (H100,
`bench/kernels.py --only delta-steps`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 8  # value columns a program: fla's recurrent kernel's, for the same reduction shapes


@triton.jit
def _delta_rule_steps_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, initial_ptr, out_ptr, states_ptr, scale,
    q_token, q_head, q_dim, k_token, k_head, k_dim, v_token, v_head, v_dim, g_token, beta_token,
    TOKENS: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr,
):
    value_head = tl.program_id(1)
    key_head = value_head // (HV // H)  # each key head serves HV / H consecutive value heads
    ks = tl.arange(0, BK)
    vs = tl.program_id(0) * BV + tl.arange(0, BV)
    k_mask, v_mask = ks < K, vs < V
    mask = k_mask[:, None] & v_mask[None, :]
    cell = value_head * K * V + ks[:, None] * V + vs[None, :]  # this program's [BK, BV] of a state
    state = tl.load(initial_ptr + cell, mask=mask, other=0).to(tl.float32)
    # a constexpr count, unrolled: a checked step has a few lengths (2..16 tokens), each a kernel
    # built once, and Triton's CPU interpreter loops over no runtime argument
    for t in tl.static_range(TOKENS):
        q = tl.load(q_ptr + t * q_token + key_head * q_head + ks * q_dim, mask=k_mask, other=0).to(tl.float32)
        k = tl.load(k_ptr + t * k_token + key_head * k_head + ks * k_dim, mask=k_mask, other=0).to(tl.float32)
        v = tl.load(v_ptr + t * v_token + value_head * v_head + vs * v_dim, mask=v_mask, other=0).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
        q = q * scale
        beta = tl.load(beta_ptr + t * beta_token + value_head).to(tl.float32)
        g = tl.load(g_ptr + t * g_token + value_head).to(tl.float32)
        state *= tl.exp(g)
        v = beta * (v - tl.sum(state * k[:, None], 0))  # what the token writes: beta (v - S^T k)
        state += k[:, None] * v
        out = tl.sum(state * q[:, None], 0)
        tl.store(out_ptr + (t * HV + value_head) * V + vs, out.to(out_ptr.dtype.element_ty), mask=v_mask)
        tl.store(states_ptr + t * (HV * K * V) + cell, state, mask=mask)


@torch.compiler.disable  # a Triton kernel of its own: compiled checked steps launch it as it is
def delta_rule_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk] and v [T, Hv, Dv], any strides; g [T, Hv] (log decay) and beta [T, Hv], rows
    contiguous; state [Hv, Dk, Dv] fp32, left as it was. Returns (out [T, Hv, Dv] in v's dtype, the
    state after each token [T, Hv, Dk, Dv] fp32); q and k are l2-normalised and q scaled by
    1/sqrt(Dk) inside, as fla's recurrent kernel does with `use_qk_l2norm_in_kernel`."""
    tokens, key_heads, key_dim = k.shape
    value_heads, value_dim = v.shape[1:]
    # as the engine hands them to fla: decays in float32, write strengths in the values' dtype
    g, beta = g.float().contiguous(), beta.to(v.dtype).contiguous()
    state = state.contiguous()
    out = torch.empty(tokens, value_heads, value_dim, dtype=v.dtype, device=v.device)
    states = torch.empty(tokens, value_heads, key_dim, value_dim, dtype=torch.float32, device=v.device)
    block_v = min(BLOCK_V, triton.next_power_of_2(value_dim))
    grid = (triton.cdiv(value_dim, block_v), value_heads)
    _delta_rule_steps_kernel[grid](
        q, k, v, g, beta, state, out, states, key_dim ** -0.5,
        *q.stride(), *k.stride(), *v.stride(), g.stride(0), beta.stride(0),
        TOKENS=tokens, H=key_heads, HV=value_heads, K=key_dim, V=value_dim, BK=triton.next_power_of_2(key_dim),
        BV=block_v,
        num_warps=1, num_stages=3,
    )
    return out, states
