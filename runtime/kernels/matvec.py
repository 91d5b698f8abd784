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

Several tokens (a speculative step's checked rows): each program reads its rows of W once for up
to ROWS_AT_ONCE tokens, multiplying each tile into one float32 accumulator a token, so a step of a
few tokens reads each matrix once, not once a token. Its time still grows with the tokens (on an
H200 DeltaNet's input projection takes 16.5 us at one token, 20.8 at two, 29.9 at four, 53.7 at
eight): against cuBLAS, which reads a BF16 matrix in about the same time for 1 to 5 tokens, it wins
at several tokens only on some shapes (dispatch.py's DENSE_MATVEC_MAX_TOKENS), and for FP8 rows it
beats the tile kernel up to ROWS_AT_ONCE tokens.

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
ROWS_AT_ONCE = 8  # tokens a program multiplies by each tile of W it reads (1, 2, 4 or 8)


@triton.jit
def _token_chunk(x_ptr, token, T, C: tl.constexpr, columns, col_mask):
    """Token `token`'s inputs at `columns` in float32 (zeros past the step's T tokens)."""
    return tl.load(x_ptr + token.to(tl.int64) * C + columns, mask=col_mask & (token < T), other=0).to(tl.float32)


@triton.jit
def _store_token(y_ptr, token, T, R, rows, row_mask, acc, scale):
    """One token's accumulator [BLOCK_R, BLOCK_C] summed across threads into y[token, rows]."""
    y = tl.sum(acc, axis=1) * scale
    tl.store(y_ptr + token.to(tl.int64) * R + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask & (token < T))


@triton.jit(do_not_specialize=["T"])  # one build whatever the step's token count
def _matvec_kernel(x_ptr, w_ptr, scale_ptr, y_ptr, T, R, C: tl.constexpr, FP8: tl.constexpr,
                   TOKENS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # One float32 accumulator a token, each in a one-token program's layout: a single [TOKENS, BLOCK_R,
    # BLOCK_C] tile ran DeltaNet's input projection at two tokens in 34.7 us on an H200, these in 20.6.
    # The ones past TOKENS are never used, and compiled away.
    first = tl.program_id(0) * TOKENS
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < R
    cols = tl.arange(0, BLOCK_C)
    acc0 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc4 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc5 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc6 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc7 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for start in tl.static_range(0, C, BLOCK_C):  # unrolled: all of the rows' loads in flight together
        columns = start + cols
        col_mask = columns < C
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * C + columns[None, :],
                    mask=row_mask[:, None] & col_mask[None, :], other=0)
        if FP8:
            w = w.to(tl.float8e4nv, bitcast=True)
        w = w.to(tl.float32)  # read once, multiplied by each of the program's tokens
        acc0 += w * _token_chunk(x_ptr, first, T, C, columns, col_mask)[None, :]
        if TOKENS > 1:
            acc1 += w * _token_chunk(x_ptr, first + 1, T, C, columns, col_mask)[None, :]
        if TOKENS > 2:
            acc2 += w * _token_chunk(x_ptr, first + 2, T, C, columns, col_mask)[None, :]
            acc3 += w * _token_chunk(x_ptr, first + 3, T, C, columns, col_mask)[None, :]
        if TOKENS > 4:
            acc4 += w * _token_chunk(x_ptr, first + 4, T, C, columns, col_mask)[None, :]
            acc5 += w * _token_chunk(x_ptr, first + 5, T, C, columns, col_mask)[None, :]
            acc6 += w * _token_chunk(x_ptr, first + 6, T, C, columns, col_mask)[None, :]
            acc7 += w * _token_chunk(x_ptr, first + 7, T, C, columns, col_mask)[None, :]
    if FP8:
        scale = tl.load(scale_ptr + rows, mask=row_mask, other=0)
    else:
        scale = 1.0
    _store_token(y_ptr, first, T, R, rows, row_mask, acc0, scale)
    if TOKENS > 1:
        _store_token(y_ptr, first + 1, T, R, rows, row_mask, acc1, scale)
    if TOKENS > 2:
        _store_token(y_ptr, first + 2, T, R, rows, row_mask, acc2, scale)
        _store_token(y_ptr, first + 3, T, R, rows, row_mask, acc3, scale)
    if TOKENS > 4:
        _store_token(y_ptr, first + 4, T, R, rows, row_mask, acc4, scale)
        _store_token(y_ptr, first + 5, T, R, rows, row_mask, acc5, scale)
        _store_token(y_ptr, first + 6, T, R, rows, row_mask, acc6, scale)
        _store_token(y_ptr, first + 7, T, R, rows, row_mask, acc7, scale)


def matvec_blocks(rows: int, cols: int, tokens: int = 1, num_warps: int = 4) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) for a product of `tokens` rows of x: BLOCK_C the largest power of two up to
    MAX_BLOCK_C that divides `cols` (no masked lanes), BLOCK_R as many rows as keep ELEMENTS_PER_THREAD
    weights a thread in flight, divided by the tokens a program takes (its accumulators stay what one
    token's are). Taller, narrower blocks for several tokens (fewer programs, each reading all of its
    tokens' x) measured slower at every shape swept on an H200 (bench/kernels.py --only dense --sweep)."""
    block_c = MAX_BLOCK_C
    while block_c > 16 and cols % block_c:
        block_c //= 2
    budget = max(1, ELEMENTS_PER_THREAD * 32 * num_warps // cols // tokens_at_once(tokens))
    block_r = 1 << (budget.bit_length() - 1)
    return min(block_r, triton.next_power_of_2(rows)), block_c


def tokens_at_once(tokens: int) -> int:
    """The tokens a program of the kernel takes: TOKENS, a power of two up to ROWS_AT_ONCE."""
    return min(ROWS_AT_ONCE, triton.next_power_of_2(tokens))


def matvec(
    x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
    block_r: int | None = None, block_c: int | None = None, num_warps: int = 4,
) -> torch.Tensor:
    """x [..., C] -> [..., R] (dtype of `out` if given, else x.dtype) for W `weight` [R, C] with
    contiguous rows: BF16/FP16, or float8_e4m3fn with `row_scale` float32 [R]. Meant for a few
    tokens (W is read once for every ROWS_AT_ONCE of them); block sizes default to `matvec_blocks`
    for the call's token count."""
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
    tokens = x2.shape[0]
    default_r, default_c = matvec_blocks(rows, cols, tokens, num_warps)
    block_r, block_c = block_r or default_r, block_c or default_c
    w = weight.view(torch.uint8) if fp8 else weight
    scale = row_scale.float().contiguous() if fp8 else w  # unused unless FP8
    at_once = tokens_at_once(tokens)
    _matvec_kernel[(triton.cdiv(tokens, at_once), triton.cdiv(rows, block_r))](
        x2, w, scale, out, tokens, rows, cols, FP8=fp8, TOKENS=at_once, BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=num_warps)
    return out
