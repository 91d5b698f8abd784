"""Hyper-connections: the residual is hc_count streams, mixed into one block input and injected back.

Streams are laid out [T, hc * H] (stream outer, hidden inner). Around every attention and MoE block:

    block_input, inject = hc.mix(streams)          # gated low-rank mean over the normalised streams
    streams = hc.combine(streams, block(block_input), inject)

`combine` adds the block output to every stream with weight 2 * sigmoid(inject_logit / hc); an
`inject` of None adds it with unit weight to every stream (how the MTP head feeds its projected
token embedding in, as vLLM's delayed combine does with prev_injection=None). The final mixer is
a `GatedResidual` without injection weights: its `mix` collapses the streams for the lm_head.

With `fused` set (Qwen4ExpModel's `fused_mix`, CUDA only), a one-token mix runs as two Triton
kernels (runtime/kernels/hc_mix.py) instead of the seven a compiled step makes of the code below,
which stays the reference they are tested against. A checked step's few tokens take the code: the
kernels read the mix's weights once a token, and lose at 3 and 5 tokens (bench/kernels.py
--only hc-mix on an H200: 20.3 against 18.2 us, 28.0 against 23.4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashpack.layout.model_config import TextConfig
from flashpack.runtime.model.linear import DenseLinear, StackedLinear
from flashpack.runtime.model.norms import RMSNorm
from flashpack.runtime.weights import WeightSource, load_dense


class GatedResidual(nn.Module):
    def __init__(
        self, cfg: TextConfig, source: WeightSource, prefix: str, dtype: torch.dtype,
        device: torch.device | str, inject: bool = True,
    ):
        super().__init__()
        self.hc, self.hidden = cfg.hc_count, cfg.hidden_size
        load = lambda name: load_dense(source, prefix + name, dtype, device)  # noqa: E731
        self.norm = RMSNorm(load("hc_norm.weight"), cfg.rms_norm_eps, group_size=cfg.hidden_size)
        # The low-rank mix's down projection [R, hc*H] and the injection weights [hc, hc*H] both read
        # the normalised streams: one stacked projection.
        names = ["input_mix_weight_down.weight"] + (["block_inject_weight.weight"] if inject else [])
        self.in_proj = StackedLinear(source, [prefix + name for name in names], dtype, device)
        self.mix_up = DenseLinear(source, prefix + "input_mix_weight_up.weight", dtype, device)  # [hc*H, R]
        self.inject = inject
        self.fused = False

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams [T, hc*H] -> block input [T, H], injection weights [T, hc] (None for a final mixer)."""
        if self.fused and streams.shape[0] == 1 and not any(self.in_proj.is_fp8):
            return self._mix_fused(streams)
        normed = self.norm(streams)
        down, *inject = self.in_proj(normed)
        gate = F.silu(down / self.hc)
        gate = torch.sigmoid(self.mix_up(gate)).unflatten(-1, (self.hc, self.hidden))
        block_input = (gate * normed.unflatten(-1, (self.hc, self.hidden))).mean(dim=-2)
        if not inject:  # a final mixer
            return block_input, None
        return block_input, 2 * torch.sigmoid(inject[0] / self.hc)

    @torch.compiler.disable  # two Triton kernels, launched as they are from a compiled step
    def _mix_fused(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        from flashpack.runtime.kernels.hc_mix import hc_mix_triton

        block_input, inject = hc_mix_triton(streams, self.norm.weight, self.norm.eps, self.in_proj.weight,
                                            self.mix_up.weight, self.hc, self.inject)
        return block_input, None if inject is None else inject.to(streams.dtype)

    def combine(
        self, streams: torch.Tensor, block_output: torch.Tensor, inject: torch.Tensor | None
    ) -> torch.Tensor:
        """streams [T, hc*H] + block_output [T, H] weighted per stream by inject [T, hc] (None: weight 1)."""
        return combine(streams, block_output, inject, self.hc)


def combine(streams: torch.Tensor, block_output: torch.Tensor, inject: torch.Tensor | None, hc: int) -> torch.Tensor:
    if inject is None:
        added = block_output.unsqueeze(-2).expand(*block_output.shape[:-1], hc, block_output.shape[-1])
    else:
        added = block_output.unsqueeze(-2) * inject.unsqueeze(-1)
    return streams + added.flatten(-2)
