"""The JSON and Markdown files beside the weights: config, generation config, quant config, README.

config.json follows the real checkpoints' nesting: the multimodal form (`qwen4_exp`) nests the
text config under `text_config` next to a vision config and the image/video token ids; the text
form (`qwen4_exp_text`) is the text config itself. A `flashpack_synth` block records how the
snapshot was made (transformers keeps unknown config keys as attributes), so the converter and
readers can tell a synthetic snapshot, and a shrunk PLE, from a real one.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

from flashpack.convert.synth.presets import SynthPlan
from flashpack.convert.synth.special_tokens import TokenIds
from flashpack.errors import FlashpackError

TRANSFORMERS_VERSION = "5.23.0"


def synth_record(plan: SynthPlan, routing: dict[str, Any] | None) -> dict[str, Any]:
    options = plan.options
    return {
        "preset": options.preset,
        "seed": options.seed,
        "format": options.format,
        "experts_from": _experts_from(plan),
        "form": plan.form,
        "layers": plan.cfg.num_hidden_layers,
        "preset_layers": plan.nominal_layers,
        "num_experts": plan.cfg.num_experts,
        "ple_shrunk": plan.ple_shrunk,
        "ple_rows_per_head": options.ple_rows_per_head,
        "router_skew": plan.router_skew,
        "routing": routing,
    }


def _experts_from(plan: SynthPlan) -> str:
    if plan.options.format != "nvfp4":
        return "sampled"
    return "drawn blocks" if plan.options.fast_experts else "sampled, quantised"


def config_json(plan: SynthPlan, quantization: dict[str, Any] | None, record: dict[str, Any]) -> dict[str, Any]:
    text = dict(plan.text_config)
    if plan.options.text_only:
        config = dict(text, architectures=["Qwen4ExpForCausalLM"], transformers_version=TRANSFORMERS_VERSION)
    else:
        config = multimodal_config(text, plan.vision_config, plan.tokens)
    if quantization is not None:
        config["quantization_config"] = quantization
    config["flashpack_synth"] = record
    return config


def multimodal_config(text: dict[str, Any], vision: dict[str, Any], tokens: TokenIds) -> dict[str, Any]:
    """config.json of the multimodal form, as the real checkpoints nest it."""
    return {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "dtype": "bfloat16",
        "image_token_id": tokens.id_of("<|image_pad|>"),
        "video_token_id": tokens.id_of("<|video_pad|>"),
        "vision_start_token_id": tokens.id_of("<|vision_start|>"),
        "vision_end_token_id": tokens.id_of("<|vision_end|>"),
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": vision,
        "transformers_version": TRANSFORMERS_VERSION,
    }


def generation_config(plan: SynthPlan) -> dict[str, Any]:
    return qwen_generation_config(plan.tokens)


def qwen_generation_config(tokens: TokenIds) -> dict[str, Any]:
    # Chat turns end with <|im_end|>; documents with <|endoftext|> (also the config's eos, which PLE
    # uses as the n-gram boundary): generation stops at either, as in Qwen's own releases.
    return {
        "bos_token_id": tokens.endoftext,
        "eos_token_id": [tokens.im_end, tokens.endoftext],
        "pad_token_id": tokens.endoftext,
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": TRANSFORMERS_VERSION,
    }


def check_snapshot_output(out: Path, force: bool, snapshot_files: Collection[str]) -> None:
    """Raise unless a snapshot may be written at `out`: absent, empty, or (with `force`) holding
    only a snapshot's files (`snapshot_files` and shards), so nothing else of the user's is lost."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FlashpackError(f"{out} exists and is not a directory")
    entries = list(out.iterdir())
    if not entries:
        return
    if not force:
        raise FlashpackError(f"{out} already exists; pass --force to overwrite it")
    foreign = [e.name for e in entries if e.name not in snapshot_files and not e.name.endswith(".safetensors")]
    if foreign:
        raise FlashpackError(
            f"refusing to overwrite {out}: it holds files a snapshot does not ({', '.join(sorted(foreign)[:3])})"
        )


def readme(plan: SynthPlan, record: dict[str, Any], total_bytes: int, shards: int) -> str:
    cfg = plan.cfg
    lines = [
        f"# Synthetic Qwen3.8-Flash-Next snapshot (`{plan.options.preset}` preset)",
        "",
        "Randomly initialised by `flashpack synth`: the layout, names, shapes, dtypes and configs of a",
        "real checkpoint, with values that mean nothing. Do not use it for anything but testing.",
        "",
        f"- preset: {plan.options.preset} ({plan.description})",
        f"- seed: {plan.options.seed}; format: {plan.options.format}; form: {plan.form}",
        f"- expert values: {record['experts_from']}",
        f"- layers: {cfg.num_hidden_layers} of the preset's {plan.nominal_layers}; experts: {cfg.num_experts}, top-{cfg.num_experts_per_tok}",
        f"- router skew: {plan.router_skew} (0 = near-uniform random routing, 1 = the published routing-mass curve)",
        f"- tensors: {total_bytes:,} bytes in {shards} safetensors shards",
    ]
    if plan.ple_shrunk:
        lines.append(
            f"- PLE SHRUNK: ngram_vocab_size_base lowered to {cfg.ngram_vocab_size_base:,} "
            f"(about {plan.options.ple_rows_per_head:,} rows per hash head instead of the preset's); tokens still read "
            f"{cfg.ngram_heads} rows per PLE layer"
        )
    if record.get("routing"):
        routing = record["routing"]
        lines.append(
            f"- massive channel {routing['channel']} (value {routing['massive_value']:.3f}); popularity law {routing['law']}"
        )
    lines.append("")
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")
