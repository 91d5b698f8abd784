"""Write the trained model as a Hugging Face snapshot in the real checkpoint's layout.

The same layout and writers as `flashpack synth`: the multimodal `qwen4_exp` config nesting the
text config beside a vision config, sharded safetensors with `model.safetensors.index.json` (synth's
shard writer, tensors in checkpoint_spec order under `model.language_model.*`, `mtp.*` and
`lm_head.weight`), a generation config, the tokenizer with its chat template, and a README. The
vision tower is synth's small random one: flashpack runs text only, and the tower lets the
multimodal form load in transformers with no missing keys. Written into `<out>.partial` and renamed
at the end, so an interrupted write never leaves something that looks like a snapshot; an existing
`out` is replaced only with `force`, and only if it holds nothing but snapshot files.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from flashpack.layout.checkpoint_spec import checkpoint_key, iter_specs
from flashpack.convert.synth.init_values import ValueSource
from flashpack.convert.synth.shard_writer import DiskTensor, write_sharded
from flashpack.convert.synth.snapshot_files import (
    TRANSFORMERS_VERSION,
    check_snapshot_output,
    multimodal_config,
    qwen_generation_config,
    write_json,
)
from flashpack.convert.synth.special_tokens import TokenIds
from flashpack.convert.synth.tokenizer import save_tokenizer
from flashpack.convert.synth.vision import iter_vision_tensors
from flashpack.convert.train.tokenizer import TOKENIZER_FILES
from flashpack.errors import FlashpackError
from flashpack.layout.model_config import TextConfig

FORM = "qwen4_exp"
SHARD_BYTES = 16_000_000  # two shards for the demo model: the index is exercised, as in real checkpoints
VISION_SEED = 0
_SNAPSHOT_FILES = {"config.json", "generation_config.json", "README.md", "model.safetensors.index.json",
                   *TOKENIZER_FILES}


def write_snapshot(
    out: Path,
    tensors: dict[str, torch.Tensor],
    text_config: dict[str, Any],
    vision_config: dict[str, Any],
    tokenizer: Tokenizer,
    tokens: TokenIds,
    summary: dict[str, Any],
    force: bool = False,
) -> Path:
    """tensors: canonical name -> trained tensor (export.canonical_tensors); summary: a few numbers
    from the training record, kept in config.json's `flashpack_demo` block and the README."""
    out = Path(out)
    check_output(out, force)
    staging = out.with_name(out.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)

    cfg = TextConfig.from_text_dict(text_config)
    index = write_sharded(staging, _disk_tensors(cfg, tensors, vision_config), SHARD_BYTES)
    write_json(staging / "config.json", _config(text_config, vision_config, tokens, summary))
    write_json(staging / "generation_config.json", qwen_generation_config(tokens))
    save_tokenizer(tokenizer, staging, tokens, model_max_length=cfg.max_position_embeddings)
    shards = len(set(index["weight_map"].values()))
    (staging / "README.md").write_text(_readme(cfg, summary, index["metadata"]["total_size"], shards))

    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out


def _disk_tensors(cfg: TextConfig, tensors: dict[str, torch.Tensor], vision_config: dict[str, Any]) -> list[DiskTensor]:
    disk = []
    for spec in iter_specs(cfg, with_mtp=cfg.mtp_num_hidden_layers > 0):
        dtype = torch.int64 if spec.role == "ple_buffer" else torch.bfloat16
        value = tensors[spec.name].to(dtype).contiguous()
        disk.append(DiskTensor(checkpoint_key(spec.name, FORM), dtype, spec.shape, lambda v=value: iter([v])))
    values = ValueSource(cfg, VISION_SEED, cfg.num_hidden_layers)
    for vision in iter_vision_tensors(vision_config):
        disk.append(DiskTensor(vision.key, torch.bfloat16, vision.shape, lambda t=vision: values.vision_blocks(t)))
    return disk


def _config(text: dict[str, Any], vision: dict[str, Any], tokens: TokenIds, summary: dict[str, Any]) -> dict[str, Any]:
    return {**multimodal_config(text, vision, tokens), "flashpack_demo": summary}


def _readme(cfg: TextConfig, summary: dict[str, Any], total_bytes: int, shards: int) -> str:
    lines = [
        "# flashpack's demo model: a small qwen4_exp trained on Python code",
        "",
        "Trained by `python -m flashpack.convert.train` on the Python sources of transformers "
        f"{summary.get('corpus_version', '?')} (see training-record.json beside this folder). It writes "
        "code-like text; it is a demo of the architecture and of flashpack, not a useful assistant.",
        "",
        f"- layers: {cfg.num_hidden_layers} ({cfg.layer_types.count('linear_attention')} DeltaNet, "
        f"{cfg.layer_types.count('indexed_attention')} QSA), hidden {cfg.hidden_size}, {cfg.hc_count} "
        "hyper-connection streams, PLE on layer(s) " + ", ".join(map(str, cfg.ple_layer_ids)),
        f"- experts: {cfg.num_experts} routed, top-{cfg.num_experts_per_tok}, plus a shared expert; "
        f"MTP: {cfg.mtp_num_hidden_layers} layer",
        f"- vocabulary: {cfg.vocab_size} (byte-level BPE trained on the training files)",
        f"- held-out loss {summary.get('held_out_loss', float('nan')):.3f} nats/token against the unigram "
        f"baseline's {summary.get('unigram_loss', float('nan')):.3f}; MTP top-1 agreement "
        f"{summary.get('mtp_agreement', float('nan')):.3f}",
        f"- tensors: {total_bytes:,} bytes in {shards} safetensors shards",
        "- the vision tower (`model.visual.*`) is synth's small RANDOM one: flashpack runs text only",
        "",
    ]
    return "\n".join(lines)


def check_output(out: Path, force: bool) -> None:
    """Raise unless a snapshot may be written at `out` (the trainer asks before it trains)."""
    check_snapshot_output(out, force, _SNAPSHOT_FILES)
