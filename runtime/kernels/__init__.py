"""GPU kernels for the expert and dense-FP8 hot paths, each beside its plain-PyTorch reference.

    moe_experts(x [T, H], bank, slots [T, K], weights [T, K]) -> [T, H]   routed NVFP4 SwiGLU experts
    moe_expert_pairs(x, bank, slots, weights, y [T*K, H]) -> y             the same per (token, pick),
                                                                            pairs with slot -1 left as they are
    dense_linear(x [..., C], weight [R, C]) -> [..., R]                   F.linear; a matvec at one token
    fp8_linear(x [..., C], values fp8 [R, C], row_scale [R]) -> [..., R]   row-scaled FP8 linear
    stage_records(source, offsets [K], target [K, words])                  host records -> device rows
    router_top_k(logits [T, E], k, renormalise) -> (weights [T, k], ids)   softmax, top-k, renormalise
    decode_attention(q [Hkv, G, D], keys/values [Hkv, N, D], keep [N])      one token's masked attention
    prompt_attention(q [T, Hq, D], keys/values [Hkv, N, D], blocks [T, B])  a prompt's QSA attention over
                                                                            each query's picked key blocks

`ExpertBank.from_pool(pool, geometry)` views a device slot pool of records (uint8 [S, stride]) in
place. The dispatcher (dispatch.py) picks Triton on CUDA and the references in reference.py
elsewhere; the Triton modules (expert_decode, expert_grouped and its tile_plan, matvec, fp8_linear,
stage_records, router_top_k, decode_attention, prompt_attention) import triton and are loaded only
when used, so this package imports without it.
hc_mix.py (a hyper-connection mix in two kernels) is called by the module it replaces,
runtime/model/hyper_connection.py's GatedResidual, whose own code is its reference.
"""

from flashpack.runtime.kernels.bank import ExpertBank
from flashpack.runtime.kernels.dispatch import (
    decode_attention, dense_linear, fp8_linear, moe_expert_pairs, moe_experts, prompt_attention, router_top_k,
    stage_records, triton_available, use_triton,
)
from flashpack.runtime.kernels.reference import (
    decode_attention_reference, dequantize_expert, expert_pairs_reference, expert_swiglu_reference,
    fp8_linear_reference, prompt_attention_reference, prompt_keep_mask, router_top_k_reference,
    stage_records_reference,
)

__all__ = [
    "ExpertBank", "moe_experts", "moe_expert_pairs", "dense_linear", "fp8_linear", "decode_attention",
    "decode_attention_reference", "prompt_attention", "prompt_attention_reference", "prompt_keep_mask",
    "stage_records", "router_top_k", "triton_available", "use_triton", "dequantize_expert",
    "expert_swiglu_reference", "expert_pairs_reference", "fp8_linear_reference", "router_top_k_reference",
    "stage_records_reference",
]
