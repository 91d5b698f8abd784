"""The gated delta rule: the recurrence at the heart of Gated DeltaNet, plain and on GPU kernels.

Per value head, with q and k l2-normalised and q scaled by 1/sqrt(Dk), for each token t:

    S = exp(g_t) * S                              decay (g_t <= 0)
    S = S + k_t (beta_t * (v_t - S^T k_t))^T      delta-rule write
    o_t = S^T q_t

`recurrent_gated_delta_rule` runs that loop (decode); `chunk_gated_delta_rule` computes the same
thing a chunk at a time with a triangular solve (prompts). Both are plain fp32 torch and are the
reference. On CUDA `gated_delta_rule` takes flash-linear-attention's Triton kernels instead
(package fla-core, the `cuda` extra): they are the kernels transformers' own qwen4_exp calls when
they are installed, a well-kept library rather than kernels of ours. They do not run in Triton's
CPU interpreter, so they are checked against the plain forms on a GPU only
(tests/runtime/test_delta_rule.py).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F

from flashpack.runtime.kernels import use_triton


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, backend: str = "auto", recurrent_max_tokens: int = 1):
    """q, k [T, Hk, Dk], each head serving Hv / Hk consecutive value heads; v [T, Hv, Dv]; g, beta
    [T, Hv] fp32; state [Hv, Dk, Dv] fp32. Returns (out [T, Hv, Dv], new state fp32); `state` itself
    is left as it was. backend: "auto" (fla on CUDA when installed), "triton" (fla), "reference".
    Steps of up to `recurrent_max_tokens` tokens run the recurrence, longer ones the chunked form."""
    return gated_delta_rule_for(q.device, backend)(q, k, v, g, beta, state, recurrent_max_tokens)


def gated_delta_rule_for(device: torch.device | str, backend: str = "auto") -> Callable:
    """`gated_delta_rule`'s implementation for tensors on `device`, picked once (a layer keeps it)."""
    if use_triton(device, backend) and (backend == "triton" or fla_available()):
        return fla_gated_delta_rule
    return plain_gated_delta_rule


def fla_kernels(device: torch.device | str) -> bool:
    """Whether the delta rule on `device` runs as fla's kernels (gated_delta_rule_for's choice)."""
    return gated_delta_rule_for(device) is fla_gated_delta_rule


def delta_rule_positions(rule: Callable, q, k, v, g, beta, state: torch.Tensor):
    """The recurrence of `rule`'s backend a token at a time: (out [T, Hv, Dv], the state after each
    token [T, Hv, Dk, Dv]).
    For the few tokens of a speculative step, whose rollback needs the state after each; they are
    the one-token computations plain decoding would have done. The plain rule runs them in one
    pass of its own loop, its inputs prepared once rather than once a token (on a CPU preparing
    them costs more than a token's recurrence), every token's arithmetic as a one-token call does it.
    Where `rule` is fla's (the GPU), one launch of runtime/kernels/delta_rule_steps.py does each
    token's arithmetic as fla's one-token kernel does (compiled otherwise: not bit for bit), keeping
    every token's state, where fla's kernel returns only the last."""
    if rule is plain_gated_delta_rule:
        return plain_gated_delta_rule(q, k, v, g, beta, state, each=True)
    from flashpack.runtime.kernels.delta_rule_steps import delta_rule_steps

    return delta_rule_steps(q, k, v, g, beta, state)


def plain_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, recurrent_max_tokens: int = 1, each: bool = False):
    """The plain forms: up to `recurrent_max_tokens` tokens by the recurrence, more by chunks;
    `each`: every token by the recurrence, returning the state after each (delta_rule_positions)."""
    groups = v.shape[1] // q.shape[1]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
    if each:
        return recurrent_gated_delta_rule(q, k, v, g, beta, state, each=True)
    rule = recurrent_gated_delta_rule if q.shape[0] <= recurrent_max_tokens else chunk_gated_delta_rule
    return rule(q, k, v, g, beta, state)


@torch.compiler.disable  # Triton kernels of their own: compiled decode steps call them as they are
def fla_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, recurrent_max_tokens: int = 1):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent

    # Steps of up to recurrent_max_tokens tokens go to the recurrent kernel (one launch), which
    # normalises q and k itself; longer ones to the chunked one, given them normalised
    # (l2_normalised says why).
    recurrent = q.shape[0] <= recurrent_max_tokens
    if not recurrent:
        q, k = l2_normalised(q), l2_normalised(k)
    # By keyword: the two entry points order their optional arguments differently (the recurrent
    # one takes per-key and per-value decays between g and beta).
    out, final = (fla_recurrent if recurrent else fla_chunk)(
        q[None], k[None], v[None], g=g[None].float(), beta=beta[None].to(v.dtype), scale=q.shape[-1] ** -0.5,
        initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=recurrent,
    )
    return out[0], final[0]


def l2_normalised(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dimension, in float32, back in x's dtype: what fla's
    chunked rule does with `use_qk_l2norm_in_kernel` (its l2norm_fwd), as torch ops. That kernel is
    autotuned once for every 65,536 rows, 4,096 prompt tokens at 16 key heads: 25 configurations
    built and timed the first time a prompt reaches each such length, 10-14 s on the H200 with
    empty compile caches (bench/first_requests.py), which no warm-up short of every length avoids."""
    wide = x.float()
    return (wide / torch.sqrt((wide * wide).sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _prepare(q, k, v, g, beta):
    """[T, heads, D] inputs -> fp32 [heads, T, ...] with q, k l2-normalised and q scaled."""
    q, k, v, g, beta = (x.transpose(0, 1).float() for x in (q, k, v, g, beta))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, each: bool = False):
    """q, k [T, Hv, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state [Hv, Dk, Dv] fp32.

    Returns (out [T, Hv, Dv] fp32, new state), or with `each` (out, the state after each token
    [T, Hv, Dk, Dv])."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    out = torch.empty_like(v)
    states = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        predicted = (state * k[:, t, :, None]).sum(dim=-2)  # S^T k  [Hv, Dv]
        delta = (v[:, t] - predicted) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (state * q[:, t, :, None]).sum(dim=-2)
        if each:
            states.append(state)
    return out.transpose(0, 1), torch.stack(states) if each else state


def chunk_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, chunk: int = 64):
    """Same contract as `recurrent_gated_delta_rule`, `chunk` tokens per step of the scan.

    Within a chunk (G = cumulative g, decay(i, j) = exp(G_i - G_j)), the values actually written,
    U, solve (I + A) U = beta * (V - exp(G) K S0) with A[i, j] = beta_i decay(i, j) k_i.k_j for j < i.
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    length = q.shape[1]
    pad = (-length) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)).unflatten(1, (-1, chunk)) for x in (q, k, v))  # [Hv, N, C, D]
    g, beta = (F.pad(x, (0, pad)).unflatten(1, (-1, chunk)) for x in (g, beta))  # [Hv, N, C]

    G = g.cumsum(-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [Hv, N, C, C]
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    system = system + torch.eye(chunk, dtype=q.dtype, device=q.device)
    u_values = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    u_state = torch.linalg.solve_triangular(
        system, beta[..., None] * G.exp()[..., None] * k, upper=False, unitriangular=True
    )
    scores = (q @ k.transpose(-1, -2)) * decay  # causal within the chunk, diagonal included
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()  # [Hv, N]

    out = torch.empty_like(v)
    for n in range(q.shape[1]):
        u = u_values[:, n] - u_state[:, n] @ state  # [Hv, C, Dv]
        out[:, n] = q_decayed[:, n] @ state + scores[:, n] @ u
        state = state * chunk_decay[:, n, None, None] + k_to_end[:, n].transpose(-1, -2) @ u
    out = out.flatten(1, 2)[:, :length]
    return out.transpose(0, 1), state
