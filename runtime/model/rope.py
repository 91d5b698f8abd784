"""Partial rotary position embedding for text positions.

qwen4_exp uses multimodal rotary sections (`mrope_section`), but for text every section sees the
same position, so the tables reduce to plain rotary over the first `rotary_dim` channels of a head
(rotate-half layout). The indexer reuses these tables for its heads, which is why rotary_dim must
fit the indexer head.
"""

from __future__ import annotations

import torch

from flashpack.layout.model_config import TextConfig


class Rotary:
    """cos/sin tables on demand for any positions; no state beyond inv_freq."""

    def __init__(self, cfg: TextConfig, device: torch.device | str):
        dim = cfg.rotary_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        self.inv_freq = (1.0 / (cfg.rope_theta ** exponents)).to(device)
        self.dim = dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] -> cos, sin [T, rotary_dim] in `dtype` (computed in fp32)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, R] with R <= D: rotate the first R channels of every head."""
    rotary = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rope, x_pass = x[..., :rotary], x[..., rotary:]
    x_rope = x_rope * cos + rotate_half(x_rope) * sin
    return torch.cat((x_rope, x_pass), dim=-1)
