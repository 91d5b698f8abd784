"""Masked decode attention, split over the keys ("flash-decoding"): one token's query heads against
a preallocated KV cache and a bool mask of the keys it may see.

    decode_attention(q [kv_heads, group, hd], keys/values [kv_heads, capacity, hd], keep bool [capacity],
                     scale) -> [kv_heads, group, hd]
      = softmax(scale * q k^T, over the kept keys) v, per KV head (the group's query heads share it)

Why: QSA decode (runtime/model/qsa_attention.py, `QSAAttention.attend_step`, replayed from a CUDA
graph, so every shape is fixed) attends over the whole cache buffer with a mask of the keys the
token sees: a causal prefix, or once the context is long the tokens of the indexer's top blocks plus
the incomplete tail, at most budget + ratio - 1 (~2051) keys. Its F.scaled_dot_product_attention
call (the memory-efficient kernel; real dims 24 heads, 2 KV heads so group 12, head_dim 256, bf16)
took 33 us on an H200 at a capacity of ~600 keys: its grid is kv_heads x 1 programs, 2 of 132 SMs,
and it reads the whole capacity whatever the mask (at a 32k context all 32k keys, every token).

Design, two kernels:

    kernel 1, grid (kv_heads, splits): each program walks its run of BLOCK_N-key blocks. It loads the
        block's keep mask first and skips the block (no key or value load, no math) when no key in it
        is kept; the loads of a block it does take are masked by keep per key, so only kept rows are
        read (bytes follow the mask, not the capacity; a stale or poisoned row never enters the sums).
        Scores q k^T and p v are tl.dot on [GROUP_PAD (>= 16), ...] tiles (the group padded with zero
        rows), with an online softmax in float32 (base 2, scale * log2(e) folded into the scores);
        the split's (max, sum, acc [group, hd]) go to float32 scratch. skip_empty=False drops the
        branch: every block's masked loads then sit at the loop's top level, where Triton pipelines
        them (cp.async, num_stages). On an H200 skipping won where the mask is sparse
        (18.6 against 25.2 us at 2,050 of 32,768 keys) and cost little where it is dense (5.6
        against 5.3 us at 550 of 600), so it is the default.
    kernel 2, grid (kv_heads * group, hd / BLOCK_D): loads every split's (max, sum, acc slice) at
        once, rescales by exp2(max_s - max) (a split with no kept key, max -inf, weighs 0: guarded, no
        -inf - -inf nan), divides by the total sum and stores in q's dtype.

Splits: the blocks per split are the least power of two that needs at most max_splits (128) splits,
then as many splits as the blocks need, none empty: capacity 600 -> 38 blocks of 16, 38 splits of
one; 32768 -> 2048 blocks, 128 splits of 16; 2 KV heads -> 76 and 256 programs for 132 SMs. The
blocks per split are a constexpr (Triton's interpreter cannot loop over a runtime value), so there
is one build per power of two, not one per capacity. Scratch is splits x group x (hd + 2) float32 per
KV head (3 MB at 32k, in the L2). Everything is derived from tensor shapes, scratch is torch.empty'd
in the call and nothing syncs with the host: the call can be captured in a CUDA graph as attend_step
is. Built offline for sm_90 at the real dims (bf16, block_n 16, 4 warps): kernel 1 uses 68
registers at one block per split and 138 at 16 (100 without the skip), kernel 2 48-56; no spills.

Precision: on CUDA the dots take the inputs' own dtype on the tensor cores (bf16/fp16 q and k exact
products with float32 sums; the probabilities are rounded to that dtype for p v, as flash attention
does) and IEEE float32 for float32 inputs. Elsewhere (Triton's interpreter, whose tl.dot mis-multiplies
bf16 in triton 3.6) every dot is IEEE float32, as is precision="fp32" anywhere.

The reference is reference.py's `decode_attention_reference`: the SDPA call exactly as attend_step
made it before this kernel, in float32 unless told otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 16  # keys a program takes at a time
MAX_SPLITS = 128  # programs per KV head at most
COMBINE_ELEMENTS = 4096  # splits x head dims a combining program loads at once
LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(q, k_rows, v_rows, kept, load_mask, m_i, l_i, acc, qk_scale, DOT: tl.constexpr):
    """One block's keys into the online softmax: loads masked by keep (no unkept row is read)."""
    v = tl.load(v_rows, mask=load_mask, other=0)  # the values first: in flight with the keys
    k = tl.load(k_rows, mask=load_mask, other=0)
    s = tl.dot(q, tl.trans(k.to(DOT)), input_precision="ieee") * qk_scale  # [GROUP_PAD, BLOCK_N], log2 units
    s = tl.where(kept[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # nothing kept yet (SKIP off): no -inf - -inf
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(DOT), v.to(DOT), acc * alpha[:, None], input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, keep_ptr, max_ptr, sum_ptr, acc_ptr,
    capacity, qk_scale,
    stride_qh, stride_qg, stride_kh, stride_kn, stride_vh, stride_vn,
    GROUP: tl.constexpr, HD: tl.constexpr, GROUP_PAD: tl.constexpr, HD_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, STEPS: tl.constexpr, SKIP: tl.constexpr, DOT: tl.constexpr,
):
    head = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HD_PAD)
    g_mask, d_mask = g < GROUP, d < HD
    q = tl.load(q_ptr + head * stride_qh + g[:, None] * stride_qg + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0).to(DOT)
    k_base = k_ptr + head * stride_kh
    v_base = v_ptr + head * stride_vh
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HD_PAD], dtype=tl.float32)
    # STEPS blocks per split, a constexpr (the interpreter loops over no runtime value) and a power of
    # two (one build per power); the last split's blocks past the end keep nothing
    for step in range(STEPS):
        n = (split * STEPS + step) * BLOCK_N + tl.arange(0, BLOCK_N)
        kept = tl.load(keep_ptr + n, mask=n < capacity, other=0) != 0
        k_rows = k_base + n[:, None] * stride_kn + d[None, :]  # int32 offsets within the head (checked by the caller)
        v_rows = v_base + n[:, None] * stride_vn + d[None, :]
        load_mask = kept[:, None] & d_mask[None, :]
        if SKIP:
            if tl.max(kept.to(tl.int32), axis=0) > 0:  # else no load, no math: the block is not read
                m_i, l_i, acc = _attend_block(q, k_rows, v_rows, kept, load_mask, m_i, l_i, acc, qk_scale, DOT)
        else:  # loads at the loop's top level, which Triton can pipeline (num_stages); unkept rows still unread
            m_i, l_i, acc = _attend_block(q, k_rows, v_rows, kept, load_mask, m_i, l_i, acc, qk_scale, DOT)
    row = (head * splits + split) * GROUP + g
    tl.store(max_ptr + row, m_i, mask=g_mask)
    tl.store(sum_ptr + row, l_i, mask=g_mask)
    tl.store(acc_ptr + row[:, None] * HD + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _combine_kernel(
    max_ptr, sum_ptr, acc_ptr, out_ptr, splits, stride_oh, stride_og,
    GROUP: tl.constexpr, HD: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    head, g = (pid // GROUP).to(tl.int64), pid % GROUP
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < HD
    s = tl.arange(0, SPLITS_PAD)
    s_mask = s < splits
    row = (head * splits + s) * GROUP + g
    # every split at once: one round trip (SPLITS_PAD x BLOCK_D floats, 32 a thread at 4 warps)
    maxes = tl.load(max_ptr + row, mask=s_mask, other=float("-inf"))
    sums = tl.load(sum_ptr + row, mask=s_mask, other=0)
    acc = tl.load(acc_ptr + row[:, None] * HD + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0)
    m = tl.max(maxes, axis=0)  # finite while some key is kept
    w = tl.where(maxes > float("-inf"), tl.exp2(maxes - m), 0.0)  # a split with no kept key weighs 0, never nan
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * sums, axis=0)
    tl.store(out_ptr + head * stride_oh + g * stride_og + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode_splits(capacity: int, block_n: int = BLOCK_N, max_splits: int = MAX_SPLITS) -> tuple[int, int]:
    """(splits, blocks per split) for a capacity: blocks per split the least power of two that needs
    no more than max_splits splits, then as many splits as the key blocks need (none empty; about
    max_splits / 2 or more once the capacity is over max_splits blocks)."""
    blocks = triton.cdiv(capacity, block_n)
    per_split = triton.next_power_of_2(triton.cdiv(blocks, max_splits))
    return triton.cdiv(blocks, per_split), per_split


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, scale: float,
    out: torch.Tensor | None = None, block_n: int = BLOCK_N, max_splits: int = MAX_SPLITS,
    precision: str = "auto", skip_empty: bool = True, num_warps: int = 4, num_stages: int | None = None,
    combine_warps: int = 4,
) -> torch.Tensor:
    """q [kv_heads, group, hd]; keys, values [kv_heads, capacity, hd] in q's dtype (bf16, fp16 or
    fp32; last dim contiguous, any capacity >= 1); keep bool [capacity], at least one True (with
    none the result is nan, not checked: that would sync) -> [kv_heads, group, hd] in q's dtype (or
    written into `out`): softmax(scale * q k^T over the kept keys) v per KV head.

    block_n: keys per block, a power of two >= 16; max_splits: programs per KV head at most (see
    `decode_splits`); precision "auto" (the inputs' dtype on CUDA's tensor cores, IEEE float32 for
    float32 inputs and off CUDA) or "fp32" (IEEE float32 dots); skip_empty: branch around blocks that
    keep no key (False: pipelined masked loads instead). No host sync, sizes from shapes only:
    CUDA-graph capturable."""
    kv_heads, group, hd = q.shape
    if (keys.shape != (kv_heads, keys.shape[1], hd) or values.shape != keys.shape or keys.shape[1] < 1
            or keep.shape != (keys.shape[1],) or keep.dtype != torch.bool
            or keys.dtype != q.dtype or values.dtype != q.dtype
            or q.dtype not in (torch.bfloat16, torch.float16, torch.float32)
            or q.stride(-1) != 1 or keys.stride(-1) != 1 or values.stride(-1) != 1):
        raise ValueError(f"q {q.dtype} {tuple(q.shape)}, keys {keys.dtype} {tuple(keys.shape)} stride {keys.stride()}, "
                         f"values {values.dtype} {tuple(values.shape)} stride {values.stride()}, "
                         f"keep {keep.dtype} {tuple(keep.shape)} do not fit")
    if precision not in ("auto", "fp32"):
        raise ValueError(f"precision must be 'auto' or 'fp32', got {precision!r}")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with its last dim contiguous")
    capacity = keys.shape[1]
    if capacity * max(keys.stride(1), values.stride(1)) >= 2**31:
        raise ValueError(f"a head's keys span {capacity} x {keys.stride(1)} elements: over the kernel's int32 offsets")
    splits, per_split = decode_splits(capacity, block_n, max_splits)
    fp32 = precision == "fp32" or q.dtype == torch.float32 or q.device.type != "cuda"
    dot = tl.float32 if fp32 else (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16)
    maxes = torch.empty(kv_heads, splits, group, dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxes)
    acc = torch.empty(kv_heads, splits, group, hd, dtype=torch.float32, device=q.device)
    _split_kernel[(kv_heads, splits)](
        q, keys, values, keep.contiguous().view(torch.uint8), maxes, sums, acc, capacity, float(scale) * LOG2E,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        GROUP=group, HD=hd, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HD_PAD=max(16, triton.next_power_of_2(hd)), BLOCK_N=block_n, STEPS=per_split, SKIP=skip_empty, DOT=dot, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}))
    splits_pad = triton.next_power_of_2(splits)
    block_d = min(triton.next_power_of_2(hd), max(16, COMBINE_ELEMENTS // splits_pad))
    _combine_kernel[(kv_heads * group, triton.cdiv(hd, block_d))](
        maxes, sums, acc, out, splits, out.stride(0), out.stride(1),
        GROUP=group, HD=hd, SPLITS_PAD=splits_pad, BLOCK_D=block_d, num_warps=combine_warps)
    return out
