"""Gated DeltaNet: linear attention with a decaying, delta-rule-updated state per value head.

Per head, with q and k l2-normalised and q scaled by 1/sqrt(Dk), for each token t:

    S = exp(g_t) * S                              decay, g_t = -exp(A_log) * softplus(a_t + dt_bias)
    S = S + k_t (beta_t * (v_t - S^T k_t))^T      delta-rule write, beta_t = sigmoid(b_t)
    o_t = S^T q_t

`recurrent_gated_delta_rule` runs that loop (decode); `chunk_gated_delta_rule` computes the same
thing a chunk at a time with a triangular solve (prompts). Both are plain fp32 torch; q, k, v
first pass a depthwise causal conv (kernel 4) + SiLU whose input tail lives in the state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashpack.layout.model_config import TextConfig
from flashpack.runtime.model.linear import DenseLinear
from flashpack.runtime.model.norms import GatedRMSNorm, activation
from flashpack.runtime.state import DeltaNetState
from flashpack.runtime.weights import WeightSource, load_dense


def _prepare(q, k, v, g, beta):
    """[T, heads, D] inputs -> fp32 [heads, T, ...] with q, k l2-normalised and q scaled."""
    q, k, v, g, beta = (x.transpose(0, 1).float() for x in (q, k, v, g, beta))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor):
    """q, k [T, Hv, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state [Hv, Dk, Dv] fp32.

    Returns (out [T, Hv, Dv] fp32, new state)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[:, None, None]
        predicted = (state * k[:, t, :, None]).sum(dim=-2)  # S^T k  [Hv, Dv]
        delta = (v[:, t] - predicted) * beta[:, t, None]
        state = state + k[:, t, :, None] * delta[:, None, :]
        out[:, t] = (state * q[:, t, :, None]).sum(dim=-2)
    return out.transpose(0, 1), state


def chunk_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, chunk: int = 64):
    """Same contract as `recurrent_gated_delta_rule`, `chunk` tokens per step of the scan.

    Within a chunk (G = cumulative g, decay(i, j) = exp(G_i - G_j)), the values actually written,
    U, solve (I + A) U = beta * (V - exp(G) K S0) with A[i, j] = beta_i decay(i, j) k_i.k_j for j < i.
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    heads, length, _ = q.shape
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


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: TextConfig, source: WeightSource, prefix: str, dtype: torch.dtype, device):
        super().__init__()
        self.key_heads, self.value_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        self.key_head_dim, self.value_head_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.act = activation(cfg.hidden_act)
        load = lambda name: load_dense(source, prefix + name, dtype, device)  # noqa: E731
        self.in_proj_qkv = DenseLinear(source, prefix + "in_proj_qkv.weight", dtype, device)  # [2Kd + Vd, H]
        self.in_proj_z = DenseLinear(source, prefix + "in_proj_z.weight", dtype, device)  # [Vd, H]
        self.register_buffer("in_proj_b", load("in_proj_b.weight"), persistent=False)  # [Hv, H]
        self.register_buffer("in_proj_a", load("in_proj_a.weight"), persistent=False)  # [Hv, H]
        self.register_buffer("conv_weight", load("conv1d.weight"), persistent=False)  # [2Kd + Vd, 1, K]
        self.register_buffer("A_log", load("A_log"), persistent=False)
        self.register_buffer("dt_bias", load("dt_bias"), persistent=False)
        self.out_proj = DenseLinear(source, prefix + "out_proj.weight", dtype, device)  # [H, Vd]
        self.norm = GatedRMSNorm(load("norm.weight"), cfg.rms_norm_eps, cfg.output_gate_type)

    def forward(self, x: torch.Tensor, state: DeltaNetState) -> torch.Tensor:
        """x [T, H] -> [T, H]; advances `state` (conv tail, recurrent state) by T tokens."""
        length = x.shape[0]
        qkv = self.causal_conv(self.in_proj_qkv(x), state)
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(length, self.key_heads, self.key_head_dim)
        k = k.reshape(length, self.key_heads, self.key_head_dim)
        v = v.reshape(length, self.value_heads, self.value_head_dim)
        if self.value_heads != self.key_heads:  # each q/k head serves consecutive value heads
            q = q.repeat_interleave(self.value_heads // self.key_heads, dim=1)
            k = k.repeat_interleave(self.value_heads // self.key_heads, dim=1)
        beta = torch.sigmoid(F.linear(x, self.in_proj_b))
        g = -self.A_log.float().exp() * F.softplus(F.linear(x, self.in_proj_a).float() + self.dt_bias)

        rule = recurrent_gated_delta_rule if length == 1 else chunk_gated_delta_rule
        out, recurrent = rule(q, k, v, g, beta, state.recurrent)
        state.recurrent.copy_(recurrent)  # in place: a captured CUDA graph keeps reading this buffer
        z = self.in_proj_z(x).reshape(length, self.value_heads, self.value_head_dim)
        out = self.norm(out.to(x.dtype), z).reshape(length, self.value_dim)
        return self.out_proj(out)

    def causal_conv(self, x: torch.Tensor, state: DeltaNetState) -> torch.Tensor:
        """Depthwise causal conv + activation over x [T, C], continuing from state.conv [C, K - 1]."""
        full = torch.cat([state.conv, x.transpose(0, 1)], dim=-1)  # [C, K - 1 + T]
        state.conv.copy_(full[:, full.shape[1] - state.conv.shape[1]:])
        out = F.conv1d(full[None], self.conv_weight, groups=full.shape[0])[0]
        return self.act(out).transpose(0, 1)
