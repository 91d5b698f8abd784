"""The text model's configuration, read from a checkpoint's config.json or a pack manifest.

One validated dataclass every layer shares, so nothing downstream reads raw JSON. It covers the
fields the text model, its PLE and its MTP head need; `raw` keeps the full text config for the
transformers reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from flashpack.errors import FlashpackError

SUPPORTED_MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")
LINEAR_ATTENTION = "linear_attention"
INDEXED_ATTENTION = "indexed_attention"


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    hc_count: int
    hc_lowrank: int
    ple_layer_ids: tuple[int, ...]
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    ngram_seed: int
    split_ngram_parts: int
    indexer_n_heads: int
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...]
    max_position_embeddings: int
    eos_token_id: int
    hidden_act: str
    output_gate_type: str
    tie_word_embeddings: bool
    mtp_num_hidden_layers: int
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def ngram_heads(self) -> int:
        """Hash heads per PLE layer: (ngram_size - 1) orders x heads_per_ngram."""
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_head_dim(self) -> int:
        return self.ple_embed_dim // self.ngram_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_key_head_dim * self.linear_num_key_heads

    @property
    def linear_value_dim(self) -> int:
        return self.linear_value_head_dim * self.linear_num_value_heads

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == LINEAR_ATTENTION

    def ple_index(self, layer: int) -> int | None:
        """Index among PLE layers of zero-based decoder `layer`, or None when it has no PLE."""
        one_indexed = layer + 1
        return self.ple_layer_ids.index(one_indexed) if one_indexed in self.ple_layer_ids else None

    def ple_head_vocab_sizes(self, ple_index: int) -> list[int]:
        """Prime row counts of each hash head, as transformers derives them."""
        sizes = []
        for head in range(self.ngram_heads):
            global_head = ple_index * self.ngram_heads + head
            sizes.append(_nth_prime_after(self.ngram_vocab_size_base - 1, global_head + 1))
        return sizes

    def ple_multipliers(self, ple_index: int) -> list[int]:
        """Odd per-position hash multipliers (splitmix64 of the seed), as transformers derives them."""
        half_bound = max(1, ((1 << 63) - 1) // max(self.vocab_size, 1) // 2)
        base_seed = self.ngram_seed + _PLE_LAYER_PRIME * ple_index
        return [
            2 * (_splitmix64((base_seed + _SPLITMIX_GAMMA * (position + 1)) & _MASK64) % half_bound) + 1
            for position in range(self.ngram_size)
        ]

    def ple_head_offsets(self, ple_index: int) -> list[int]:
        offsets, total = [], 0
        for size in self.ple_head_vocab_sizes(ple_index):
            offsets.append(total)
            total += size
        return offsets

    def ple_table_rows(self, ple_index: int) -> int:
        """Rows of one PLE layer's table: sum of head vocabularies, padded to the divisor."""
        total = sum(self.ple_head_vocab_sizes(ple_index))
        divisor = self.make_ngram_vocab_size_divisible_by
        return math.ceil(total / divisor) * divisor

    @classmethod
    def from_checkpoint_config(cls, config: dict[str, Any]) -> "TextConfig":
        """Parse config.json of either model_type (`qwen4_exp` nests the text part)."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise FlashpackError(
                f"unsupported model_type {model_type!r}: flashpack reads {' or '.join(SUPPORTED_MODEL_TYPES)}"
            )
        text = dict(config["text_config"]) if model_type == "qwen4_exp" else dict(config)
        text.setdefault("model_type", "qwen4_exp_text")
        return cls.from_text_dict(text)

    @classmethod
    def from_text_dict(cls, text: dict[str, Any]) -> "TextConfig":
        try:
            return cls._from_text_dict(text)
        except KeyError as missing:
            raise FlashpackError(f"config.json lacks required text-config field {missing}") from None

    @classmethod
    def _from_text_dict(cls, text: dict[str, Any]) -> "TextConfig":
        layers = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types") or [
            LINEAR_ATTENTION if (i + 1) % text.get("full_attention_interval", 4) else INDEXED_ATTENTION
            for i in range(layers)
        ]
        layer_types = tuple(INDEXED_ATTENTION if t == "full_attention" else t for t in layer_types)
        if len(layer_types) != layers:
            raise FlashpackError(f"config.json lists {len(layer_types)} layer_types for {layers} layers")
        rope = text.get("rope_parameters") or {}
        eos = text.get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) else eos
        hidden = int(text["hidden_size"])
        hidden_act = text.get("hidden_act", "silu")
        cfg = cls(
            vocab_size=int(text["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=layers,
            layer_types=layer_types,
            num_attention_heads=int(text["num_attention_heads"]),
            num_key_value_heads=int(text["num_key_value_heads"]),
            head_dim=int(text.get("head_dim") or hidden // int(text["num_attention_heads"])),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            moe_intermediate_size=int(text["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(text["shared_expert_intermediate_size"]),
            num_experts=int(text["num_experts"]),
            num_experts_per_tok=int(text["num_experts_per_tok"]),
            norm_topk_prob=bool(text.get("norm_topk_prob", True)),
            hc_count=int(text.get("hc_count", 4)),
            hc_lowrank=int(text["hc_lowrank"]),
            ple_layer_ids=tuple(sorted(set(text.get("ple_layer_ids") or []))),
            ple_embed_dim=int(text.get("ple_embed_dim") or hidden),
            ple_conv_kernel_size=int(text.get("ple_conv_kernel_size", 4)),
            ngram_size=int(text.get("ngram_size", 3)),
            heads_per_ngram=int(text.get("heads_per_ngram", 8)),
            ngram_vocab_size_base=int(text.get("ngram_vocab_size_base", 20_000_000)),
            make_ngram_vocab_size_divisible_by=int(text.get("make_ngram_vocab_size_divisible_by", 128)),
            ngram_seed=int(text.get("seed", 1234)),
            split_ngram_parts=int(text.get("split_ngram_parts", 512)),
            indexer_n_heads=int(text["indexer_n_heads"]),
            indexer_head_dim=int(text["indexer_head_dim"]),
            indexer_budget=int(text["indexer_budget"]),
            indexer_compress_ratio=int(text["indexer_compress_ratio"]),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10_000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
            mrope_section=tuple(rope.get("mrope_section", [11, 11, 10])),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            eos_token_id=int(eos) if eos is not None else -1,
            hidden_act=hidden_act,
            output_gate_type=text.get("output_gate_type") or hidden_act,
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 1)),
            raw=dict(text),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        problems = []
        if self.hc_count < 2:
            problems.append(f"hc_count must be > 1, got {self.hc_count}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            problems.append(f"num_experts_per_tok {self.num_experts_per_tok} not in [1, {self.num_experts}]")
        if self.hidden_size % 16 or self.moe_intermediate_size % 16:
            problems.append("hidden_size and moe_intermediate_size must be multiples of 16 (NVFP4 blocks)")
        if self.ple_layer_ids and self.ple_embed_dim % self.ngram_heads:
            problems.append(f"ple_embed_dim {self.ple_embed_dim} not divisible by {self.ngram_heads} n-gram heads")
        if self.ple_layer_ids and self.eos_token_id < 0:
            problems.append("eos_token_id must be set when PLE layers are enabled")
        if self.indexer_budget % self.indexer_compress_ratio:
            problems.append("indexer_budget must be divisible by indexer_compress_ratio")
        for layer_id in self.ple_layer_ids:
            if not 1 <= layer_id <= self.num_hidden_layers or not self.is_linear(layer_id - 1):
                problems.append(f"ple layer {layer_id} must be a one-indexed linear_attention layer")
        bad_types = set(self.layer_types) - {LINEAR_ATTENTION, INDEXED_ATTENTION}
        if bad_types:
            problems.append(f"unsupported layer types {sorted(bad_types)}")
        if problems:
            raise FlashpackError("invalid model config: " + "; ".join(problems))


_MASK64 = (1 << 64) - 1
_SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_PLE_LAYER_PRIME = 10007


def _splitmix64(value: int) -> int:
    value = (value + _SPLITMIX_GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def _is_prime(value: int) -> bool:
    if value < 2:
        return False
    if value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def _nth_prime_after(start: int, count: int) -> int:
    prime = start
    for _ in range(count):
        prime += 1
        while not _is_prime(prime):
            prime += 1
    return prime
