"""Typed reads of a text config's fields: a wrong type or an absurd size is one line naming the field.

config.json is user input. `"hidden_size": "abc"`, `true` where a count belongs, `"eos_token_id": []`
or `"ngram_vocab_size_base": 1e15` would otherwise surface as a traceback deep inside a convert, or
as a prime search that runs for minutes. The ranges below sit far above the real model (48 layers,
512 experts, hidden 2560, vocabulary 248k, ngram_vocab_size_base 20M, 16 n-gram heads) so that no
real config meets them, while everything derived from a config inside them (tensor specs, the PLE
prime search) stays a matter of seconds.
"""

from __future__ import annotations

from typing import Any

from flashpack.errors import FlashpackError

_MISSING = object()

# (lowest, highest) accepted value of each integer field.
INT_RANGES: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 24),
    "hidden_size": (16, 1 << 16),
    "num_hidden_layers": (1, 1024),
    "full_attention_interval": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096),
    "linear_conv_kernel_dim": (1, 64),
    "linear_key_head_dim": (1, 4096),
    "linear_value_head_dim": (1, 4096),
    "linear_num_key_heads": (1, 1024),
    "linear_num_value_heads": (1, 1024),
    "moe_intermediate_size": (16, 1 << 17),
    "shared_expert_intermediate_size": (1, 1 << 17),
    "num_experts": (1, 1 << 14),
    "num_experts_per_tok": (1, 1 << 14),
    "hc_count": (2, 64),
    "hc_lowrank": (1, 1 << 16),
    "ple_embed_dim": (1, 1 << 16),
    "ple_conv_kernel_size": (1, 64),
    "ngram_size": (2, 8),
    "heads_per_ngram": (1, 64),
    "ngram_vocab_size_base": (2, 1 << 28),
    "make_ngram_vocab_size_divisible_by": (1, 1 << 20),
    "seed": (0, (1 << 64) - 1),
    "split_ngram_parts": (1, 1 << 12),
    "indexer_n_heads": (1, 1024),
    "indexer_head_dim": (1, 4096),
    "indexer_budget": (1, 1 << 24),
    "indexer_compress_ratio": (1, 1 << 16),
    "max_position_embeddings": (1, 1 << 24),
    "mtp_num_hidden_layers": (0, 64),
    "eos_token_id": (0, 1 << 24),
    "ple_layer_ids": (1, 1024),
    "mrope_section": (0, 4096),
}
# PLE layers x n-gram heads: how many primes the PLE vocabularies need (the real model: 16).
MAX_PLE_HEADS = 4096


class ConfigFields:
    """Reads fields of one config mapping; `where` names it in messages (e.g. "config.json")."""

    def __init__(self, mapping: Any, where: str):
        if not isinstance(mapping, dict):
            raise FlashpackError(f"{where} must be a JSON object, got {_kind(mapping)}")
        self.mapping = mapping
        self.where = where

    def _get(self, name: str, default: Any) -> Any:
        value = self.mapping.get(name)
        if value is None:  # transformers writes null for "use the default"
            if default is _MISSING:
                raise FlashpackError(f"{self.where} lacks required field '{name}'")
            return default
        return value

    def integer(self, name: str, default: Any = _MISSING) -> int:
        value = self._get(name, default)
        return self._checked_int(name, value)

    def _checked_int(self, name: str, value: Any, label: str | None = None) -> int:
        label = label or name
        if isinstance(value, bool) or not isinstance(value, int):
            raise FlashpackError(f"{self.where}: {label} must be an integer, got {value!r}")
        low, high = INT_RANGES[name]
        if not low <= value <= high:
            raise FlashpackError(f"{self.where}: {label} must be between {low} and {high}, got {value}")
        return value

    def integer_list(self, name: str, default: Any = _MISSING, allow_empty: bool = True) -> tuple[int, ...]:
        value = self._get(name, default)
        if not isinstance(value, list | tuple):
            raise FlashpackError(f"{self.where}: {name} must be a list of integers, got {value!r}")
        if not value and not allow_empty:
            raise FlashpackError(f"{self.where}: {name} must not be an empty list")
        return tuple(self._checked_int(name, item, f"{name}[{i}]") for i, item in enumerate(value))

    def int_or_first(self, name: str, default: Any = _MISSING) -> int:
        """An integer, or the first of a non-empty list of them (eos_token_id may be either)."""
        value = self._get(name, default)
        if isinstance(value, list):
            return self.integer_list(name, allow_empty=False)[0]
        return self._checked_int(name, value)

    def number(self, name: str, default: Any = _MISSING, low: float = 0.0, high: float = float("inf")) -> float:
        value = self._get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise FlashpackError(f"{self.where}: {name} must be a number, got {value!r}")
        if not low <= value <= high:
            raise FlashpackError(f"{self.where}: {name} must be between {low} and {high}, got {value}")
        return float(value)

    def boolean(self, name: str, default: Any = _MISSING) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise FlashpackError(f"{self.where}: {name} must be true or false, got {value!r}")
        return value

    def string(self, name: str, default: Any = _MISSING) -> str:
        value = self._get(name, default)
        if not isinstance(value, str):
            raise FlashpackError(f"{self.where}: {name} must be a string, got {value!r}")
        return value

    def string_list(self, name: str, default: Any = _MISSING) -> tuple[str, ...]:
        value = self._get(name, default)
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise FlashpackError(f"{self.where}: {name} must be a list of strings, got {value!r}")
        return tuple(value)

    def section(self, name: str) -> "ConfigFields":
        """A nested object (e.g. rope_parameters); absent or null reads as an empty one."""
        value = self._get(name, {})
        if not isinstance(value, dict):
            raise FlashpackError(f"{self.where}: {name} must be an object, got {value!r}")
        return ConfigFields(value, f"{self.where} {name}")


def _kind(value: Any) -> str:
    names = {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
