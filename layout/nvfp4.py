"""Decoding NVFP4 (two-level E2M1) and row-scaled FP8 tensors as the pack stores them.

NVFP4: each byte holds two E2M1 values, element 2i in the low nibble; bit 3 of a nibble is the
sign, bits 0-2 index the magnitudes below. Every 16 consecutive elements of a row share one
float8_e4m3fn block scale, and the whole tensor one float32 global scale:
    value = E2M1[nibble] * float(block_scale[o, i // 16]) * global_scale
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass(frozen=True)
class NVFP4Tensor:
    packed: torch.Tensor  # uint8 [out, in // 2]
    block_scale: torch.Tensor  # float8_e4m3fn [out, in // 16]
    global_scale: torch.Tensor  # float32 scalar


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [16]: the value of every 4-bit code, sign in bit 3."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([magnitudes, -magnitudes])


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> float32 [..., 2n], low nibble first."""
    table = e2m1_table(packed.device)
    low = table[(packed & 0x0F).long()]
    high = table[(packed >> 4).long()]
    return torch.stack([low, high], dim=-1).flatten(-2)


def dequantize_nvfp4(
    packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor | float
) -> torch.Tensor:
    """uint8 [out, in/2], fp8 [out, in/16], scalar -> float32 [out, in]."""
    values = unpack_e2m1(packed)
    scales = block_scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1)
    return values * scales * torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device)


def dequantize_fp8_rows(values: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [rows, cols], float32 [rows] -> float32 [rows, cols]."""
    return values.float() * row_scale.float().unsqueeze(-1)
