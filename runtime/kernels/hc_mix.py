"""A hyper-connection mix (runtime/model/hyper_connection.py, `GatedResidual.mix`) in two kernels.

The module's mix is seven kernels in a compiled decode step: the streams' RMS norm (a reduction and
a scale), the stacked low-rank and injection projection (a cuBLAS matrix-vector product and its
split-K reduction), the SiLU gate, the up projection (another product) and the gated mean over
the streams. At one token each is short and mostly launch and drain, twice a layer. Here:

    kernel 1, grid (row blocks, stream, token): for stream k, the partial product of the stacked
        projection W[:, k*H:(k+1)*H] with x_k * (1 + w_k), times x_k's RMS scale s_k (a scalar of
        the stream, so it factors out of the sum and the norm needs no pass of its own)
    kernel 2, grid (blocks of j, token): the projection's sum over streams, its SiLU gate (and the
        injection weights 2 * sigmoid(. / hc)), then for each stream sigmoid(mix_up[k*H + j] . gate)
        times the normalised x_k[j], averaged over the streams

Everything is computed in float32 and rounded once, where the outputs are stored; the module rounds
to the engine dtype after each step, so in bfloat16 the two agree to a few bfloat16 roundings.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix_down_kernel(
    streams_ptr, norm_ptr, weight_ptr, partial_ptr, scale_ptr, eps,
    H: tl.constexpr, HC: tl.constexpr, ROWS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    stream = tl.program_id(1)
    token = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = rows < ROWS
    x_ptr = streams_ptr + token * (HC * H) + stream * H
    acc = tl.zeros([BLOCK_ROWS, BLOCK_H], dtype=tl.float32)
    squares = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in tl.static_range(0, H, BLOCK_H):  # unrolled: every chunk's loads in flight at once
        cols = start + tl.arange(0, BLOCK_H)
        col_mask = cols < H
        x = tl.load(x_ptr + cols, mask=col_mask, other=0).to(tl.float32)
        w = tl.load(norm_ptr + stream * H + cols, mask=col_mask, other=0).to(tl.float32)
        weight = tl.load(weight_ptr + rows[:, None] * (HC * H) + stream * H + cols[None, :],
                         mask=row_mask[:, None] & col_mask[None, :], other=0).to(tl.float32)
        squares += x * x
        acc += weight * (x * (1.0 + w))[None, :]
    scale = tl.rsqrt(tl.sum(squares, axis=0) / H + eps)
    tl.store(partial_ptr + (token * HC + stream) * ROWS + rows, tl.sum(acc, axis=1) * scale, mask=row_mask)
    if tl.program_id(0) == 0:
        tl.store(scale_ptr + token * HC + stream, scale)


@triton.jit
def _mix_up_kernel(
    streams_ptr, norm_ptr, partial_ptr, scale_ptr, up_ptr, out_ptr, inject_ptr,
    H: tl.constexpr, HC: tl.constexpr, R: tl.constexpr, ROWS: tl.constexpr, INJECT: tl.constexpr,
    BLOCK_J: tl.constexpr, R_POW2: tl.constexpr, HC_POW2: tl.constexpr,
):
    token = tl.program_id(1).to(tl.int64)
    partial_row = partial_ptr + token * HC * ROWS
    r = tl.arange(0, R_POW2)
    r_mask = r < R
    down = tl.zeros([R_POW2], dtype=tl.float32)
    for k in tl.static_range(HC):
        down += tl.load(partial_row + k * ROWS + r, mask=r_mask, other=0)
    gate = down / HC
    gate = gate * tl.sigmoid(gate)  # SiLU; masked lanes are 0
    if INJECT:
        if tl.program_id(0) == 0:
            i = tl.arange(0, HC_POW2)
            inject = tl.zeros([HC_POW2], dtype=tl.float32)
            for k in tl.static_range(HC):
                inject += tl.load(partial_row + k * ROWS + R + i, mask=i < HC, other=0)
            tl.store(inject_ptr + token * HC + i, 2.0 * tl.sigmoid(inject / HC), mask=i < HC)
    j = tl.program_id(0) * BLOCK_J + tl.arange(0, BLOCK_J)
    j_mask = j < H
    acc = tl.zeros([BLOCK_J], dtype=tl.float32)
    for k in tl.static_range(HC):
        up = tl.load(up_ptr + (k * H + j)[:, None] * R + r[None, :], mask=j_mask[:, None] & r_mask[None, :],
                     other=0).to(tl.float32)
        mixed = tl.sigmoid(tl.sum(up * gate[None, :], axis=1))
        x = tl.load(streams_ptr + token * (HC * H) + k * H + j, mask=j_mask, other=0).to(tl.float32)
        w = tl.load(norm_ptr + k * H + j, mask=j_mask, other=0).to(tl.float32)
        acc += mixed * (x * tl.load(scale_ptr + token * HC + k) * (1.0 + w))
    tl.store(out_ptr + token * H + j, (acc / HC).to(out_ptr.dtype.element_ty), mask=j_mask)


def hc_mix_triton(
    streams: torch.Tensor, norm_weight: torch.Tensor, eps: float, in_weight: torch.Tensor, mix_up: torch.Tensor,
    hc: int, inject: bool, block_rows: int = 4, block_h: int = 1024, block_j: int = 4, num_warps: int = 8,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """streams [T, hc*H]; norm_weight [hc*H] (applied as 1 + w); in_weight [R (+ hc), hc*H], the
    low-rank down projection's rows, then with `inject` the injection weights' hc rows; mix_up
    [hc*H, R]. Returns (block input [T, H] in streams' dtype, injection weights float32 [T, hc] or
    None). Block sizes must be powers of two. Defaults: the best of a sweep on an H200 at hc=4,
    H=2560, R=320: 9.9 us a mix, where 16 columns a program (4 warps) took 19.5 and the
    module's code, compiled with its projections on matvec.py's kernel, 17.7."""
    tokens, width = streams.shape
    hidden, rank = width // hc, mix_up.shape[1]
    rows = in_weight.shape[0]
    if width != hc * hidden or rows != rank + (hc if inject else 0) or in_weight.shape[1] != width \
            or mix_up.shape[0] != width or norm_weight.numel() != width:
        raise ValueError(f"streams {tuple(streams.shape)}, in_weight {tuple(in_weight.shape)}, mix_up "
                         f"{tuple(mix_up.shape)} and norm {tuple(norm_weight.shape)} do not fit hc={hc}")
    streams, norm_weight, in_weight, mix_up = (t.contiguous() for t in (streams, norm_weight, in_weight, mix_up))
    partial = torch.empty(tokens, hc, rows, dtype=torch.float32, device=streams.device)
    scales = torch.empty(tokens, hc, dtype=torch.float32, device=streams.device)
    out = torch.empty(tokens, hidden, dtype=streams.dtype, device=streams.device)
    # without injection rows kernel 2 writes no injection weights: any pointer serves
    injected = torch.empty(tokens, hc, dtype=torch.float32, device=streams.device) if inject else scales
    if tokens:
        _mix_down_kernel[(triton.cdiv(rows, block_rows), hc, tokens)](
            streams, norm_weight, in_weight, partial, scales, eps,
            hidden, hc, rows, BLOCK_ROWS=block_rows, BLOCK_H=block_h, num_warps=num_warps)
        _mix_up_kernel[(triton.cdiv(hidden, block_j), tokens)](
            streams, norm_weight, partial, scales, mix_up, out, injected,
            hidden, hc, rank, rows, inject, BLOCK_J=block_j,
            R_POW2=triton.next_power_of_2(rank), HC_POW2=triton.next_power_of_2(hc), num_warps=num_warps)
    return out, injected if inject else None
