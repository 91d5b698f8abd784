"""Every tensor a qwen4_exp checkpoint holds, named and shaped from its config alone.

The single source of truth for checkpoint naming: `synth` writes exactly these tensors, `convert`
checks a real snapshot against them, and a test checks them against what transformers'
`save_pretrained` writes. Names here are canonical (the text-only form without its `model.`
prefix); `checkpoint_key` maps them to either on-disk form.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from flashpack.layout.model_config import TextConfig

Role = Literal["dense", "expert", "ple", "ple_buffer"]
Form = Literal["qwen4_exp", "qwen4_exp_text"]
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MTP_PREFIX = "mtp."


@dataclass(frozen=True)
class TensorSpec:
    name: str  # canonical name, e.g. "layers.3.mlp.experts.7.up_proj.weight"
    shape: tuple[int, ...]
    role: Role
    layer: int | None = None  # decoder layer; MTP layers count on from num_hidden_layers
    expert: int | None = None
    projection: str | None = None  # gate_proj / up_proj / down_proj for experts
    ple_index: int | None = None
    shard: int | None = None  # PLE table shard


def checkpoint_key(name: str, form: Form) -> str:
    """On-disk key of canonical `name` in a checkpoint of `form`."""
    if name.startswith(MTP_PREFIX) or name == "lm_head.weight":
        return name
    return ("model.language_model." if form == "qwen4_exp" else "model.") + name


def canonical_name(key: str) -> str | None:
    """Inverse of `checkpoint_key` for either form; None for keys outside the text model."""
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if key.startswith(prefix):
            rest = key[len(prefix):]
            return None if rest.startswith("visual.") else rest
    if key.startswith(MTP_PREFIX) or key == "lm_head.weight":
        return key
    return None


def is_vision_key(key: str) -> bool:
    return key.startswith(("model.visual.", "visual."))


def expert_shapes(cfg: TextConfig) -> dict[str, tuple[int, int]]:
    """[out, in] of each expert projection."""
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    return {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def mtp_layer_index(cfg: TextConfig, mtp_layer: int) -> int:
    return cfg.num_hidden_layers + mtp_layer


def iter_specs(cfg: TextConfig, with_mtp: bool = True) -> Iterator[TensorSpec]:
    """All text-model tensors in checkpoint order: embeddings, layers, mixer, lm_head, MTP."""
    yield TensorSpec("embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), "dense")
    for layer in range(cfg.num_hidden_layers):
        yield from _decoder_layer(cfg, f"layers.{layer}.", layer, cfg.is_linear(layer), cfg.ple_index(layer))
    yield from _hyper_connection(cfg, "hyper_connection_mixer.", inject=False)
    yield TensorSpec("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), "dense")
    if with_mtp:
        yield from _mtp(cfg)


def _mtp(cfg: TextConfig) -> Iterator[TensorSpec]:
    hidden, streams = cfg.hidden_size, cfg.hc_count * cfg.hidden_size
    yield TensorSpec("mtp.fc_embedding.weight", (hidden, hidden), "dense")
    yield TensorSpec("mtp.fc_hidden.weight", (hidden, hidden), "dense")
    yield TensorSpec("mtp.pre_fc_norm_embedding.weight", (hidden,), "dense")
    yield TensorSpec("mtp.pre_fc_norm_hidden.weight", (streams,), "dense")
    for mtp_layer in range(cfg.mtp_num_hidden_layers):
        layer = mtp_layer_index(cfg, mtp_layer)
        yield from _decoder_layer(cfg, f"mtp.layers.{mtp_layer}.", layer, linear=False, ple_index=None)
    yield from _hyper_connection(cfg, "mtp.hyper_connection_mixer.", inject=False)


def _decoder_layer(
    cfg: TextConfig, prefix: str, layer: int, linear: bool, ple_index: int | None
) -> Iterator[TensorSpec]:
    if ple_index is not None:
        yield from _ple(cfg, prefix + "ple.", layer, ple_index)
    yield from _hyper_connection(cfg, prefix + "attn_hyper_connection.", inject=True)
    yield from (_deltanet(cfg, prefix + "linear_attn.") if linear else _attention(cfg, prefix + "self_attn."))
    yield from _hyper_connection(cfg, prefix + "mlp_hyper_connection.", inject=True)
    yield from _moe(cfg, prefix + "mlp.", layer)


def _hyper_connection(cfg: TextConfig, prefix: str, inject: bool) -> Iterator[TensorSpec]:
    streams = cfg.hc_count * cfg.hidden_size
    yield TensorSpec(prefix + "hc_norm.weight", (streams,), "dense")
    yield TensorSpec(prefix + "input_mix_weight_down.weight", (cfg.hc_lowrank, streams), "dense")
    yield TensorSpec(prefix + "input_mix_weight_up.weight", (streams, cfg.hc_lowrank), "dense")
    if inject:
        yield TensorSpec(prefix + "block_inject_weight.weight", (cfg.hc_count, streams), "dense")


def _deltanet(cfg: TextConfig, prefix: str) -> Iterator[TensorSpec]:
    hidden, heads = cfg.hidden_size, cfg.linear_num_value_heads
    conv_dim = 2 * cfg.linear_key_dim + cfg.linear_value_dim
    yield TensorSpec(prefix + "A_log", (heads,), "dense")
    yield TensorSpec(prefix + "conv1d.weight", (conv_dim, 1, cfg.linear_conv_kernel_dim), "dense")
    yield TensorSpec(prefix + "dt_bias", (heads,), "dense")
    yield TensorSpec(prefix + "in_proj_a.weight", (heads, hidden), "dense")
    yield TensorSpec(prefix + "in_proj_b.weight", (heads, hidden), "dense")
    yield TensorSpec(prefix + "in_proj_qkv.weight", (conv_dim, hidden), "dense")
    yield TensorSpec(prefix + "in_proj_z.weight", (cfg.linear_value_dim, hidden), "dense")
    yield TensorSpec(prefix + "norm.weight", (cfg.linear_value_head_dim,), "dense")
    yield TensorSpec(prefix + "out_proj.weight", (hidden, cfg.linear_value_dim), "dense")


def _attention(cfg: TextConfig, prefix: str) -> Iterator[TensorSpec]:
    hidden, head_dim = cfg.hidden_size, cfg.head_dim
    index_rows = (cfg.indexer_n_heads + 1) * cfg.indexer_head_dim
    yield TensorSpec(prefix + "indexer.index_qk_proj.weight", (index_rows, hidden), "dense")
    yield TensorSpec(prefix + "indexer.k_layernorm.weight", (cfg.indexer_head_dim,), "dense")
    yield TensorSpec(prefix + "indexer.q_layernorm.weight", (cfg.indexer_head_dim,), "dense")
    yield TensorSpec(prefix + "k_norm.weight", (head_dim,), "dense")
    yield TensorSpec(prefix + "k_proj.weight", (cfg.num_key_value_heads * head_dim, hidden), "dense")
    yield TensorSpec(prefix + "o_proj.weight", (hidden, cfg.num_attention_heads * head_dim), "dense")
    yield TensorSpec(prefix + "q_norm.weight", (head_dim,), "dense")
    yield TensorSpec(prefix + "q_proj.weight", (2 * cfg.num_attention_heads * head_dim, hidden), "dense")
    yield TensorSpec(prefix + "v_proj.weight", (cfg.num_key_value_heads * head_dim, hidden), "dense")


def _moe(cfg: TextConfig, prefix: str, layer: int) -> Iterator[TensorSpec]:
    hidden, shared = cfg.hidden_size, cfg.shared_expert_intermediate_size
    for expert in range(cfg.num_experts):
        for projection, shape in expert_shapes(cfg).items():
            yield TensorSpec(
                f"{prefix}experts.{expert}.{projection}.weight", shape, "expert",
                layer=layer, expert=expert, projection=projection,
            )
    yield TensorSpec(prefix + "gate.weight", (cfg.num_experts, hidden), "dense")
    yield TensorSpec(prefix + "shared_expert.down_proj.weight", (hidden, shared), "dense")
    yield TensorSpec(prefix + "shared_expert.gate_proj.weight", (shared, hidden), "dense")
    yield TensorSpec(prefix + "shared_expert.up_proj.weight", (shared, hidden), "dense")
    yield TensorSpec(prefix + "shared_expert_gate.weight", (1, hidden), "dense")


def _ple(cfg: TextConfig, prefix: str, layer: int, ple_index: int) -> Iterator[TensorSpec]:
    hidden, streams, embed = cfg.hidden_size, cfg.hc_count * cfg.hidden_size, cfg.ple_embed_dim
    yield TensorSpec(prefix + "conv1d.weight", (streams, 1, cfg.ple_conv_kernel_size), "dense")
    yield TensorSpec(prefix + "key_proj.weight", (streams, embed), "dense")
    yield TensorSpec(prefix + "norm_conv.weight", (streams,), "dense")
    yield TensorSpec(prefix + "norm_key.weight", (streams,), "dense")
    yield TensorSpec(prefix + "norm_query.weight", (streams,), "dense")
    table = prefix + "ple_embedding."
    yield TensorSpec(table + "layer_multipliers", (cfg.ngram_size,), "ple_buffer", layer=layer, ple_index=ple_index)
    rows, parts = cfg.ple_table_rows(ple_index), cfg.split_ngram_parts
    for shard in range(parts):
        if ple_shard_rows(rows, parts, shard) == 0:
            continue  # torch.chunk yields fewer pieces when the rows run out early
        yield TensorSpec(
            f"{table}ngram_embedding.shard_{shard}.weight", (ple_shard_rows(rows, parts, shard), cfg.ple_head_dim),
            "ple", layer=layer, ple_index=ple_index, shard=shard,
        )
    yield TensorSpec(table + "ngram_heads_offsets", (cfg.ngram_heads,), "ple_buffer", layer=layer, ple_index=ple_index)
    yield TensorSpec(table + "ngram_heads_vocab_sizes", (cfg.ngram_heads,), "ple_buffer", layer=layer, ple_index=ple_index)
    yield TensorSpec(prefix + "value_proj.weight", (hidden, embed), "dense")


def ple_shard_rows(rows: int, parts: int, shard: int) -> int:
    """Rows in one PLE shard, as `torch.chunk(table, parts)` splits it (the last may be short)."""
    per_shard = -(-rows // parts)
    return max(0, min(per_shard, rows - shard * per_shard))
