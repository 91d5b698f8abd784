"""`DenseLinear`: one dense projection, kept on the device the way the pack stores it.

A BF16-stored weight (cast to the engine dtype) runs `F.linear`. A weight stored as FP8 rows with a
float32 scale per row (`flashpack convert --dense-fp8`) stays FP8 in memory, half the bytes every
decode step reads and half the VRAM the dense part takes, and runs `fp8_linear` (the Triton kernels
on CUDA, the plain reference elsewhere): x @ (values * row_scale)^T accumulated in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashpack.runtime.kernels import fp8_linear
from flashpack.runtime.weights import WeightSource, load_dense


class DenseLinear(nn.Module):
    def __init__(self, source: WeightSource, name: str, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        stored = source.dense_fp8(name) if hasattr(source, "dense_fp8") else None
        if stored is None:
            self.register_buffer("weight", load_dense(source, name, dtype, device), persistent=False)
            self.register_buffer("values", None)
            self.register_buffer("row_scale", None)
        else:
            values, row_scale = stored
            self.register_buffer("weight", None)
            self.register_buffer("values", values.to(device).contiguous(), persistent=False)  # fp8 [out, in]
            self.register_buffer("row_scale", row_scale.to(device, torch.float32).contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight)
        return fp8_linear(x, self.values, self.row_scale)
