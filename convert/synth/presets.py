"""Synthetic-model presets: JSON files in `flashpack/manifests/presets/`, resolved against the options.

A preset holds a text config in the real checkpoint's key names, a small vision config and a few
synth defaults. `resolve_plan` applies the user's cuts (layers, experts, PLE rows) and returns the
one `SynthPlan` every writer reads, so no writer looks at raw options or JSON again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from flashpack.convert.synth.special_tokens import TokenIds, token_ids
from flashpack.errors import FlashpackError
from flashpack.layout.model_config import TextConfig

FORMATS = ("bf16", "nvfp4")
# Real configs spell QSA layers "full_attention"; transformers renames them on load.
_LINEAR, _ATTENTION = "linear_attention", "full_attention"
# Reserved specials after the Qwen block when a preset does not place it itself.
_DEFAULT_SPECIAL_TAIL = 32


@dataclass(frozen=True)
class SynthOptions:
    """What the user asked for; None means "the preset's default"."""

    preset: str
    format: str = "bf16"
    seed: int = 0
    layers: int | None = None
    experts: int | None = None
    router_skew: float | None = None
    text_only: bool = False
    ple_rows_per_head: int | None = None
    shard_mb: float | None = None
    fast_experts: bool = False  # NVFP4 experts drawn from quantised blocks (fast_experts.py), not sampled


@dataclass(frozen=True)
class SynthPlan:
    """Everything a snapshot is made from, validated."""

    options: SynthOptions
    description: str
    text_config: dict[str, Any]  # as config.json stores it (layer_types say "full_attention")
    vision_config: dict[str, Any] | None  # None in the text-only form
    cfg: TextConfig
    tokens: TokenIds
    router_skew: float
    shard_bytes: int
    nominal_layers: int  # the preset's depth before any cut: init scales depend on it, not on the cut
    ple_shrunk: bool

    @property
    def form(self) -> str:
        return "qwen4_exp_text" if self.options.text_only else "qwen4_exp"


def available_presets() -> list[str]:
    folder = resources.files("flashpack.manifests") / "presets"
    return sorted(entry.name[: -len(".json")] for entry in folder.iterdir() if entry.name.endswith(".json"))


def load_preset(name: str) -> dict[str, Any]:
    if name not in available_presets():
        raise FlashpackError(f"unknown preset {name!r}: choose one of {', '.join(available_presets())}")
    text = (resources.files("flashpack.manifests") / "presets" / f"{name}.json").read_text()
    return json.loads(text)


def resolve_plan(options: SynthOptions) -> SynthPlan:
    preset = load_preset(options.preset)
    if options.format not in FORMATS:
        raise FlashpackError(f"unknown format {options.format!r}: choose one of {', '.join(FORMATS)}")
    if options.fast_experts and options.format != "nvfp4":
        raise FlashpackError("fast experts are drawn NVFP4 blocks: they need format nvfp4")
    text = dict(preset["text_config"])
    nominal_layers = int(text["num_hidden_layers"])
    _cut_layers(text, options.layers, nominal_layers)
    _cut_experts(text, options.experts)
    ple_shrunk = _shrink_ple(text, options.ple_rows_per_head)

    tokens = token_ids(text["vocab_size"], preset.get("tokens", {}).get("special_token_base"), _DEFAULT_SPECIAL_TAIL)
    text.update(eos_token_id=tokens.endoftext, model_type="qwen4_exp_text", dtype="bfloat16")
    text.setdefault("initializer_range", 0.02)
    cfg = TextConfig.from_text_dict(text)  # raises FlashpackError on an inconsistent cut

    synth_defaults = preset.get("synth", {})
    skew = float(synth_defaults.get("router_skew", 0.0) if options.router_skew is None else options.router_skew)
    if skew < 0:
        raise FlashpackError(f"router skew must be >= 0, got {skew}")
    shard_mb = float(synth_defaults.get("shard_mb", 4000) if options.shard_mb is None else options.shard_mb)
    if shard_mb <= 0:
        raise FlashpackError(f"shard size must be positive, got {shard_mb} MB")

    vision = None
    if not options.text_only:
        vision = vision_config(preset.get("vision_config", {}), out_hidden_size=cfg.hidden_size)
    return SynthPlan(
        options=options,
        description=preset.get("description", ""),
        text_config=text,
        vision_config=vision,
        cfg=cfg,
        tokens=tokens,
        router_skew=skew,
        shard_bytes=int(shard_mb * 1_000_000),
        nominal_layers=nominal_layers,
        ple_shrunk=ple_shrunk,
    )


def _cut_layers(text: dict[str, Any], layers: int | None, nominal: int) -> None:
    interval = int(text.pop("full_attention_interval", 4))
    count = nominal if layers is None else layers
    if not 1 <= count <= nominal:
        raise FlashpackError(f"--layers must be between 1 and {nominal}, got {count}")
    # The pattern is anchored at layer 0, so a cut keeps it (and PLE on layer 1) intact.
    text["num_hidden_layers"] = count
    text["layer_types"] = [_ATTENTION if (i + 1) % interval == 0 else _LINEAR for i in range(count)]
    text["full_attention_interval"] = interval
    text["ple_layer_ids"] = [i for i in text.get("ple_layer_ids", []) if i <= count]


def _cut_experts(text: dict[str, Any], experts: int | None) -> None:
    if experts is None:
        return
    top_k = int(text["num_experts_per_tok"])
    if not top_k <= experts <= int(text["num_experts"]):
        raise FlashpackError(f"--experts must be between {top_k} (top-k) and {text['num_experts']}, got {experts}")
    text["num_experts"] = experts


def _shrink_ple(text: dict[str, Any], rows_per_head: int | None) -> bool:
    """Lower ngram_vocab_size_base so each hash head has about `rows_per_head` rows.

    Tokens still read one row per head, so the access pattern (16 rows a token) is the real one;
    only the table, and with it the disk footprint, shrinks.
    """
    if rows_per_head is None:
        return False
    if not text.get("ple_layer_ids"):
        raise FlashpackError("--ple-rows-per-head needs a preset with PLE layers")
    if not 2 <= rows_per_head <= int(text["ngram_vocab_size_base"]):
        raise FlashpackError(
            f"--ple-rows-per-head must be between 2 and {text['ngram_vocab_size_base']}, got {rows_per_head}"
        )
    text["ngram_vocab_size_base"] = rows_per_head
    return True


def vision_config(preset_vision: dict[str, Any], out_hidden_size: int) -> dict[str, Any]:
    """A small vision tower's config (flashpack runs text only; the tower lets the multimodal form
    load whole): what real Qwen vision towers share, the sizes from `preset_vision`."""
    vision = {
        "model_type": "qwen4_exp_vision",
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "initializer_range": 0.02,
    }
    vision.update(preset_vision)
    vision["out_hidden_size"] = out_hidden_size
    side = int(vision["num_position_embeddings"] ** 0.5)
    if side * side != vision["num_position_embeddings"]:
        raise FlashpackError("vision num_position_embeddings must be a square (a grid of positions)")
    return vision
