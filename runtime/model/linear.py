"""Dense projections, kept on the device the way the pack stores them.

A BF16-stored weight (cast to the engine dtype) runs `dense_linear` (F.linear; for a decode token
on CUDA the Triton matvec of runtime/kernels/matvec.py). A weight stored as FP8 rows with a
float32 scale per row (`flashpack convert --dense-fp8`) stays FP8 in memory, half the bytes every
decode step reads and half the VRAM the dense part takes, and runs `fp8_linear` (the Triton kernels
on CUDA, the plain reference elsewhere): x @ (values * row_scale)^T accumulated in float32.

`StackedLinear` runs several projections of the same input as one: their weights are stacked by
rows (one stack per storage form), so a decode step reads them in one matrix-vector product
instead of one small, latency-bound launch each. `DenseLinear` is a stack of one. The model sets
`matvec_max_tokens`, `tile_max_tokens` and `fp8_matvec_max_tokens` on each (Qwen4ExpModel's
`dense_matvec_max_tokens`, `dense_tile_max_tokens` and `fp8_matvec_max_tokens`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from flashpack.runtime.kernels import dense_linear, fp8_linear
from flashpack.runtime.kernels.dispatch import DENSE_MATVEC_MAX_TOKENS, DENSE_TILE_MAX_TOKENS, FP8_MATVEC_MAX_TOKENS
from flashpack.runtime.weights import WeightSource, load_dense


class StackedLinear(nn.Module):
    def __init__(self, source: WeightSource, names: Sequence[str], dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        stored = [source.dense_fp8(name) if hasattr(source, "dense_fp8") else None for name in names]
        plain = [load_dense(source, name, dtype, device) for name, fp8 in zip(names, stored) if fp8 is None]
        fp8 = [fp8 for fp8 in stored if fp8 is not None]
        self.is_fp8 = [fp8 is not None for fp8 in stored]
        self.plain_rows = [w.shape[0] for w in plain]
        self.fp8_rows = [values.shape[0] for values, _ in fp8]
        self.register_buffer("weight", torch.cat(plain) if plain else None, persistent=False)
        values = torch.cat([v for v, _ in fp8]).to(device) if fp8 else None
        scales = torch.cat([s for _, s in fp8]).to(device, torch.float32) if fp8 else None
        self.register_buffer("values", values, persistent=False)  # fp8 [out, in]
        self.register_buffer("row_scale", scales, persistent=False)
        self.matvec_max_tokens = DENSE_MATVEC_MAX_TOKENS  # BF16 rows of up to this many tokens: the matvec kernel
        self.tile_max_tokens = DENSE_TILE_MAX_TOKENS  # then, on small matrices, the few-token tiles
        self.fp8_matvec_max_tokens = FP8_MATVEC_MAX_TOKENS  # FP8 rows: the matvec kernel, more the tile kernel

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Projection `index` of `names` alone (its rows of the stack)."""
        is_fp8 = self.is_fp8[index]
        rows = self.fp8_rows if is_fp8 else self.plain_rows
        position = sum(1 for earlier in self.is_fp8[:index] if earlier == is_fp8)
        start, count = sum(rows[:position]), rows[position]
        if is_fp8:
            return fp8_linear(x, self.values[start:start + count], self.row_scale[start:start + count],
                              matvec_max_tokens=self.fp8_matvec_max_tokens)
        return dense_linear(x, self.weight[start:start + count], matvec_max_tokens=self.matvec_max_tokens,
                            tile_max_tokens=self.tile_max_tokens)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [..., in] -> each projection's output, in the order of `names`."""
        plain = iter(dense_linear(x, self.weight, matvec_max_tokens=self.matvec_max_tokens,
                                  tile_max_tokens=self.tile_max_tokens).split(self.plain_rows, -1)
                     if self.weight is not None else ())
        fp8 = iter(fp8_linear(x, self.values, self.row_scale, matvec_max_tokens=self.fp8_matvec_max_tokens)
                   .split(self.fp8_rows, -1) if self.values is not None else ())
        return [next(fp8) if is_fp8 else next(plain) for is_fp8 in self.is_fp8]


class DenseLinear(StackedLinear):
    def __init__(self, source: WeightSource, name: str, dtype: torch.dtype, device: torch.device | str):
        super().__init__(source, [name], dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return dense_linear(x, self.weight, matvec_max_tokens=self.matvec_max_tokens,
                                tile_max_tokens=self.tile_max_tokens)
        return fp8_linear(x, self.values, self.row_scale, matvec_max_tokens=self.fp8_matvec_max_tokens)
