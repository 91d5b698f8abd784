"""The demo model's dimensions, in the real checkpoint's config keys, and what they cost on disk.

Two sizes: `demo` (the committed model, every qwen4_exp feature on at a size whose BF16 snapshot
stays under 32 MB) and `smoke` (the CPU test's, seconds a step). Both keep the real model's shape:
DeltaNet and QSA layers 3:1, four hyper-connection streams, PLE on layer 1 (one-indexed) with small
n-gram tables, 32 routed experts top-4 plus a shared expert, one MTP layer, and a QSA indexer budget
below the training length so the indexer's selection is live during training.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import Qwen4ExpTextConfig

from flashpack.layout.checkpoint_spec import iter_specs
from flashpack.convert.synth.presets import vision_config as synth_vision_config
from flashpack.convert.synth.special_tokens import TokenIds, token_ids
from flashpack.convert.synth.vision import iter_vision_tensors
from flashpack.errors import FlashpackError
from flashpack.layout.model_config import TextConfig

# Reserved specials after Qwen's block, as synth places them when a preset does not.
SPECIAL_TAIL = 32
_INTERVAL = 4  # every fourth layer is QSA

_COMMON: dict[str, Any] = {
    "num_hidden_layers": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "linear_conv_kernel_dim": 4,
    "norm_topk_prob": True,
    "hc_count": 4,
    "ple_layer_ids": [1],
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "make_ngram_vocab_size_divisible_by": 128,
    "seed": 1234,
    "indexer_kv_heads": 1,
    "mtp_num_hidden_layers": 1,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "router_aux_loss_coef": 0.01,
}

SIZES: dict[str, dict[str, Any]] = {
    "demo": {
        "vocab_size": 6144,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [6, 5, 5], "mrope_interleaved": True},
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "hc_lowrank": 16,
        "ple_embed_dim": 256,
        "ngram_vocab_size_base": 2000,
        "split_ngram_parts": 4,
        "indexer_n_heads": 4,
        "indexer_head_dim": 32,
        "indexer_budget": 256,
        "indexer_compress_ratio": 4,
    },
    "smoke": {
        "vocab_size": 1024,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "hc_lowrank": 16,
        "ple_embed_dim": 64,
        "ngram_vocab_size_base": 500,
        "split_ngram_parts": 4,
        "indexer_n_heads": 2,
        "indexer_head_dim": 16,
        "indexer_budget": 16,
        "indexer_compress_ratio": 4,
    },
}

def special_tokens(size: str) -> TokenIds:
    return token_ids(_size(size)["vocab_size"], None, SPECIAL_TAIL)


def text_config_dict(size: str) -> dict[str, Any]:
    """The text config as config.json stores it (QSA layers spelled "full_attention", as the real
    checkpoints spell them)."""
    text = dict(_COMMON, **_size(size))
    layers = text["num_hidden_layers"]
    text["layer_types"] = [
        "full_attention" if (i + 1) % _INTERVAL == 0 else "linear_attention" for i in range(layers)
    ]
    text["full_attention_interval"] = _INTERVAL
    tokens = special_tokens(size)
    text.update(model_type="qwen4_exp_text", dtype="bfloat16", eos_token_id=tokens.endoftext,
                pad_token_id=tokens.endoftext, bos_token_id=None)
    TextConfig.from_text_dict(text)  # flashpack's own checks (NVFP4 block multiples, PLE layer, ...)
    return text


def vision_config(size: str) -> dict[str, Any]:
    return synth_vision_config({}, out_hidden_size=_size(size)["hidden_size"])  # synth's small random tower


def transformers_config(size: str) -> Qwen4ExpTextConfig:
    text = dict(text_config_dict(size))
    text.pop("full_attention_interval")
    text.pop("mtp_num_hidden_layers")  # the MTP head is ours (transformers has none)
    return Qwen4ExpTextConfig(**text)


def byte_counts(size: str) -> dict[str, int]:
    """BF16 bytes of the snapshot's tensors by part (PLE buffers int64), counted from the config."""
    cfg = TextConfig.from_text_dict(text_config_dict(size))
    counts: dict[str, int] = {}
    for spec in iter_specs(cfg, with_mtp=True):
        part = _part(spec.name, spec.role)
        counts[part] = counts.get(part, 0) + math.prod(spec.shape) * (8 if spec.role == "ple_buffer" else 2)
    counts["vision"] = sum(math.prod(t.shape) * 2 for t in iter_vision_tensors(vision_config(size)))
    counts["total"] = sum(counts.values())
    return counts


def parameter_counts(size: str) -> dict[str, int]:
    """Parameters of the text model: total, routed experts, and active per token (top-k experts)."""
    cfg = TextConfig.from_text_dict(text_config_dict(size))
    total = experts = 0
    for spec in iter_specs(cfg, with_mtp=True):
        if spec.role == "ple_buffer":
            continue
        total += math.prod(spec.shape)
        experts += math.prod(spec.shape) if spec.role == "expert" else 0
    active_experts = experts * cfg.num_experts_per_tok // cfg.num_experts
    return {"total": total, "routed_experts": experts, "active_per_token": total - experts + active_experts}


def _part(name: str, role: str) -> str:
    if name.startswith("mtp."):
        return "mtp_experts" if role == "expert" else "mtp_dense"
    if role in ("expert", "ple"):
        return {"expert": "experts", "ple": "ple_rows"}[role]
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return "embed_and_lm_head"
    return "dense"


def _size(size: str) -> dict[str, Any]:
    if size not in SIZES:
        raise FlashpackError(f"unknown model size {size!r}: choose one of {', '.join(SIZES)}")
    return SIZES[size]
