"""The two RMS norms of qwen4_exp, and the activations the config may name.

`RMSNorm` is zero-centred: weights are stored as w and applied as (1 + w), in fp32, optionally
per group (the hyper-connection and PLE norms normalise each H-sized stream of the hc x H layout
separately while keeping one weight per element). `GatedRMSNorm` is the DeltaNet output norm:
a plain weight (starts at 1), gated by act(z).

With `use_kernel` set (Qwen4ExpModel's `fused_norms`, CUDA only), an `RMSNorm` run outside a
compile takes one Triton kernel (runtime/kernels/rms_norm.py) instead of `rms_norm`'s seven, which
stays the reference it is tested against; inside a compile the code below is traced and fused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}: flashpack knows {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None) -> torch.Tensor:
    """x [..., D] -> x / rms(x) * (1 + weight), computed in fp32 and returned in x's dtype.

    With `group_size`, the rms is taken over consecutive groups of that many elements of D.
    """
    out = x.float()
    if group_size is not None:
        out = out.unflatten(-1, (-1, group_size))
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    if group_size is not None:
        out = out.flatten(-2)
    return (out * (1.0 + weight.float())).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, group_size: int | None = None):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.eps = eps
        self.group_size = group_size
        self.use_kernel = False  # the model sets it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernel and x.is_cuda and not torch.compiler.is_compiling():
            from flashpack.runtime.kernels.rms_norm import rms_norm_triton

            return rms_norm_triton(x, self.weight, self.eps, self.group_size)
        return rms_norm(x, self.weight, self.eps, self.group_size)


class GatedRMSNorm(nn.Module):
    """x [..., D], gate [..., D] -> weight * x / rms(x) * act(gate); rounding points as transformers."""

    def __init__(self, weight: torch.Tensor, eps: float, activation_name: str):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.eps = eps
        self.act = activation(activation_name)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = self.weight * normed.to(dtype)
        return (normed * self.act(gate.float())).to(dtype)
