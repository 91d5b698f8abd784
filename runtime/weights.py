"""Where the engine's dense weights and PLE rows come from.

The engine never opens a file itself: every module takes its tensors from a `WeightSource` at
construction. The pack-backed source (memory-mapped dense safetensors, PLE row file) and the
in-memory source the tests build from a transformers state_dict both satisfy this protocol.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from flashpack.layout.model_config import TextConfig


@runtime_checkable
class WeightSource(Protocol):
    config: TextConfig

    def dense(self, name: str) -> torch.Tensor:
        """Canonical name (e.g. "layers.3.linear_attn.in_proj_qkv.weight") -> tensor, any float dtype."""
        ...

    def ple_rows(self, ple_index: int, rows: torch.Tensor) -> torch.Tensor:
        """Rows of PLE table `ple_index`: int64 [N] global row ids -> float [N, ple_head_dim]."""
        ...

    # Optional: a source that can hand out FP8-stored projections as stored defines
    #   dense_fp8(name) -> (float8_e4m3fn values [R, C], float32 row scales [R]) or None
    # and the engine keeps them FP8 on the device (runtime/model/linear.py).


def load_dense(source: WeightSource, name: str, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """One dense tensor, cast to the engine dtype and moved to `device` (a fresh, contiguous copy)."""
    tensor = source.dense(name)
    if not torch.is_floating_point(tensor):
        raise TypeError(f"dense weight {name} has non-float dtype {tensor.dtype}")
    return tensor.to(device=device, dtype=dtype, copy=True).contiguous()
