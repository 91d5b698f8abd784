"""Decode-time (few tokens) NVFP4 SwiGLU experts: matrix-vector kernels reading each weight byte once.

For T tokens, each with K routed experts (pairs p = t * K + k, bank row slots[t, k]):

    h[p]       = silu(gate_e x[t]) * up_e x[t]                      (kernel 1, grid P x I/BLOCK_I)
    partial[p] = weights[t, k] * down_e h[p]                        (kernel 2, grid P x H/BLOCK_O)
    out[t]     = sum_k partial[t * K + k]                           (kernel 3, a fixed-order sum: sum_partials)

Kernel 1 streams the gate and up rows of one expert side by side (the same x chunk serves both).
Each program's loop over the input is unrolled so all its loads are in flight together: at batch 1
the kernels are bound by memory latency as much as by bandwidth, so kernel 2 spreads over experts
too rather than walking them in turn. The sum over experts is a separate pass, not atomics, so the
result is deterministic. H, I and K are compile-time constants (one build per model), which also
keeps loop bounds plain ints under the interpreter (triton 3.6 + numpy 2.4, triton#9171).
Everything accumulates in float32; h stays float32. Each weight and scale byte of a selected expert
is read from memory once per token: this is the few-token path, the grouped kernel
(expert_grouped.py) takes over when tokens share experts.

Kernels 1 and 2 are built for throughput: every tile is 2-D [rows, groups] in one layout. A group
(16 elements) is one uint64 (8-byte loads) beside its one scale byte; each thread holds one group
of a chunk for each of its rows (rows per thread = rows * groups of a chunk / (32 * num_warps), 4
at the defaults), so each x value it loads serves all those rows, and gate and up both. Products
accumulate in a [rows, groups] float32 tile reduced across threads once, at the end: one barrier a
program, before the store. Nibbles decode in ~2.6 integer operations each (`_e2m1_spread`) to
their value times 2^-126, and x is scaled by 2^64 as it is loaded (X_SCALE says why). In their
sm_90 code (ptxas via triton 3.6, H=2560, I=640, K=10, the default blocks): ~5 instructions a
nibble; up to 224 (gate/up) and 80 (down) bytes of weights a thread in flight; 127 and 72
registers, so the 400 programs of four warps of each kernel for a 10-expert token all fit on the
GPU at once.

The kernels these replaced tiled [rows, groups, 2] uint32 words beside [rows, groups] scales and
[groups, 2] vector loads: converting between those layouts cost 61 barriers a gate/up program, and
ptxas kept at most 16 bytes of weights a thread in flight, so they streamed the weights at about
0.8 TB/s on an H200 (34.2 us for the three kernels at 10 experts, against 22.0 for these).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashpack.runtime.kernels.bank import ExpertBank

# A decoded nibble is its E2M1 value times 2^-126 (0.5 is the subnormal 2^-127: `_e2m1_spread_nibble`),
# and x is scaled by 2^64 as it is loaded, one multiply a loaded x instead of one a nibble. The fma
# that meets them takes the subnormal operand as it is (Triton emits fma.rn.f32, not .ftz: no
# FFMA.FTZ in the sm_90 code) and the product E2M1 * x * 2^-62 is normal for 2^-63 <= |x| < 2^64,
# so the sums are those of the unscaled values up to their order; a smaller |x| rounds at 2^-150
# (2^-88 once the block scale is on: nothing), a larger one overflows. The block scale carries the
# 2^62 back. numpy keeps subnormals too, so the interpreter runs the same arithmetic (test_input_range).
X_SCALE: tl.constexpr = tl.constexpr(2.0**64)
BLOCK_SCALE: tl.constexpr = tl.constexpr(2.0**62)
SPREAD_MAGNITUDES: tl.constexpr = tl.constexpr(0x01DC01DC)  # bits 2-4, 6-8, 18-20, 22-24
SPREAD_SIGNS: tl.constexpr = tl.constexpr(0xFE23FE23)  # the rest: signs at 11, 15, 27, 31


@triton.jit
def _e2m1_spread(words):
    """uint32 words -> nibbles 0, 1, 4 and 5 rearranged so each one's sign lies 9 bits above its
    three magnitude bits (magnitudes at bits 2, 6, 18 and 22, signs at 11, 15, 27 and 31; other
    bits are don't-care): the spacing of the float32 that `_e2m1_spread_nibble` makes (magnitude at
    bits 22-24, sign at 31), so it decodes each with one shift and one mask, not two of each as
    from the word itself. `_e2m1_spread(words >> 8)` does nibbles 2, 3, 6 and 7."""
    return ((words << 2) & SPREAD_MAGNITUDES) | ((words << 8) & SPREAD_SIGNS)


@triton.jit
def _e2m1_spread_nibble(spread, slot: tl.constexpr):
    """float32 of the nibble in `slot` (0-3: nibbles 0, 1, 4, 5 of the words `_e2m1_spread` took)
    times 2^-126: the three magnitude bits become float32 bits 22-24 (exponent bits 23-24, mantissa
    bit 22) and the sign bit 31, so E2M1's exponent and mantissa line up with float32's and code 1
    (0.5) lands on the subnormal 2^-127. Integer shifts and masks only, then a bitcast."""
    return ((spread << (20 - 4 * (slot % 2) - 16 * (slot // 2))) & 0x81C00000).to(tl.float32, bitcast=True)


@triton.jit
def _nvfp4_chunk(group_rows, scale_rows, x_ptr, group, group_mask, mask):
    """float32 [ROWS, GROUPS]: for each row and each 16-element group of this chunk, the group's
    elements times x, summed and times its block scale (no global scale). Summed over the chunks
    (elementwise, in registers) and then over groups (across threads, once), the rows' dot
    products with x.

    group_rows: uint64 pointers [ROWS, 1] to each row's first group of nibbles (8-byte aligned),
    scale_rows: its first scale byte; group [GROUPS] indexes the chunk's groups in a row.
    Declaring the pointers aligned to one element only (8 bytes, 1 byte) gives both loads the
    layout of one group per thread and row, rows repeated over threads. Left alone, Triton sizes
    the vector a thread loads by the scale bytes (up to 16) and gives each thread that many groups
    of one row instead: an x value would then serve one row. The x loads are the same ops for
    every matrix of one kernel, so the compiler shares them (one load each in the sm_90 code)."""
    groups = tl.load(tl.multiple_of(group_rows + group[None, :], [1, 8]), mask=mask, other=0)
    scales = tl.load(tl.multiple_of(scale_rows + group[None, :], [1, 1]), mask=mask, other=0)
    acc = tl.zeros(groups.shape, dtype=tl.float32)
    for half in tl.static_range(2):  # the group's two words: elements 0-7, then 8-15
        words = (groups >> (32 * half)).to(tl.uint32)
        for upper in tl.static_range(2):  # nibbles 0, 1, 4, 5 of the word, then 2, 3, 6, 7
            spread = _e2m1_spread(words >> (8 * upper))
            for slot in tl.static_range(4):
                n = 8 * half + 2 * upper + slot % 2 + 4 * (slot // 2)
                x = tl.load(x_ptr + 16 * group + n, mask=group_mask, other=0).to(tl.float32) * X_SCALE
                acc += _e2m1_spread_nibble(spread, slot) * x[None, :]
    return acc * (scales.to(tl.float8e4nv, bitcast=True).to(tl.float32) * BLOCK_SCALE)


@triton.jit
def _gate_up_kernel(
    x_ptr, slots_ptr, h_ptr,
    gate_nib_ptr, up_nib_ptr, gate_scale_ptr, up_scale_ptr, global_ptr,
    gate_nib_stride, up_nib_stride, gate_scale_stride, up_scale_stride, global_stride,
    H: tl.constexpr, I: tl.constexpr, K: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Kernel 1, one pair and BLOCK_I rows of gate and up a program: both chunk by chunk, sharing x."""
    pair = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    row_mask = rows < I
    e = tl.load(slots_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // K).to(tl.int64) * H
    GROUPS: tl.constexpr = BLOCK_H // 16
    row_groups = rows[:, None] * (H // 16)
    gate_groups = (gate_nib_ptr + e * gate_nib_stride).to(tl.pointer_type(tl.uint64)) + row_groups
    up_groups = (up_nib_ptr + e * up_nib_stride).to(tl.pointer_type(tl.uint64)) + row_groups
    gate_scales = gate_scale_ptr + e * gate_scale_stride + row_groups
    up_scales = up_scale_ptr + e * up_scale_stride + row_groups
    gate = tl.zeros([BLOCK_I, GROUPS], dtype=tl.float32)
    up = tl.zeros([BLOCK_I, GROUPS], dtype=tl.float32)
    for start in tl.static_range(0, H // 16, GROUPS):  # unrolled, so every chunk's loads are in flight at once
        group = start + tl.arange(0, GROUPS)
        group_mask = group < H // 16
        mask = row_mask[:, None] & group_mask[None, :]
        gate += _nvfp4_chunk(gate_groups, gate_scales, x_row, group, group_mask, mask)
        up += _nvfp4_chunk(up_groups, up_scales, x_row, group, group_mask, mask)
    gate = tl.sum(gate, axis=1) * tl.load(global_ptr + e * global_stride)
    up = tl.sum(up, axis=1) * tl.load(global_ptr + e * global_stride + 1)
    tl.store(h_ptr + pair.to(tl.int64) * I + rows, gate * tl.sigmoid(gate) * up, mask=row_mask)


@triton.jit
def _down_kernel(
    h_ptr, slots_ptr, weights_ptr, partial_ptr,
    down_nib_ptr, down_scale_ptr, global_ptr,
    down_nib_stride, down_scale_stride, global_stride,
    H: tl.constexpr, I: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """Kernel 2, one pair and BLOCK_O rows of down a program, times the routing and global weights."""
    pair = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    row_mask = rows < H
    e = tl.load(slots_ptr + pair).to(tl.int64)
    h_row = h_ptr + pair.to(tl.int64) * I
    GROUPS: tl.constexpr = BLOCK_I // 16
    row_groups = rows[:, None] * (I // 16)
    down_groups = (down_nib_ptr + e * down_nib_stride).to(tl.pointer_type(tl.uint64)) + row_groups
    down_scales = down_scale_ptr + e * down_scale_stride + row_groups
    acc = tl.zeros([BLOCK_O, GROUPS], dtype=tl.float32)
    for start in tl.static_range(0, I // 16, GROUPS):  # unrolled, so every chunk's loads are in flight at once
        group = start + tl.arange(0, GROUPS)
        group_mask = group < I // 16
        acc += _nvfp4_chunk(down_groups, down_scales, h_row, group, group_mask,
                            row_mask[:, None] & group_mask[None, :])
    w = tl.load(weights_ptr + pair).to(tl.float32) * tl.load(global_ptr + e * global_stride + 2)
    tl.store(partial_ptr + pair.to(tl.int64) * H + rows, tl.sum(acc, axis=1) * w, mask=row_mask)


@triton.jit
def _sum_partials_kernel(partial_ptr, out_ptr, H: tl.constexpr, K: tl.constexpr,
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
    block_i: int = 16, block_h: int = 512, block_o: int = 64, block_down_in: int = 128, num_warps: int = 4,
) -> torch.Tensor:
    """Routed SwiGLU experts for a few tokens, straight from NVFP4 records.

    x [T, H] (or [H]) bf16/fp16/fp32; slots [T, K] (or [K]) int, rows of `bank`; weights [T, K]
    routing weights. Returns out [T, H] (or [H]), dtype of `out` if given, else x.dtype:
    out[t] = sum_k weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]), e = slots[t, k].
    `out` and `h` (float32 [T*K, I] scratch) may be passed preallocated; a float32 [T*K, H] scratch
    for the per-expert outputs is allocated here (graph-capturable, like every step). Nibbles are
    read 8 bytes at a time; ExpertBank checks that each expert's nibbles start on an 8-byte boundary.
    Blocks: rows a program (block_i gate/up, block_o down) and input elements a chunk (block_h,
    block_down_in); powers of two, the chunks at least 16. The defaults (four rows a thread in
    both kernels, 400 programs each) took 22.0 us for the three kernels on an H200
    (bench/kernels.py --only decode, 10 experts, H=2560, I=640) against 34.2 for the kernels these
    replaced; in the block sweep around them block_o 32 took 22.6 us, block_o 128 22.8 and block_i
    8 23.2."""
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
    sum_partials(partial.view(t, k, hidden), out2)
    return out


def sum_partials(partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [T, H] = partial [T, K, H] (float32, contiguous) summed over K in a fixed order, cast to
    out's dtype: one launch, deterministic (no atomics). Also tile_linear's sum over column splits."""
    t, k, hidden = partial.shape
    _sum_partials_kernel[(t, triton.cdiv(hidden, 1024))](
        partial, out, hidden, k, K_POW2=triton.next_power_of_2(k), BLOCK=1024)
    return out
