"""Row-scaled FP8 linear layers (--dense-fp8): y = x @ (values * row_scale[:, None])^T.

values float8_e4m3fn [R, C], row_scale float32 [R], x [T, C] -> y [T, R]. Two kernels:

  - matvec.py's matrix-vector kernel (the one BF16 decode projections use), float32 FMA: for
    decode (T small), where the matrix is read once per token and bandwidth is everything;
  - `_fp8_matmul_kernel`, T/BLOCK_M x R/BLOCK_N tiles on tensor cores: e4m3 -> bf16 is exact, so
    only x is rounded (to bf16); the row scale multiplies the float32 accumulator.

`fp8_linear_triton` picks the matvec up to `matvec_max_tokens` tokens. The tile kernel's tiles follow
the token count (`tile_blocks`): a prompt's are 128 tokens by 128 rows; up to FEW_TOKENS (a checked
step's few rows) they are 16 tokens, the least a tensor-core dot takes, by few rows, so that the matrix
is spread over many programs, each reading its rows once while their x tile is reused from shared
memory. precision="fp32" runs the tile kernel with float32 operands and IEEE dots (the only mode the
triton 3.6 interpreter gets right).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpack.runtime.kernels.matvec import ROWS_AT_ONCE, matvec


@triton.jit(do_not_specialize=["T"])  # one build whatever the token count
def _fp8_matmul_kernel(x_ptr, values_ptr, scale_ptr, y_ptr, T, R, C: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_mask, row_mask = tokens < T, rows < R
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, C, BLOCK_K):
        k_mask = start + ks < C
        xt = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * C + (start + ks)[None, :],
                     mask=token_mask[:, None] & k_mask[None, :], other=0).to(DOT)
        v = tl.load(values_ptr + rows.to(tl.int64)[:, None] * C + (start + ks)[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0)
        w = v.to(tl.float8e4nv, bitcast=True).to(DOT)
        acc = tl.dot(xt, tl.trans(w), acc, input_precision="ieee")
    y = acc * tl.load(scale_ptr + rows, mask=row_mask, other=0)[None, :]
    tl.store(y_ptr + tokens.to(tl.int64)[:, None] * R + rows[None, :], y.to(y_ptr.dtype.element_ty),
             mask=token_mask[:, None] & row_mask[None, :])


FEW_TOKENS = 16  # up to here a step's tokens fit one tile of 16: the few-token tiles


def tile_blocks(tokens: int) -> dict[str, int]:
    """The tile kernel's tiles and launch for `tokens` rows of x. A prompt's: the fastest of a sweep on
    an H200 at 8192 x 2560 (229 us at 2048 tokens). A few tokens': 16 tokens by 32 rows of 256
    columns, so a matrix of thousands of rows runs on hundreds of programs: the fastest of a sweep
    (bench/kernels.py --only fp8-few --sweep) at 3 of 4 shapes, e.g. DeltaNet's stacked input
    projection 12288 x 2560 in 15.3 us at 3, 5 and 8 tokens (the matvec: 30.4 / 52.6 / 53.3; 16 or
    64 rows 24.8 / 18.7 at best)."""
    if tokens <= FEW_TOKENS:
        return dict(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=3)
    return dict(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3)


def fp8_linear_triton(
    x: torch.Tensor, values: torch.Tensor, row_scale: torch.Tensor, out: torch.Tensor | None = None,
    precision: str = "bf16", matvec_max_tokens: int = ROWS_AT_ONCE,
    block_r: int | None = None, block_c: int | None = None, block_m: int | None = None, block_n: int | None = None,
    block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
) -> torch.Tensor:
    """x [..., C] -> [..., R] (dtype of `out` if given, else x.dtype); values float8_e4m3fn [R, C]
    contiguous, row_scale float32 [R]. Up to `matvec_max_tokens` rows of x use the float32 matvec
    (precision does not apply; block_r and block_c default to matvec.matvec_blocks, num_warps to 4);
    more use the tile kernel in `precision` ("bf16" CUDA only, or "fp32"), its tiles and launch
    defaulting to `tile_blocks`."""
    rows, cols = values.shape
    if values.dtype != torch.float8_e4m3fn or x.shape[-1] != cols or row_scale.shape != (rows,):
        raise ValueError(f"x {tuple(x.shape)}, values {values.dtype} {tuple(values.shape)}, "
                         f"row_scale {tuple(row_scale.shape)} do not fit")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be 'bf16' or 'fp32', got {precision!r}")
    x2 = x.reshape(-1, cols).contiguous()
    tokens = x2.shape[0]
    if out is None:
        out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (*x.shape[:-1], rows) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {(*x.shape[:-1], rows)}")
    if tokens == 0:
        return out
    if tokens <= matvec_max_tokens:
        return matvec(x, values.contiguous(), row_scale, out=out, block_r=block_r, block_c=block_c,
                      num_warps=num_warps or 4)
    v_bytes, scale = values.contiguous().view(torch.uint8), row_scale.float().contiguous()
    if precision == "bf16" and x.device.type != "cuda":
        raise ValueError("bf16 tensor-core dots need CUDA (the triton 3.6 interpreter mis-multiplies bf16 "
                         "in tl.dot); use precision='fp32' there")
    dot = tl.bfloat16 if precision == "bf16" else tl.float32
    x_act = x2.to(torch.bfloat16 if precision == "bf16" else torch.float32)
    given = dict(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    tiles = tile_blocks(tokens) | {name: value for name, value in given.items() if value is not None}
    _fp8_matmul_kernel[(triton.cdiv(tokens, tiles["block_m"]), triton.cdiv(rows, tiles["block_n"]))](
        x_act, v_bytes, scale, out, tokens, rows, cols, BLOCK_M=tiles["block_m"], BLOCK_N=tiles["block_n"],
        BLOCK_K=tiles["block_k"], DOT=dot, num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])
    return out
