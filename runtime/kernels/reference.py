"""Plain-PyTorch references for every kernel in this package: dequantise fully, then matmul.

These are the specification the Triton kernels are tested against and the path the dispatcher
takes where Triton cannot run. Everything is computed in float32; `act_dtype=torch.bfloat16`
additionally rounds the activations where the W4A16 kernels do (x, and the SwiGLU output h before
the down projection), so a bf16 kernel can be compared at accumulation-order tolerance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashpack.layout.nvfp4 import dequantize_fp8_rows, dequantize_nvfp4
from flashpack.runtime.kernels.bank import ExpertBank

PROJECTION_INDEX = {"gate": 0, "up": 1, "down": 2}
# cuDNN's attention builds an execution plan per new shape (65 ms each on an H200), and decode has a
# new key length every token: keep to the backends that take any length as it comes.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def dequantize_expert(bank: ExpertBank, slot: int, projection: str) -> torch.Tensor:
    """float32 [out, in] of one projection of bank row `slot` (gate, up [I, H]; down [H, I])."""
    return dequantize_nvfp4(
        bank.nibbles(projection)[slot], bank.scales(projection)[slot],
        bank.global_scales[slot, PROJECTION_INDEX[projection]],
    )


def _round(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None else t.to(dtype).float()


def expert_swiglu_reference(
    x: torch.Tensor, bank: ExpertBank, slots: torch.Tensor, weights: torch.Tensor,
    act_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [T, H], slots [T, K] (bank rows), weights [T, K] -> [T, H] in out_dtype (default x.dtype):

        out[t] = sum_k weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]),  e = slots[t, k]

    accumulated over k in order, in float32."""
    y = torch.empty(slots.numel(), bank.hidden, dtype=torch.float32, device=x.device)
    y = expert_pairs_reference(x, bank, slots, weights, y, act_dtype)
    return y.view(*slots.shape, bank.hidden).sum(dim=1).to(out_dtype or x.dtype)


def expert_pairs_reference(
    x: torch.Tensor, bank: ExpertBank, slots: torch.Tensor, weights: torch.Tensor, y: torch.Tensor,
    act_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Each (token, pick) pair's weighted expert output, into y float32 [T * K, H]:

        y[t * K + k] = weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]),  e = slots[t, k] >= 0

    Rows of pairs with slot -1 are left as they are (a prompt's experts arrive in chunks, each
    call fills the pairs of the experts it holds). Returns y."""
    xf = _round(x.float(), act_dtype)
    flat = slots.reshape(-1)
    for slot in torch.unique(flat[flat >= 0]).tolist():
        pairs = torch.where(flat == slot)[0]
        h = xf[pairs // slots.shape[1]]
        h = F.silu(h @ dequantize_expert(bank, slot, "gate").T) * (h @ dequantize_expert(bank, slot, "up").T)
        out = _round(h, act_dtype) @ dequantize_expert(bank, slot, "down").T
        y[pairs] = out * weights.reshape(-1)[pairs, None].float()
    return y


def fp8_linear_reference(
    x: torch.Tensor, values: torch.Tensor, row_scale: torch.Tensor,
    act_dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., C], values float8_e4m3fn [R, C], row_scale float32 [R] -> [..., R]: x @ (values * scale)^T."""
    y = _round(x.float(), act_dtype) @ dequantize_fp8_rows(values, row_scale).T
    return y.to(out_dtype or x.dtype)


def router_top_k_reference(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights float32 [T, k], expert ids int64 [T, k]): the k largest of
    softmax(logits) in float32, descending, divided by their sum when `renormalise`."""
    weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def stage_records_reference(source: torch.Tensor, offsets: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """source int32 [N]; offsets int64 [K] in int32 words, -1 to skip; target int32 [K, words]:
    target[k] = source[offsets[k]:offsets[k] + words] where offsets[k] >= 0, other rows untouched."""
    words = target.shape[1]
    for row, offset in enumerate(offsets.tolist()):
        if offset >= 0:
            target[row] = source[offset:offset + words]
    return target


def decode_attention_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, scale: float,
    dtype: torch.dtype | None = torch.float32,
) -> torch.Tensor:
    """One decode token's masked attention (decode_attention.py's kernel): F.scaled_dot_product_attention
    of q [kv_heads, group, hd] (the group's heads as a batch of queries) against keys/values
    [kv_heads, capacity, hd] masked by keep [capacity], computed in `dtype` (None: the inputs' own)
    -> [kv_heads, group, hd]."""
    if dtype is not None:
        q, keys, values = q.to(dtype), keys.to(dtype), values.to(dtype)
    with sdpa_kernel(ATTENTION_BACKENDS):
        out = F.scaled_dot_product_attention(
            q[:, None], keys[:, None], values[:, None], attn_mask=keep[None, None, None, :], scale=scale,
        )  # [kv_heads, 1, group, hd]
    return out[:, 0]


def prompt_keep_mask(blocks: torch.Tensor, first: int, ratio: int, length: int) -> torch.Tensor:
    """blocks int [T, NB] (-1 pads) -> bool [T, length]: the keys query t (position first + t) sees,
    every key block * ratio + j (j < ratio) of its blocks at positions <= its own."""
    tokens = blocks.shape[0]
    keys = blocks.long()[:, :, None] * ratio + torch.arange(ratio, device=blocks.device)  # [T, NB, ratio]
    positions = first + torch.arange(tokens, device=blocks.device)
    valid = (blocks[:, :, None] >= 0) & (keys <= positions[:, None, None])
    mask = torch.zeros(tokens, length + 1, dtype=torch.bool, device=blocks.device)  # column `length`: the discards
    mask.scatter_(1, torch.where(valid, keys, length).flatten(1), True)
    return mask[:, :length]


def prompt_attention_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: torch.Tensor, first: int, ratio: int,
    scale: float, dtype: torch.dtype | None = torch.float32,
) -> torch.Tensor:
    """prompt_attention.py's kernel as masked F.scaled_dot_product_attention: q [T, heads, hd] against
    keys/values [kv_heads, L, hd] (L >= first + T) masked by `prompt_keep_mask`, computed in `dtype`
    (None: the inputs' own) -> [T, heads, hd]."""
    out_dtype, tokens, heads = q.dtype, q.shape[0], q.shape[1]
    if dtype is not None:
        q, keys, values = q.to(dtype), keys.to(dtype), values.to(dtype)
    length = first + tokens
    mask = prompt_keep_mask(blocks, first, ratio, length)
    with sdpa_kernel(ATTENTION_BACKENDS):
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys[None, :, :length], values[None, :, :length], attn_mask=mask[None, None],
            scale=scale, enable_gqa=heads != keys.shape[0],
        )[0]  # [heads, T, hd]
    return out.transpose(0, 1).to(out_dtype)
