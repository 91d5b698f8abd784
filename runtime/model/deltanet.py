"""Gated DeltaNet: linear attention with a decaying, delta-rule-updated state per value head.

The projections feed `gated_delta_rule` (delta_rule.py: the recurrence itself, plain or
flash-linear-attention's kernels) with g_t = -exp(A_log) * softplus(a_t + dt_bias) and
beta_t = sigmoid(b_t); q, k, v first pass a depthwise causal conv (kernel 4) + SiLU whose input
tail lives in the state, and the output is normed, gated by z and projected back. The code before
and after the recurrence is two module-level functions, `step_inputs` and `step_output`, compiled
with `compile_pieces` (compiled.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flashpack.layout.model_config import TextConfig
from flashpack.runtime.model.compiled import piece
from flashpack.runtime.model.delta_rule import delta_rule_positions, gated_delta_rule_for
from flashpack.runtime.model.linear import DenseLinear, StackedLinear
from flashpack.runtime.model.norms import GatedRMSNorm, activation
from flashpack.runtime.state import DeltaNetState
from flashpack.runtime.weights import WeightSource, load_dense


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: TextConfig, source: WeightSource, prefix: str, dtype: torch.dtype, device):
        super().__init__()
        self.key_heads, self.value_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        self.key_head_dim, self.value_head_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.act = activation(cfg.hidden_act)
        self.delta_rule = gated_delta_rule_for(device)
        self.recurrent_max_tokens = 1  # steps of up to this many tokens by the recurrence (Qwen4ExpModel sets it)
        self.compile_pieces = False  # the model sets it (compiled.py)
        load = lambda name: load_dense(source, prefix + name, dtype, device)  # noqa: E731
        # qkv [2Kd + Vd, H], z [Vd, H], b and a [Hv, H]: one stacked projection of x
        projections = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        self.in_proj = StackedLinear(source, [f"{prefix}{name}.weight" for name in projections], dtype, device)
        self.register_buffer("conv_weight", load("conv1d.weight"), persistent=False)  # [2Kd + Vd, 1, K]
        self.register_buffer("A_log", load("A_log"), persistent=False)
        self.register_buffer("dt_bias", load("dt_bias"), persistent=False)
        self.out_proj = DenseLinear(source, prefix + "out_proj.weight", dtype, device)  # [H, Vd]
        self.norm = GatedRMSNorm(load("norm.weight"), cfg.rms_norm_eps, cfg.output_gate_type)

    def forward(self, x: torch.Tensor, state: DeltaNetState, marks: Sequence[int] = (),
                marked: list[DeltaNetState] | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; advances `state` (conv tail, recurrent state) by T tokens. `marks`:
        token counts inside the T (ascending) after which the state is also wanted, appended to
        `marked`: the recurrence runs segment by segment (each a separate step's arithmetic), the
        rest once over all T, each mark's conv tail a slice of the step's conv window."""
        # a speculative step's conv is the plain code's (each token's float32 dot as decode's)
        q, k, v, g, beta, z, window = piece(step_inputs, self.compile_pieces and not state.tracked)(
            self, x, state.conv, state.tracked)
        if state.tracked:  # the state after each token, to stand after any of them
            state.window = window
            out, state.positions = delta_rule_positions(self.delta_rule, q, k, v, g, beta, state.recurrent)
            recurrent = state.positions[-1]
        elif marks:
            out, recurrent = self._segments(q, k, v, g, beta, state, marks, window, marked)
        else:
            out, recurrent = self.delta_rule(q, k, v, g, beta, state.recurrent, self.recurrent_max_tokens)
        state.recurrent.copy_(recurrent)  # in place: a captured CUDA graph keeps reading this buffer
        # One layout for every step, so that a compiled step_output is one variant: the rule's output
        # may be a transposed view of a padded buffer (the plain chunked rule), a view of a batch of
        # one (fla's) or a concatenation (segments); contiguous (a copy only off the GPU: fla's is
        # already) and detached from its base, whose sizes dynamo would otherwise guard on.
        return piece(step_output, self.compile_pieces)(self, out.contiguous().detach(), z)

    def _segments(self, q, k, v, g, beta, state: DeltaNetState, marks: Sequence[int], window: torch.Tensor,
                  marked: list[DeltaNetState]) -> tuple[torch.Tensor, torch.Tensor]:
        """The recurrence a segment at a time from `state.recurrent`, the state at each mark appended
        to `marked`: (outputs [T, ...], the final recurrent state)."""
        outputs, tail = [], state.conv.shape[1]
        for start, end in zip([0, *marks], [*marks, q.shape[0]]):
            out, recurrent = self.delta_rule(q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end],
                                             state.recurrent, self.recurrent_max_tokens)
            state.recurrent.copy_(recurrent)
            outputs.append(out)
            if end < q.shape[0]:
                marked.append(DeltaNetState(window[:, end:end + tail].clone(), state.recurrent.clone()))
        return torch.cat(outputs), state.recurrent

    def causal_conv(self, x: torch.Tensor, conv: torch.Tensor, tracked: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Depthwise causal conv + activation over x [T, C], continuing from the conv tail `conv`
        [C, K - 1], advanced in place: (the output [T, C], the window [C, K - 1 + T]: the tail before
        the step, then its inputs). `tracked`: a speculative step's, each token's dot as decode's."""
        full = torch.cat([conv, x.transpose(0, 1)], dim=-1)  # [C, K - 1 + T]
        conv.copy_(full[:, full.shape[1] - conv.shape[1]:])
        if x.shape[0] == 1:
            # One token is a K-tap dot a channel: as a product and a sum, torch.compile fuses it with
            # the cat, the state update and the activation (a conv1d is a kernel of its own).
            out = (full.float() * self.conv_weight[:, 0].float()).sum(-1, keepdim=True).to(x.dtype)
        elif tracked:
            # A speculative step's few tokens: each the same float32 dot as a token decoded alone, so
            # that the step rounds as plain decoding does
            windows = full.unfold(1, self.conv_weight.shape[-1], 1)  # [C, T, K]
            out = (windows.float() * self.conv_weight[:, 0, None].float()).sum(-1).to(x.dtype)
        else:
            out = F.conv1d(full[None], self.conv_weight, groups=full.shape[0])[0]
        return self.act(out).transpose(0, 1), full


def step_inputs(mixer: GatedDeltaNet, x: torch.Tensor, conv: torch.Tensor, tracked: bool):
    """A step's projections and causal conv (the conv tail `conv` advanced in place), the
    recurrence's inputs: (q, k [T, Hk, Dk], v [T, Hv, Dv], g (float32), beta [T, Hv], the output
    gate z [T, Hv, Dv], the conv window [C, K - 1 + T])."""
    length = x.shape[0]
    qkv, z, b, a = mixer.in_proj(x)
    qkv, window = mixer.causal_conv(qkv, conv, tracked)
    q, k, v = torch.split(qkv, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    q = q.reshape(length, mixer.key_heads, mixer.key_head_dim)
    k = k.reshape(length, mixer.key_heads, mixer.key_head_dim)
    v = v.reshape(length, mixer.value_heads, mixer.value_head_dim)
    beta = torch.sigmoid(b)
    g = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)
    return q, k, v, g, beta, z.reshape(length, mixer.value_heads, mixer.value_head_dim), window


def step_output(mixer: GatedDeltaNet, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The recurrence's output [T, Hv, Dv], normed and gated by z, projected back: [T, H]."""
    out = mixer.norm(out.to(z.dtype), z).reshape(out.shape[0], mixer.value_dim)
    return mixer.out_proj(out)
