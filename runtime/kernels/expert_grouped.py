"""Grouped NVFP4 SwiGLU experts for many tokens (prefill, batched decode): W4A16 tile GEMMs.

The T * K (token, expert) pairs are sorted by bank row, and each expert's run of pairs is cut into
tiles of BLOCK_M rows (tile_plan.py: on the device, no host sync, graph-capturable). Then

    h[r]   = silu(x[tok(r)] @ gate_e^T) * (x[tok(r)] @ up_e^T)      kernel 1: tiles x I/BLOCK_N
    y[p]   = weights[p] * (h[r] @ down_e^T)                         kernel 2: tiles x H/BLOCK_N
    out[t] = sum_k y[t * K + k]                                     torch, in k order

r indexes sorted pairs, p = t * K + k the original ones. Weight tiles are decoded in registers
(nvfp4_dequant) to bf16 tensor-core operands, exact, and the float32 global scale is applied to the
float32 accumulator. With NVFP4's interleaved nibbles a weight tile splits into its even and odd
input columns, so each K step is two dots: x[:, 0::2] @ W_lo^T + x[:, 1::2] @ W_hi^T.

precision="bf16" (the GPU path) feeds x and h to the tensor cores in bfloat16; precision="fp32"
keeps float32 operands with IEEE dots: slow, but equal to the float32 reference up to summation
order. The triton 3.6 interpreter multiplies bf16 bit patterns as integers in tl.dot, so it can
only run fp32. y costs T*K*H*4 bytes of scratch (210 MB for 2048 tokens at the real dims).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpack.runtime.kernels.bank import ExpertBank
from flashpack.runtime.kernels.nvfp4_dequant import block_scale_f32, e2m1_low_high
from flashpack.runtime.kernels.tile_plan import plan_tiles


@triton.jit
def _dequant_tile(nib_ptr, scale_ptr, cols, col_mask, g, g_mask, n_in: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """Rows `cols` of an NVFP4 matrix [*, n_in], 16-element groups `g` -> (even, odd) input columns,
    each [BLOCK_N, BLOCK_K / 2] in DOT. Loads are contiguous [rows, groups, 8 bytes] tiles."""
    mask = col_mask[:, None] & g_mask[None, :]
    byte = g[:, None] * 8 + tl.arange(0, 8)[None, :]
    packed = tl.load(nib_ptr + cols[:, None, None] * (n_in // 2) + byte[None, :, :],
                     mask=mask[:, :, None], other=0)
    scale = block_scale_f32(tl.load(scale_ptr + cols[:, None] * (n_in // 16) + g[None, :], mask=mask, other=0))
    low, high = e2m1_low_high(packed)
    return (tl.reshape(low * scale[:, :, None], (BLOCK_N, BLOCK_K // 2)).to(DOT),
            tl.reshape(high * scale[:, :, None], (BLOCK_N, BLOCK_K // 2)).to(DOT))


@triton.jit
def _even_odd(ptr, row_offsets, row_mask, start, n_in: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """[rows, BLOCK_K] activations from column `start`, loaded contiguously -> (even, odd) columns in DOT."""
    k = start + tl.arange(0, BLOCK_K)
    tile = tl.load(ptr + row_offsets[:, None] + k[None, :], mask=row_mask[:, None] & (k < n_in)[None, :], other=0)
    even, odd = tl.split(tl.reshape(tile, (BLOCK_M, BLOCK_K // 2, 2)))
    return even.to(DOT), odd.to(DOT)


@triton.jit
def _tile(tiles_ptr, max_tiles):
    """(bank row, first sorted row, end sorted row) of this program's tile."""
    tile = tl.program_id(0)
    return (tl.load(tiles_ptr + tile).to(tl.int64), tl.load(tiles_ptr + max_tiles + tile),
            tl.load(tiles_ptr + 2 * max_tiles + tile))


# do_not_specialize: one build whatever a call's tile count. Triton otherwise builds again the first
# time a count is 1 or a multiple of 16, which a prompt streamed in chunks can meet mid-prompt.
@triton.jit(do_not_specialize=["max_tiles"])
def _grouped_gate_up_kernel(
    x_ptr, order_ptr, tiles_ptr, h_ptr, max_tiles,
    gate_nib_ptr, up_nib_ptr, gate_scale_ptr, up_scale_ptr, global_ptr,
    gate_nib_stride, up_nib_stride, gate_scale_stride, up_scale_stride, global_stride,
    H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
):
    e, first, end = _tile(tiles_ptr, max_tiles)
    if first >= end:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    token = (tl.load(order_ptr + rows, mask=row_mask, other=0) // K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < I
    group = tl.arange(0, BLOCK_K // 16)
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, H, BLOCK_K):
        g = start // 16 + group
        g_mask = g < H // 16
        x_even, x_odd = _even_odd(x_ptr, token * H, row_mask, start, H, BLOCK_M, BLOCK_K, DOT)
        g_lo, g_hi = _dequant_tile(gate_nib_ptr + e * gate_nib_stride, gate_scale_ptr + e * gate_scale_stride,
                                   cols, col_mask, g, g_mask, H, BLOCK_N, BLOCK_K, DOT)
        gate = tl.dot(x_even, tl.trans(g_lo), gate, input_precision="ieee")
        gate = tl.dot(x_odd, tl.trans(g_hi), gate, input_precision="ieee")
        u_lo, u_hi = _dequant_tile(up_nib_ptr + e * up_nib_stride, up_scale_ptr + e * up_scale_stride,
                                   cols, col_mask, g, g_mask, H, BLOCK_N, BLOCK_K, DOT)
        up = tl.dot(x_even, tl.trans(u_lo), up, input_precision="ieee")
        up = tl.dot(x_odd, tl.trans(u_hi), up, input_precision="ieee")
    gate = gate * tl.load(global_ptr + e * global_stride)
    up = up * tl.load(global_ptr + e * global_stride + 1)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * I + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["max_tiles"])
def _grouped_down_kernel(
    h_ptr, order_ptr, tiles_ptr, weights_ptr, y_ptr, max_tiles,
    down_nib_ptr, down_scale_ptr, global_ptr,
    down_nib_stride, down_scale_stride, global_stride,
    H: tl.constexpr, I: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr,
):
    e, first, end = _tile(tiles_ptr, max_tiles)
    if first >= end:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    pair = tl.load(order_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < H
    group = tl.arange(0, BLOCK_K // 16)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, I, BLOCK_K):
        g = start // 16 + group
        g_mask = g < I // 16
        h_even, h_odd = _even_odd(h_ptr, rows.to(tl.int64) * I, row_mask, start, I, BLOCK_M, BLOCK_K, DOT)
        d_lo, d_hi = _dequant_tile(down_nib_ptr + e * down_nib_stride, down_scale_ptr + e * down_scale_stride,
                                   cols, col_mask, g, g_mask, I, BLOCK_N, BLOCK_K, DOT)
        acc = tl.dot(h_even, tl.trans(d_lo), acc, input_precision="ieee")
        acc = tl.dot(h_odd, tl.trans(d_hi), acc, input_precision="ieee")
    w = tl.load(weights_ptr + pair, mask=row_mask, other=0).to(tl.float32) * tl.load(global_ptr + e * global_stride + 2)
    tl.store(y_ptr + pair[:, None] * H + cols[None, :], acc * w[:, None], mask=row_mask[:, None] & col_mask[None, :])


def nvfp4_expert_swiglu_grouped(
    x: torch.Tensor, bank: ExpertBank, slots: torch.Tensor, weights: torch.Tensor,
    out: torch.Tensor | None = None, precision: str = "bf16",
    block_m: int = 64, block_n: int = 64, block_k: int = 64, num_warps: int = 4, num_stages: int = 3,
) -> torch.Tensor:
    """Routed SwiGLU experts for many tokens, straight from NVFP4 records.

    x [T, H]; slots [T, K] int, rows of `bank`; weights [T, K]. Returns out [T, H] (dtype of `out`
    if given, else x.dtype): out[t] = sum_k weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]).
    precision: "bf16" (tensor cores, CUDA only) or "fp32" (IEEE dots). Blocks: powers of two >= 16
    (block_k >= 32, so each half-K dot is at least 16 deep). The defaults were the fastest of a sweep
    at 2048 tokens on an H200 (2.6 ms for 20,480 pairs); block_m=16 suits a few tokens per expert."""
    tokens, k = slots.shape
    if tokens == 0:
        return torch.zeros_like(x) if out is None else out
    y = torch.empty(tokens * k, bank.hidden, dtype=torch.float32, device=x.device)
    nvfp4_expert_pairs_grouped(x, bank, slots, weights, y, precision=precision, block_m=block_m, block_n=block_n,
                               block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    result = y.view(tokens, k, bank.hidden).sum(dim=1)
    if out is None:
        return result.to(x.dtype)
    out.copy_(result)
    return out


def nvfp4_expert_pairs_grouped(
    x: torch.Tensor, bank: ExpertBank, slots: torch.Tensor, weights: torch.Tensor, y: torch.Tensor,
    bound: tuple[int, int] | None = None, precision: str = "bf16",
    block_m: int = 64, block_n: int = 64, block_k: int = 64, num_warps: int = 4, num_stages: int = 3,
) -> torch.Tensor:
    """Each (token, pick) pair's weighted expert output, into y float32 [T * K, H]:
    y[t * K + k] = weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]) for slots[t, k] >= 0; rows
    of pairs with slot -1 are left as they are, so a prompt whose experts arrive in chunks fills y
    chunk by chunk and sums it once. `bound`: see tile_plan.plan_size. Returns y."""
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision must be 'bf16' or 'fp32', got {precision!r}")
    if precision == "bf16" and x.device.type != "cuda":
        raise ValueError("bf16 tensor-core dots need CUDA: the triton 3.6 interpreter mis-multiplies bf16 in "
                         "tl.dot; use precision='fp32' there")
    tokens, hidden = x.shape
    k = slots.shape[1]
    if hidden != bank.hidden or slots.shape != (tokens, k) or weights.shape != (tokens, k) \
            or y.shape != (tokens * k, hidden) or y.dtype != torch.float32:
        raise ValueError(f"x {tuple(x.shape)}, slots {tuple(slots.shape)}, weights {tuple(weights.shape)}, "
                         f"y {tuple(y.shape)} {y.dtype} do not fit a bank with H={bank.hidden}")
    if tokens == 0:
        return y
    inter, act = bank.intermediate, torch.bfloat16 if precision == "bf16" else torch.float32
    dot = tl.bfloat16 if precision == "bf16" else tl.float32
    x_act, weights = x.to(act).contiguous(), weights.contiguous()
    order, tiles = plan_tiles(slots, bank.num_experts, block_m, bound)
    max_tiles = tiles.shape[1]
    # h is indexed by sorted row, and the pairs computed sort first: max_tiles full tiles hold them
    h = torch.empty(min(tokens * k, max_tiles * block_m), inter, dtype=act, device=x.device)
    gs = bank.global_scales
    scale_bytes = {p: bank.scales(p).view(torch.uint8) for p in ("gate", "up", "down")}
    _grouped_gate_up_kernel[(max_tiles, triton.cdiv(inter, block_n))](
        x_act, order, tiles, h, max_tiles,
        bank.gate_nibbles, bank.up_nibbles, scale_bytes["gate"], scale_bytes["up"], gs,
        bank.gate_nibbles.stride(0), bank.up_nibbles.stride(0), bank.gate_scales.stride(0),
        bank.up_scales.stride(0), gs.stride(0),
        hidden, inter, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot,
        num_warps=num_warps, num_stages=num_stages,
    )
    _grouped_down_kernel[(max_tiles, triton.cdiv(hidden, block_n))](
        h, order, tiles, weights, y, max_tiles,
        bank.down_nibbles, scale_bytes["down"], gs,
        bank.down_nibbles.stride(0), bank.down_scales.stride(0), gs.stride(0),
        hidden, inter, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot,
        num_warps=num_warps, num_stages=num_stages,
    )
    return y
