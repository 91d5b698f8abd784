"""safetensors dtype names (the pack's `dtype` fields) and their torch dtypes: one table for all."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
}
SAFETENSORS_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def dtype_bytes(name: str) -> int:
    return TORCH_DTYPES[name].itemsize
