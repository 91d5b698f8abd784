"""The text model's configuration, read from a checkpoint's config.json or a pack manifest.

One validated dataclass every layer shares, so nothing downstream reads raw JSON. It covers the
fields the text model, its PLE and its MTP head need; `raw` keeps the full text config for the
transformers reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from flashpack.errors import FlashpackError
from flashpack.layout.config_fields import MAX_PLE_HEADS, ConfigFields

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
        """Prime row counts of each hash head, as transformers derives them: global head g (heads
        numbered across PLE layers) has the (g + 1)-th prime from ngram_vocab_size_base on."""
        if not 0 <= ple_index < len(self.ple_layer_ids):
            raise IndexError(f"PLE index {ple_index} outside the {len(self.ple_layer_ids)} PLE layers")
        first = ple_index * self.ngram_heads
        return list(self._ple_head_primes[first:first + self.ngram_heads])

    @cached_property
    def _ple_head_primes(self) -> tuple[int, ...]:
        """Every PLE layer's head vocabularies in global head order, found in one scan: every tensor
        spec of every PLE layer asks for them, and a scan from the base for each head would repeat
        all the heads before it (minutes for a few dozen PLE layers)."""
        primes, prime = [], self.ngram_vocab_size_base - 1
        for _ in range(len(self.ple_layer_ids) * self.ngram_heads):
            prime = _nth_prime_after(prime, 1)
            primes.append(prime)
        return tuple(primes)

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
        if not isinstance(config, dict):
            raise FlashpackError(f"config.json must be a JSON object, got {type(config).__name__}")
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise FlashpackError(
                f"unsupported model_type {model_type!r}: flashpack reads {' or '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == "qwen4_exp" and not isinstance(config.get("text_config"), dict):
            raise FlashpackError(
                "config.json of model_type qwen4_exp needs a text_config object (the text model's config), "
                f"got {config.get('text_config')!r}"
            )
        text = dict(config["text_config"]) if model_type == "qwen4_exp" else dict(config)
        text.setdefault("model_type", "qwen4_exp_text")
        return cls.from_text_dict(text, "config.json text_config" if model_type == "qwen4_exp" else "config.json")

    @classmethod
    def from_text_dict(cls, text: dict[str, Any], where: str = "text config") -> "TextConfig":
        """Parse and validate a text config; `where` names it in the one-line error a bad field gets."""
        fields = ConfigFields(text, where)
        layers = fields.integer("num_hidden_layers")
        if text.get("layer_types"):
            layer_types = fields.string_list("layer_types")
        else:
            interval = fields.integer("full_attention_interval", 4)
            layer_types = [LINEAR_ATTENTION if (i + 1) % interval else INDEXED_ATTENTION for i in range(layers)]
        layer_types = tuple(INDEXED_ATTENTION if t == "full_attention" else t for t in layer_types)
        if len(layer_types) != layers:
            raise FlashpackError(f"{where} lists {len(layer_types)} layer_types for {layers} layers")
        rope = fields.section("rope_parameters")
        eos = -1 if text.get("eos_token_id") is None else fields.int_or_first("eos_token_id")
        hidden = fields.integer("hidden_size")
        attention_heads = fields.integer("num_attention_heads")
        hidden_act = fields.string("hidden_act", "silu")
        cfg = cls(
            vocab_size=fields.integer("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=layers,
            layer_types=layer_types,
            num_attention_heads=attention_heads,
            num_key_value_heads=fields.integer("num_key_value_heads"),
            head_dim=fields.integer("head_dim", max(1, hidden // attention_heads)),
            linear_conv_kernel_dim=fields.integer("linear_conv_kernel_dim", 4),
            linear_key_head_dim=fields.integer("linear_key_head_dim"),
            linear_value_head_dim=fields.integer("linear_value_head_dim"),
            linear_num_key_heads=fields.integer("linear_num_key_heads"),
            linear_num_value_heads=fields.integer("linear_num_value_heads"),
            moe_intermediate_size=fields.integer("moe_intermediate_size"),
            shared_expert_intermediate_size=fields.integer("shared_expert_intermediate_size"),
            num_experts=fields.integer("num_experts"),
            num_experts_per_tok=fields.integer("num_experts_per_tok"),
            norm_topk_prob=fields.boolean("norm_topk_prob", True),
            hc_count=fields.integer("hc_count", 4),
            hc_lowrank=fields.integer("hc_lowrank"),
            ple_layer_ids=tuple(sorted(set(fields.integer_list("ple_layer_ids", [])))),
            ple_embed_dim=fields.integer("ple_embed_dim", hidden),
            ple_conv_kernel_size=fields.integer("ple_conv_kernel_size", 4),
            ngram_size=fields.integer("ngram_size", 3),
            heads_per_ngram=fields.integer("heads_per_ngram", 8),
            ngram_vocab_size_base=fields.integer("ngram_vocab_size_base", 20_000_000),
            make_ngram_vocab_size_divisible_by=fields.integer("make_ngram_vocab_size_divisible_by", 128),
            ngram_seed=fields.integer("seed", 1234),
            split_ngram_parts=fields.integer("split_ngram_parts", 512),
            indexer_n_heads=fields.integer("indexer_n_heads"),
            indexer_head_dim=fields.integer("indexer_head_dim"),
            indexer_budget=fields.integer("indexer_budget"),
            indexer_compress_ratio=fields.integer("indexer_compress_ratio"),
            rms_norm_eps=fields.number("rms_norm_eps", 1e-6, high=1.0),
            rope_theta=rope.number("rope_theta", fields.number("rope_theta", 10_000.0)),
            partial_rotary_factor=rope.number("partial_rotary_factor", 1.0, high=1.0),
            mrope_section=rope.integer_list("mrope_section", [11, 11, 10]),
            max_position_embeddings=fields.integer("max_position_embeddings", 32768),
            eos_token_id=eos,
            hidden_act=hidden_act,
            output_gate_type=fields.string("output_gate_type", hidden_act),
            tie_word_embeddings=fields.boolean("tie_word_embeddings", False),
            mtp_num_hidden_layers=fields.integer("mtp_num_hidden_layers", 1),
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
        if len(self.ple_layer_ids) * self.ngram_heads > MAX_PLE_HEADS:
            problems.append(
                f"{len(self.ple_layer_ids)} PLE layers x {self.ngram_heads} n-gram heads exceed {MAX_PLE_HEADS} hash heads"
            )
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
