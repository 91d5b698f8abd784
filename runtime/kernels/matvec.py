"""Dense matrix-vector products for decode: y [T, R] = x [T, C] @ W [R, C]^T for one or a few tokens.

W is BF16/FP16, or FP8 (e4m3) rows with a float32 scale per row (`--dense-fp8`). At one token a
decode step is a chain of such products over 2-60 MB matrices, each read once; cuBLAS's kernels for
them reached 1.3-3.3 TB/s of the H200's ~4.2 (in a profiled decode step: a 9 MB stack 7 us, a 21 MB one
9 us with its split-K reduction), and the FP8 kernel that summed across threads every chunk no faster
than BF16 at half the bytes. Against cuBLAS at one token on an H200 (bench/kernels.py, us): DeltaNet's stacked
input projection (12352 x 2560) 17.0 against 19.3, its output projection (2560 x 4096) 7.0 against
10.4, the router and shared expert's stack (1793 x 2560) 4.6 against 6.8, a hyper-connection's
stacked down projection (324 x 10240) 4.5 against 8.2 (the sweep's rows at the block sizes now the
default). Here each program owns BLOCK_R rows; its loop over the input is unrolled, so every load of
its rows is in flight at once, and multiply-adds into a float32 [BLOCK_R, BLOCK_C] tile that is
summed across threads once, at the end. Blocks are sized so each thread holds at most
ELEMENTS_PER_THREAD weights in flight. Accumulation is float32 in a fixed order: deterministic.

Several tokens (a speculative step's checked rows) take `_matvec_rows_kernel`: each program reads
its rows of W once for up to ROWS_AT_ONCE tokens, a float32 tile a token, so a step of a few tokens
reads each matrix once, not once a token; its row blocks shrink by the tokens a program holds,
keeping a thread's accumulators to what one token's were.

The reference is `F.linear` (float32 products of the same values; fp8_linear_reference for FP8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Weights a thread has in flight: block-size sweeps on an H200 (bench/kernels.py --only dense
# --sweep) favoured ~4096 a program of 4 warps at every decode shape over 4x more (out_proj 2560 x 4096:
# 7.0 against 9.6 us; the hyper-connection up projection 10240 x 320: 3.6 against 5.7)
ELEMENTS_PER_THREAD = 32
MAX_BLOCK_C = 512
ROWS_AT_ONCE = 4  # tokens a program of the several-token kernel multiplies by each tile of W


@triton.jit
def _matvec_kernel(x_ptr, w_ptr, scale_ptr, y_ptr, R, C: tl.constexpr, FP8: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    cols = tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for start in tl.static_range(0, C, BLOCK_C):  # unrolled: all of the rows' loads in flight together
        col_mask = start + cols < C
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * C + (start + cols)[None, :],
                    mask=row_mask[:, None] & col_mask[None, :], other=0)
        if FP8:
            w = w.to(tl.float8e4nv, bitcast=True)
        xv = tl.load(x_ptr + t * C + start + cols, mask=col_mask, other=0).to(tl.float32)
        acc += w.to(tl.float32) * xv[None, :]
    y = tl.sum(acc, axis=1)
    if FP8:
        y = y * tl.load(scale_ptr + rows, mask=row_mask, other=0)
    tl.store(y_ptr + t * R + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)


@triton.jit(do_not_specialize=["T"])  # one build whatever the step's token count
def _matvec_rows_kernel(x_ptr, w_ptr, scale_ptr, y_ptr, T, R, C: tl.constexpr, FP8: tl.constexpr,
                        TOKENS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    token_mask = tokens < T
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    cols = tl.arange(0, BLOCK_C)
    acc = tl.zeros([TOKENS, BLOCK_R, BLOCK_C], dtype=tl.float32)
    for start in tl.static_range(0, C, BLOCK_C):  # unrolled, as in _matvec_kernel
        col_mask = start + cols < C
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * C + (start + cols)[None, :],
                    mask=row_mask[:, None] & col_mask[None, :], other=0)
        if FP8:
            w = w.to(tl.float8e4nv, bitcast=True)
        xv = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * C + (start + cols)[None, :],
                     mask=token_mask[:, None] & col_mask[None, :], other=0).to(tl.float32)
        acc += w.to(tl.float32)[None, :, :] * xv[:, None, :]  # each weight read once for all TOKENS
    y = tl.sum(acc, axis=2)  # [TOKENS, BLOCK_R]
    if FP8:
        y = y * tl.load(scale_ptr + rows, mask=row_mask, other=0)[None, :]
    tl.store(y_ptr + tokens.to(tl.int64)[:, None] * R + rows[None, :], y.to(y_ptr.dtype.element_ty),
             mask=token_mask[:, None] & row_mask[None, :])


def matvec_blocks(rows: int, cols: int, num_warps: int = 4) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C): BLOCK_C the largest power of two up to MAX_BLOCK_C that divides `cols`
    (no masked lanes), BLOCK_R as many rows as keep ELEMENTS_PER_THREAD weights a thread in flight."""
    block_c = MAX_BLOCK_C
    while block_c > 16 and cols % block_c:
        block_c //= 2
    budget = max(1, ELEMENTS_PER_THREAD * 32 * num_warps // cols)
    block_r = 1 << (budget.bit_length() - 1)
    return min(block_r, triton.next_power_of_2(rows)), block_c


def matvec(
    x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
    block_r: int | None = None, block_c: int | None = None, num_warps: int = 4,
) -> torch.Tensor:
    """x [..., C] -> [..., R] (dtype of `out` if given, else x.dtype) for W `weight` [R, C] with
    contiguous rows: BF16/FP16, or float8_e4m3fn with `row_scale` float32 [R]. Meant for a few
    tokens (W is read once for every ROWS_AT_ONCE of them); block sizes default to `matvec_blocks`
    (`block_r` for one token: several share it)."""
    rows, cols = weight.shape
    fp8 = weight.dtype == torch.float8_e4m3fn
    if x.shape[-1] != cols or fp8 != (row_scale is not None) or weight.stride() != (cols, 1):
        raise ValueError(f"x {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)} stride {weight.stride()}, "
                         f"row_scale {None if row_scale is None else tuple(row_scale.shape)} do not fit")
    x2 = x.reshape(-1, cols).contiguous()
    if out is None:
        out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (*x.shape[:-1], rows) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {(*x.shape[:-1], rows)}")
    if x2.shape[0] == 0:
        return out
    default_r, default_c = matvec_blocks(rows, cols, num_warps)
    block_r, block_c = block_r or default_r, block_c or default_c
    w = weight.view(torch.uint8) if fp8 else weight
    scale = row_scale.float().contiguous() if fp8 else w  # unused unless FP8
    tokens = x2.shape[0]
    if tokens == 1:
        _matvec_kernel[(1, triton.cdiv(rows, block_r))](
            x2, w, scale, out, rows, cols, FP8=fp8, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=num_warps)
        return out
    at_once = min(ROWS_AT_ONCE, triton.next_power_of_2(tokens))
    block_r = max(1, block_r // at_once)
    _matvec_rows_kernel[(triton.cdiv(tokens, at_once), triton.cdiv(rows, block_r))](
        x2, w, scale, out, tokens, rows, cols, FP8=fp8, TOKENS=at_once, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=num_warps)
    return out
