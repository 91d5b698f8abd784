"""Row-scaled FP8 linear layers (--dense-fp8): y = x @ (values * row_scale[:, None])^T.

values float8_e4m3fn [R, C], row_scale float32 [R], x [T, C] -> y [T, R]. Two kernels:

  - matvec.py's matrix-vector kernel (the one BF16 decode projections use), float32 FMA: for
    decode (T small), where the matrix is read once per token and bandwidth is everything;
  - tile_linear.py's tile kernel on tensor cores: e4m3 -> bf16 is exact, so only x is rounded (to
    bf16); the row scale multiplies the float32 accumulator. Its tiles follow the token count: a
    checked step's few rows get 16-token tiles, a prompt's 128.

`fp8_linear_triton` picks the matvec up to `matvec_max_tokens` tokens. precision="fp32" runs the tile
kernel with float32 operands and IEEE dots (the only mode the triton 3.6 interpreter gets right).
"""

from __future__ import annotations

import torch

from flashpack.runtime.kernels.matvec import ROWS_AT_ONCE, matvec
from flashpack.runtime.kernels.tile_linear import tile_linear


def fp8_linear_triton(
    x: torch.Tensor, values: torch.Tensor, row_scale: torch.Tensor, out: torch.Tensor | None = None,
    precision: str = "bf16", matvec_max_tokens: int = ROWS_AT_ONCE,
    block_r: int | None = None, block_c: int | None = None, num_warps: int | None = None, **tiles: int,
) -> torch.Tensor:
    """x [..., C] -> [..., R] (dtype of `out` if given, else x.dtype); values float8_e4m3fn [R, C]
    contiguous, row_scale float32 [R]. Up to `matvec_max_tokens` rows of x use the float32 matvec
    (precision does not apply; block_r and block_c default to matvec.matvec_blocks, num_warps to 4);
    more use the tile kernel in `precision` ("bf16" CUDA only, or "fp32"), `tiles` (its blocks, launch
    and column splits) defaulting to tile_linear's choice."""
    rows, cols = values.shape
    if values.dtype != torch.float8_e4m3fn or x.shape[-1] != cols or row_scale.shape != (rows,):
        raise ValueError(f"x {tuple(x.shape)}, values {values.dtype} {tuple(values.shape)}, "
                         f"row_scale {tuple(row_scale.shape)} do not fit")
    tokens = x.numel() // cols
    if 0 < tokens <= matvec_max_tokens:
        if out is not None and (tuple(out.shape) != (*x.shape[:-1], rows) or not out.is_contiguous()):
            raise ValueError(f"out must be contiguous {(*x.shape[:-1], rows)}")
        return matvec(x, values.contiguous(), row_scale, out=out, block_r=block_r, block_c=block_c,
                      num_warps=num_warps or 4)
    if num_warps is not None:
        tiles["num_warps"] = num_warps
    return tile_linear(x, values, row_scale, out=out, precision=precision, **tiles)
