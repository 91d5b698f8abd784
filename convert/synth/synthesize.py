"""`flashpack synth`: write a randomly initialised Qwen3.8-Flash-Next snapshot, laid out like the real one.

The snapshot is written into `<out>.partial` and renamed at the end, so an interrupted run never
leaves something that looks complete. Memory stays bounded, whatever the preset: a few value blocks
(4 MB of float32 each) per sampling thread, the writer's look-ahead window and, for NVFP4, a window
of quantised experts.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from flashpack.convert.synth.init_values import ValueSource
from flashpack.convert.synth.nvfp4_experts import (
    check_expert_shapes,
    exclude_modules,
    quant_configs,
)
from flashpack.convert.synth.presets import SynthOptions, SynthPlan, resolve_plan
from flashpack.convert.synth.router_skew import RouterSkew
from flashpack.convert.synth.shard_writer import write_sharded
from flashpack.convert.synth.snapshot_files import (
    config_json,
    check_snapshot_output,
    generation_config,
    readme,
    synth_record,
    write_json,
)
from flashpack.convert.synth.tensor_plan import disk_tensors
from flashpack.convert.synth.tokenizer import write_tokenizer
from flashpack.errors import FlashpackError

# Files a snapshot consists of; `force` only ever deletes a folder holding nothing else.
_SNAPSHOT_FILES = (
    "config.json",
    "generation_config.json",
    "hf_quant_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
    "model.safetensors.index.json",
)


def synthesize(
    preset: str,
    out: Path,
    *,
    format: str = "bf16",
    seed: int = 0,
    layers: int | None = None,
    experts: int | None = None,
    router_skew: float | None = None,
    text_only: bool = False,
    ple_rows_per_head: int | None = None,
    shard_mb: float | None = None,
    fast_experts: bool = False,
    force: bool = False,
) -> Path:
    """Write a synthetic snapshot of `preset` into `out` and return `out`.

    format: "bf16" or "nvfp4" (ModelOpt: routed experts NVFP4, the rest BF16).
    layers / experts: cut the preset's depth (pattern and PLE layer 1 kept) or routed-expert count.
    router_skew: 0 uniform routing, 1 the published routing-mass curve; None: the preset's default.
    text_only: write the `qwen4_exp_text` form (keys under `model.`, no vision) instead of `qwen4_exp`.
    ple_rows_per_head: shrink the PLE tables to about this many rows per hash head.
    shard_mb: safetensors shard size in MB; None: the preset's default.
    fast_experts: (nvfp4) draw the routed experts' NVFP4 blocks from a pool of quantised reference
      blocks instead of sampling and quantising each expert: some 20 times faster, the same bytes,
      layout, magnitudes and routing, for benchmark packs (values then differ from the BF16 form).
    """
    options = SynthOptions(
        preset=preset,
        format=format,
        seed=seed,
        layers=layers,
        experts=experts,
        router_skew=router_skew,
        text_only=text_only,
        ple_rows_per_head=ple_rows_per_head,
        shard_mb=shard_mb,
        fast_experts=fast_experts,
    )
    plan = resolve_plan(options)
    out = Path(out)
    check_snapshot_output(out, force, _SNAPSHOT_FILES)
    staging = out.with_name(out.name + ".partial")
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)

    skew = RouterSkew.build(plan.cfg, plan.router_skew, seed, plan.nominal_layers) if plan.router_skew > 0 else None
    values = ValueSource(plan.cfg, seed, plan.nominal_layers, adjuster=skew)
    tensors = disk_tensors(plan, values)
    index = write_sharded(staging, tensors, plan.shard_bytes)

    quantization = _write_quant_config(staging, plan)
    record = synth_record(plan, _routing_record(skew))
    write_json(staging / "config.json", config_json(plan, quantization, record))
    write_json(staging / "generation_config.json", generation_config(plan))
    write_tokenizer(staging, plan.tokens, model_max_length=plan.cfg.max_position_embeddings)
    shards = len(set(index["weight_map"].values()))
    (staging / "README.md").write_text(readme(plan, record, index["metadata"]["total_size"], shards))

    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out


def _write_quant_config(folder: Path, plan: SynthPlan) -> dict | None:
    if plan.options.format != "nvfp4":
        return None
    check_expert_shapes(plan.cfg)
    prefix = "model." if plan.options.text_only else "model.language_model."
    hf_quant, in_config = quant_configs(exclude_modules(plan.cfg, prefix, with_vision=plan.vision_config is not None))
    write_json(folder / "hf_quant_config.json", hf_quant)
    return in_config


def _routing_record(skew: RouterSkew | None) -> dict | None:
    if skew is None:
        return None
    return {
        "mechanism": "massive embedding channel + ranked router biases (see flashpack/convert/synth/README.md)",
        "channel": skew.channel,
        "massive_value": skew.massive,
        "law": {"alpha": round(skew.law.alpha, 4), "beta": round(skew.law.beta, 4)},
    }
