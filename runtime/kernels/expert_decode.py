"""Decode-time (few tokens) NVFP4 SwiGLU experts: matrix-vector kernels reading each weight byte once.

For T tokens, each with K routed experts (pairs p = t * K + k, bank row slots[t, k]):

    h[p]       = silu(gate_e x[t]) * up_e x[t]                      (kernel 1, grid P x I/BLOCK_I)
    partial[p] = weights[t, k] * down_e h[p]                        (kernel 2, grid P x H/BLOCK_O)
    out[t]     = sum_k partial[t * K + k]                           (kernel 3, a fixed-order sum)

Kernel 1 streams the gate and up rows of one expert side by side (the same x chunk serves both).
Each program's loop over the input is unrolled so all its loads are in flight together: at batch 1
the kernels are bound by memory latency as much as by bandwidth, so kernel 2 spreads over experts
too rather than walking them in turn. The sum over experts is a separate pass, not atomics, so the
result is deterministic. H, I and K are compile-time constants (one build per model), which also
keeps loop bounds plain ints under the interpreter (triton 3.6 + numpy 2.4, triton#9171).
Everything accumulates in float32; h stays float32. Each weight and scale byte of a selected expert
is read from memory once per token: this is the few-token path, the grouped kernel
(expert_grouped.py) takes over when tokens share experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpack.runtime.kernels.bank import ExpertBank
from flashpack.runtime.kernels.nvfp4_dequant import block_scale_f32, e2m1_low_high


@triton.jit
def _nvfp4_row_block_dot(nib_ptr, scale_ptr, rows, row_mask, vec_ptr, n_in: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr, BLOCK_IN: tl.constexpr):
    """float32 [BLOCK_ROWS]: rows of one NVFP4 matrix [*, n_in] (nibbles at nib_ptr, block scales at
    scale_ptr, both already offset to the expert) times the float vector at vec_ptr, no global scale.

    Tiles are [rows, 16-element groups, 8 bytes]: every load is contiguous, and each group's block
    scale multiplies the sum of its 16 products once."""
    GROUPS: tl.constexpr = BLOCK_IN // 16
    group = tl.arange(0, GROUPS)
    acc = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for start in tl.static_range(0, n_in, BLOCK_IN):  # unrolled, so every chunk's loads are in flight at once
        g = start // 16 + group
        g_mask = g < n_in // 16
        mask2 = row_mask[:, None] & g_mask[None, :]
        byte = g[:, None] * 8 + tl.arange(0, 8)[None, :]
        packed = tl.load(nib_ptr + rows[:, None, None] * (n_in // 2) + byte[None, :, :],
                         mask=mask2[:, :, None], other=0)
        scale = tl.load(scale_ptr + rows[:, None] * (n_in // 16) + g[None, :], mask=mask2, other=0)
        vec = tl.load(vec_ptr + g[:, None] * 16 + tl.arange(0, 16)[None, :], mask=g_mask[:, None], other=0)
        even, odd = tl.split(tl.reshape(vec.to(tl.float32), (GROUPS, 8, 2)))
        low, high = e2m1_low_high(packed)
        group_sum = tl.sum(low * even[None, :, :] + high * odd[None, :, :], axis=2)
        acc += tl.sum(group_sum * block_scale_f32(scale), axis=1)
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr, slots_ptr, h_ptr,
    gate_nib_ptr, up_nib_ptr, gate_scale_ptr, up_scale_ptr, global_ptr,
    gate_nib_stride, up_nib_stride, gate_scale_stride, up_scale_stride, global_stride,
    H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pair = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    row_mask = rows < I
    e = tl.load(slots_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // K).to(tl.int64) * H
    gate = _nvfp4_row_block_dot(gate_nib_ptr + e * gate_nib_stride, gate_scale_ptr + e * gate_scale_stride,
                                rows, row_mask, x_row, H, BLOCK_I, BLOCK_H)
    up = _nvfp4_row_block_dot(up_nib_ptr + e * up_nib_stride, up_scale_ptr + e * up_scale_stride,
                              rows, row_mask, x_row, H, BLOCK_I, BLOCK_H)
    gate = gate * tl.load(global_ptr + e * global_stride)
    up = up * tl.load(global_ptr + e * global_stride + 1)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + pair.to(tl.int64) * I + rows, h, mask=row_mask)


@triton.jit
def _down_kernel(
    h_ptr, slots_ptr, weights_ptr, partial_ptr,
    down_nib_ptr, down_scale_ptr, global_ptr,
    down_nib_stride, down_scale_stride, global_stride,
    H: tl.constexpr, I: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
):
    pair = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    row_mask = rows < H
    e = tl.load(slots_ptr + pair).to(tl.int64)
    y = _nvfp4_row_block_dot(down_nib_ptr + e * down_nib_stride, down_scale_ptr + e * down_scale_stride,
                             rows, row_mask, h_ptr + pair.to(tl.int64) * I, I, BLOCK_O, BLOCK_I)
    w = tl.load(weights_ptr + pair).to(tl.float32) * tl.load(global_ptr + e * global_stride + 2)
    tl.store(partial_ptr + pair.to(tl.int64) * H + rows, y * w, mask=row_mask)


@triton.jit
def _sum_experts_kernel(partial_ptr, out_ptr, H: tl.constexpr, K: tl.constexpr,
                        K_POW2: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, K_POW2)
    mask = (ks < K)[:, None] & (cols < H)[None, :]
    partial = tl.load(partial_ptr + (t * K + ks)[:, None] * H + cols[None, :], mask=mask, other=0)
    tl.store(out_ptr + t * H + cols, tl.sum(partial, axis=0).to(out_ptr.dtype.element_ty), mask=cols < H)


def nvfp4_expert_swiglu(
    x: torch.Tensor, bank: ExpertBank, slots: torch.Tensor, weights: torch.Tensor,
    out: torch.Tensor | None = None, h: torch.Tensor | None = None,
    block_i: int = 4, block_h: int = 1024, block_o: int = 16, block_down_in: int = 128, num_warps: int = 4,
) -> torch.Tensor:
    """Routed SwiGLU experts for a few tokens, straight from NVFP4 records.

    x [T, H] (or [H]) bf16/fp16/fp32; slots [T, K] (or [K]) int, rows of `bank`; weights [T, K]
    routing weights. Returns out [T, H] (or [H]), dtype of `out` if given, else x.dtype:
    out[t] = sum_k weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]), e = slots[t, k].
    `out` and `h` (float32 [T*K, I] scratch) may be passed preallocated; a float32 [T*K, H] scratch
    for the per-expert outputs is allocated here (graph-capturable, like every step).
    Defaults: the best of block-size sweeps on an H200 at H=2560, I=640, K=10 (bench/kernels.py):
    gate/up 22.8 us at block_i=4, block_h=1024 (32.8 at 8/512), down + sum about 13 us.
    Block sizes must be powers of two; block_h and block_down_in at least 16."""
    squeeze = x.dim() == 1
    if squeeze:
        x2, slots2, weights2 = x[None], slots.reshape(1, -1), weights.reshape(1, -1)
    else:
        x2, slots2, weights2 = x, slots, weights
    t, hidden = x2.shape
    k = slots2.shape[1]
    if hidden != bank.hidden or slots2.shape != (t, k) or weights2.shape != (t, k):
        raise ValueError(f"x {tuple(x.shape)}, slots {tuple(slots.shape)}, weights {tuple(weights.shape)} "
                         f"do not fit a bank with H={bank.hidden}")
    inter = bank.intermediate
    x2, slots2, weights2 = x2.contiguous(), slots2.contiguous(), weights2.contiguous()
    if h is None:
        h = torch.empty(t * k, inter, dtype=torch.float32, device=x.device)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(t, hidden)
    if h.shape != (t * k, inter) or h.dtype != torch.float32 or not h.is_contiguous() or not out2.is_contiguous():
        raise ValueError("h must be contiguous float32 [T*K, I] and out contiguous [T, H]")
    gs = bank.global_scales
    scale_bytes = {p: bank.scales(p).view(torch.uint8) for p in ("gate", "up", "down")}
    _gate_up_kernel[(t * k, triton.cdiv(inter, block_i))](
        x2, slots2, h,
        bank.gate_nibbles, bank.up_nibbles, scale_bytes["gate"], scale_bytes["up"], gs,
        bank.gate_nibbles.stride(0), bank.up_nibbles.stride(0), bank.gate_scales.stride(0),
        bank.up_scales.stride(0), gs.stride(0),
        hidden, inter, k, BLOCK_I=block_i, BLOCK_H=block_h, num_warps=num_warps,
    )
    partial = torch.empty(t * k, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(t * k, triton.cdiv(hidden, block_o))](
        h, slots2, weights2, partial,
        bank.down_nibbles, scale_bytes["down"], gs,
        bank.down_nibbles.stride(0), bank.down_scales.stride(0), gs.stride(0),
        hidden, inter, BLOCK_O=block_o, BLOCK_I=block_down_in, num_warps=num_warps,
    )
    _sum_experts_kernel[(t, triton.cdiv(hidden, 1024))](
        partial, out2, hidden, k, K_POW2=triton.next_power_of_2(k), BLOCK=1024)
    return out
