"""Sparse QSA prompt attention: each query token against the key blocks its indexer picked.

    prompt_attention(q [T, heads, hd], keys/values [kv_heads, L, hd], blocks int32 [T, NB], first,
                     ratio, scale) -> [T, heads, hd]
      query t sits at position first + t and attends to the keys block * ratio + j (0 <= j < ratio)
      of every block >= 0 in blocks[t], those at positions <= first + t; query head h reads KV head
      h // (heads / kv_heads) (grouped-query attention); -1 pads a row.

Why: past the indexer's budget a QSA query keeps at most budget + ratio - 1 keys (its top blocks
and its own incomplete block, `BlockIndexer.select_blocks`). The masked F.scaled_dot_product_attention
this replaces (reference.py's `prompt_attention_reference`) scores every query against every earlier
key and then masks, and with grouped KV heads and a mask torch takes its float32 math kernel: on
an H200, every record resident, that was 517 ms of the 826 ms of device time a 32k prompt took in
4 layers, all in the one QSA layer.

Design: grid (T, kv_heads), one program per token and KV head. The group's query heads (12 at the
real dims, padded to 16 rows) walk the token's blocks BLOCK_N // ratio at a time, gathering those
BLOCK_N keys' rows (loads masked per key: padding and future keys are never read) into
decode_attention's online-softmax step, then normalise and store. No split over the keys: T x
kv_heads programs fill the GPU. The step count is a constexpr rounded up to a power of two (one build
per power, not one per prompt length); a step keeping no key (the padding, a query's rows of -1)
branches around its loads and math.

An eager one-token step (`attend_cache` without decode graphs) also comes here, as kv_heads programs
walking up to budget / ratio + 1 blocks each; decode graphs take decode_attention's split-K kernels.

Precision follows decode_attention: the inputs' dtype on CUDA's tensor cores (float32 sums), IEEE
float32 for float32 inputs and off CUDA (the interpreter's bf16 tl.dot is wrong).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flashpack.runtime.kernels.decode_attention import LOG2E, _attend_block

# keys a program gathers at a time: built offline for sm_90 at the real dims (bf16, 4 warps) 32 takes
# 235 registers (two programs an SM), 16 takes 149 (three), neither spills; 32 halves the steps, each
# a block-id load and then the gather that depends on it
BLOCK_N = 32


# do_not_specialize: `first` is a prompt chunk's start, which Triton would otherwise build again for
# when it is 1 or a multiple of 16.
@triton.jit(do_not_specialize=["first"])
def _prompt_attention_kernel(
    q_ptr, k_ptr, v_ptr, blocks_ptr, out_ptr, first, qk_scale,
    stride_qt, stride_qh, stride_kh, stride_kn, stride_vh, stride_vn, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, HD: tl.constexpr, GROUP_PAD: tl.constexpr, HD_PAD: tl.constexpr,
    RATIO: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr, DOT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HD_PAD)
    g_mask, d_mask = g < GROUP, d < HD
    heads = head * GROUP + g  # this KV head's query heads
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0).to(DOT)
    position = first + token
    k_base = k_ptr + head * stride_kh
    v_base = v_ptr + head * stride_vh
    j = tl.arange(0, BLOCK_N)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HD_PAD], dtype=tl.float32)
    for step in range(STEPS):
        block = tl.load(blocks_ptr + token * stride_bt + step * (BLOCK_N // RATIO) + j // RATIO)
        n = block * RATIO + j % RATIO
        kept = (block >= 0) & (n <= position)
        if tl.max(kept.to(tl.int32), axis=0) > 0:  # else no load, no math: padding, or a block past the query
            n = tl.where(kept, n, 0)
            k_rows = k_base + n[:, None] * stride_kn + d[None, :]
            v_rows = v_base + n[:, None] * stride_vn + d[None, :]
            m_i, l_i, acc = _attend_block(q, k_rows, v_rows, kept, kept[:, None] & d_mask[None, :],
                                          m_i, l_i, acc, qk_scale, DOT)
    out = acc / l_i[:, None]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def key_block_steps(blocks: int, ratio: int, block_n: int = BLOCK_N) -> int:
    """The steps a program takes over a row of `blocks` key blocks: a constexpr of the kernel,
    rounded up to a power of two, so the kernel is built once for each (Engine.warm_up_plan runs a
    prompt of each)."""
    return triton.next_power_of_2(triton.cdiv(blocks, block_n // ratio))


def prompt_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: torch.Tensor, first: int, ratio: int,
    scale: float, block_n: int = BLOCK_N, precision: str = "auto", num_warps: int = 4,
) -> torch.Tensor:
    """q [T, heads, hd]; keys, values [kv_heads, L, hd] in q's dtype (last dim contiguous), L >= first + T;
    blocks int [T, NB], every row keeping at least one key (else nan, not checked: that would sync)
    -> [T, heads, hd] in q's dtype. ratio: a power of two <= block_n; block_n a power of two >= 16;
    precision "auto" or "fp32" as decode_attention's."""
    tokens, heads, hd = q.shape
    kv_heads = keys.shape[0]
    if (heads % kv_heads or keys.shape != (kv_heads, keys.shape[1], hd) or values.shape != keys.shape
            or keys.shape[1] < first + tokens or blocks.shape[0] != tokens or blocks.ndim != 2
            or keys.dtype != q.dtype or values.dtype != q.dtype
            or q.dtype not in (torch.bfloat16, torch.float16, torch.float32)
            or q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1):
        raise ValueError(f"q {q.dtype} {tuple(q.shape)}, keys {keys.dtype} {tuple(keys.shape)}, values "
                         f"{values.dtype} {tuple(values.shape)}, blocks {tuple(blocks.shape)}, first {first} do not fit")
    if precision not in ("auto", "fp32"):
        raise ValueError(f"precision must be 'auto' or 'fp32', got {precision!r}")
    if block_n < 16 or block_n & (block_n - 1) or ratio < 1 or ratio & (ratio - 1) or ratio > block_n:
        raise ValueError(f"block_n ({block_n}) must be a power of two >= 16 and ratio ({ratio}) a power of two <= it")
    if keys.shape[1] * max(keys.stride(1), values.stride(1)) >= 2**31:
        raise ValueError(f"a head's keys span {keys.shape[1]} x {keys.stride(1)} elements: over the kernel's int32 offsets")
    out = torch.empty(tokens, heads, hd, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    per_step = block_n // ratio
    steps = key_block_steps(blocks.shape[1], ratio, block_n)
    padded = F.pad(blocks.to(torch.int32), (0, steps * per_step - blocks.shape[1]), value=-1).contiguous()
    fp32 = precision == "fp32" or q.dtype == torch.float32 or q.device.type != "cuda"
    dot = tl.float32 if fp32 else (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16)
    group = heads // kv_heads
    _prompt_attention_kernel[(tokens, kv_heads)](
        q, keys, values, padded, out, first, float(scale) * LOG2E,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        padded.stride(0), out.stride(0), out.stride(1),
        GROUP=group, HD=hd, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HD_PAD=max(16, triton.next_power_of_2(hd)), RATIO=ratio, BLOCK_N=block_n, STEPS=steps, DOT=dot,
        num_warps=num_warps)
    return out
