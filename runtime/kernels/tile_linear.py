"""Linear layers on tensor cores, in tiles: y [T, R] = x [T, C] @ W [R, C]^T (times a row scale).

W is BF16/FP16/FP32, or FP8 (e4m3) rows with a float32 scale per row (`--dense-fp8`). Each program
multiplies BLOCK_M tokens by BLOCK_N rows of W over its share of the columns; e4m3 -> bf16 is exact,
so with bf16 dots only x is rounded (to bf16), and the accumulator is float32. The row scale
multiplies the accumulator.

The tiles follow the token count (`tile_blocks`): a prompt's are 128 tokens by 128 rows; up to
FEW_TOKENS (a checked step's few rows) they are 16 tokens, the least a tensor-core dot takes, by 32
rows, so that a matrix is spread over many programs, each reading its rows once while their x tile is
reused from shared memory. A short, wide matrix (a hyper-connection's 324 x 10240 down projection,
the router's 513 x 2560) has too few row tiles to keep the GPU's memory busy: there the columns are
split too (`column_splits`), each split's float32 partial products land in a scratch [T, splits, R],
and the last of a tile's splits to finish (a counter a tile, taken atomically) sums them in split
order and writes y: deterministic, and no second launch (a checked step has about a hundred such
products, each of whose separate sums cost ~1.7 us of launch and drain on an H200). The last one
sets its counter back to zero, so the counters are ready for the next launch, a graph's replay
included; launches on one stream run one after another, so they never share a counter at once.
precision="fp32" runs the dots with float32 operands in IEEE arithmetic (an FP32 engine; the only
mode the triton 3.6 interpreter gets right).

The reference is `F.linear` (float32 products of the same values; fp8_linear_reference for FP8 rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


FEW_TOKENS = 16  # up to here a step's tokens fit one tile of 16: the few-token tiles
# Programs a few-token launch aims at before splitting columns: twice the H200's 132 SMs, so each SM
# has a second program's loads in flight while the first's finish.
TARGET_PROGRAMS = 264


@triton.jit(do_not_specialize=["T"])  # one build whatever the token count
def _tile_kernel(x_ptr, w_ptr, scale_ptr, y_ptr, partial_ptr, counter_ptr, T, R, C: tl.constexpr,
                 SPLIT_C: tl.constexpr, SPLITS: tl.constexpr, FP8: tl.constexpr, SCALED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """Program (m, n, s): tokens m, rows n, columns s * SPLIT_C up to the next split, into y [T, R].
    With SPLITS > 1 each program leaves its partial products in partial (float32 [T, SPLITS, R]) and
    the tile's last program sums them (counter_ptr: int32, one a (m, n) tile, zero between launches)."""
    tokens = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    token_mask, row_mask = tokens < T, rows < R
    mask = token_mask[:, None] & row_mask[None, :]
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for offset in range(0, SPLIT_C, BLOCK_K):  # constant bounds: plain ints under the interpreter (triton#9171)
        start = split * SPLIT_C + offset
        k_mask = start + ks < C  # the last split's chunks past C load nothing
        xt = tl.load(x_ptr + tokens.to(tl.int64)[:, None] * C + (start + ks)[None, :],
                     mask=token_mask[:, None] & k_mask[None, :], other=0).to(DOT)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * C + (start + ks)[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0)
        if FP8:
            w = w.to(tl.float8e4nv, bitcast=True)
        acc = tl.dot(xt, tl.trans(w.to(DOT)), acc, input_precision="ieee")
    if SCALED:
        acc = acc * tl.load(scale_ptr + rows, mask=row_mask, other=0)[None, :]
    target = y_ptr + tokens.to(tl.int64)[:, None] * R + rows[None, :]
    if SPLITS == 1:
        tl.store(target, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        partials = partial_ptr + tokens.to(tl.int64)[:, None] * (SPLITS * R) + rows[None, :]
        tl.store(partials + split * R, acc, mask=mask)
        tl.debug_barrier()  # every thread's partials stored before the counter says so
        counter = counter_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:  # the tile's last split
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLITS):  # in split order, whichever finished last
                total += tl.load(partials + s * R, mask=mask, other=0, cache_modifier=".cg")  # past L1: others' stores
            tl.store(target, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def tile_blocks(tokens: int) -> dict[str, int]:
    """The tiles and launch for `tokens` rows of x. A prompt's: the fastest of a sweep on an H200 at
    8192 x 2560 FP8 (229 us at 2048 tokens). A few tokens': 16 tokens by 32 rows of 256 columns, so
    a matrix of thousands of rows runs on hundreds of programs: the fastest of a sweep (bench/kernels.py
    --only fp8-few --sweep) at 3 of 4 FP8 shapes, e.g. DeltaNet's stacked input projection 12288 x 2560
    in 15.3 us at 3, 5 and 8 tokens (the matvec: 30.4 / 52.6 / 53.3; 16 or 64 rows 24.8 / 18.7 at best)."""
    if tokens <= FEW_TOKENS:
        return dict(block_m=16, block_n=32, block_k=256, num_warps=4, num_stages=3)
    return dict(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3)


def column_splits(tokens: int, rows: int, cols: int, tiles: dict[str, int]) -> int:
    """How many ways to split the columns: one for a prompt, and for a few tokens as many as bring the
    launch to about TARGET_PROGRAMS programs, each split at least one BLOCK_K chunk."""
    if tokens > FEW_TOKENS:
        return 1
    programs = triton.cdiv(tokens, tiles["block_m"]) * triton.cdiv(rows, tiles["block_n"])
    return max(1, min(TARGET_PROGRAMS // programs, triton.cdiv(cols, tiles["block_k"])))


def tile_linear(
    x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
    precision: str = "bf16", splits: int | None = None, **blocks: int,
) -> torch.Tensor:
    """x [..., C] -> [..., R] (dtype of `out` if given, else x.dtype) on the tile kernel. weight [R, C]
    contiguous: bf16/fp16/fp32, or float8_e4m3fn with row_scale float32 [R]. precision "bf16" (CUDA
    only) or "fp32". `splits` (column splits) defaults to `column_splits`, the tiles and launch
    (block_m, block_n, block_k, num_warps, num_stages) to `tile_blocks`."""
    rows, cols = weight.shape
    fp8 = weight.dtype == torch.float8_e4m3fn
    if x.shape[-1] != cols or fp8 != (row_scale is not None) or (fp8 and row_scale.shape != (rows,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}, row_scale "
                         f"{None if row_scale is None else tuple(row_scale.shape)} do not fit")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be 'bf16' or 'fp32', got {precision!r}")
    if precision == "bf16" and x.device.type != "cuda":
        raise ValueError("bf16 tensor-core dots need CUDA (the triton 3.6 interpreter mis-multiplies bf16 "
                         "in tl.dot); use precision='fp32' there")
    x2 = x.reshape(-1, cols)
    tokens = x2.shape[0]
    if out is None:
        out = torch.empty(*x.shape[:-1], rows, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (*x.shape[:-1], rows) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {(*x.shape[:-1], rows)}")
    if tokens == 0:
        return out
    tiles = tile_blocks(tokens) | blocks
    splits = splits or column_splits(tokens, rows, cols, tiles)
    split_cols = triton.cdiv(triton.cdiv(cols, splits), tiles["block_k"]) * tiles["block_k"]
    splits = triton.cdiv(cols, split_cols)
    dot = tl.bfloat16 if precision == "bf16" else tl.float32
    x_act = x2.to(torch.bfloat16 if precision == "bf16" else torch.float32).contiguous()
    w = weight.contiguous().view(torch.uint8) if fp8 else weight.contiguous()
    scale = row_scale.float().contiguous() if fp8 else w  # not read without a scale
    grid = (triton.cdiv(tokens, tiles["block_m"]), triton.cdiv(rows, tiles["block_n"]), splits)
    partial = counters = out  # not read with one split
    if splits > 1:
        partial = torch.empty(tokens, splits, rows, dtype=torch.float32, device=x.device)
        counters = tile_counters(grid[0] * grid[1], x.device)
    _tile_kernel[grid](
        x_act, w, scale, out, partial, counters, tokens, rows, cols, SPLIT_C=split_cols, SPLITS=splits, FP8=fp8,
        SCALED=fp8, BLOCK_M=tiles["block_m"], BLOCK_N=tiles["block_n"], BLOCK_K=tiles["block_k"], DOT=dot,
        num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])
    return out


_counters: dict[torch.device, torch.Tensor] = {}


def tile_counters(tiles: int, device: torch.device) -> torch.Tensor:
    """int32 [>= tiles] zeros on `device`, one a tile of a split launch, shared by every launch there
    (each leaves them zero). Made or grown outside a CUDA graph's capture: a split launch runs eagerly
    before it is captured (CapturedCall), with the shapes the capture meets."""
    counters = _counters.get(device)
    if counters is None or counters.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("tile_linear's split counters must grow outside a CUDA graph capture: run the "
                               "launch once eagerly first")
        counters = _counters[device] = torch.zeros(max(tiles, 2 * TARGET_PROGRAMS), dtype=torch.int32, device=device)
    return counters
