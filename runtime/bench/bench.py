"""`run_bench`: load the engine at the (scaled) budgets, measure the ceilings, time prefill and
decode, optionally the transformers baseline, and assemble the report (report.py lays it out)."""

from __future__ import annotations

import gc
from dataclasses import asdict, replace
from pathlib import Path

import torch

from flashpack.errors import FlashpackError
from flashpack.layout.pack import Pack
from flashpack.runtime.bench.bandwidth import (
    DEFAULT_DISK_BYTES,
    measure_ceilings,
    tier_bandwidths,
)
from flashpack.runtime.bench.baseline import (
    BASELINES,
    TransformersBaseline,
    max_memory_for,
)
from flashpack.runtime.bench.check import compare_logits, prefix_logits
from flashpack.runtime.bench.emulate import (
    BUDGET_FORMULA,
    LAYER_KIND_FORMULA,
    LAYER_TIME_FORMULA,
    SCALE_FORMULA,
    LayerKinds,
    check_layers,
    scale_by_layer_time,
    scale_to_layers,
    scale_traffic,
    scaled_budgets,
)
from flashpack.runtime.bench.machine import machine_info
from flashpack.runtime.bench.report import BENCH_VERSION, notes, write_report
from flashpack.runtime.bench.roofline import phase_traffic, roofline
from flashpack.runtime.bench.run import run_engine
from flashpack.runtime.bench.speculation import speculative_decode
from flashpack.runtime.bench.sizes import baseline_fixed_bytes, model_sizes
from flashpack.runtime.bench.workload import prompt_ids
from flashpack.runtime.engine.build import load_engine, parse_device, parse_dtype
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.store.budget import parse_budget


def run_bench(
    pack: Path | str,
    config: EngineConfig = EngineConfig(experts="store", speculate="off"),
    *,
    prompt_len: int = 512,
    gen: int = 64,
    emulate_layers: int | None = None,
    baseline: str | None = None,
    baseline_layers: int = 2,
    baseline_prompt_len: int = 512,
    baseline_gen: int = 4,
    seed: int = 0,
    repeats: int = 1,
    copy_probe: str | int | None = None,
    disk_probe: str | int = DEFAULT_DISK_BYTES,
    offload_dir: Path | None = None,
    json_path: Path | None = None,
    progress: bool = False,
) -> dict:
    """Benchmark `pack` as `config` runs it; returns the report (and writes it to `json_path` when given).

    A baseline that fails does not lose our measurements: its entry holds {"error": ...} instead.

    Budgets are for the full model: with `emulate_layers` (the full model's decoder layer count)
    they are scaled to the pack's layers (emulate.py), and per-token results are reported at both
    counts; `config.store`'s budgets are the full model's. With `config.speculate` other than off,
    decode is also timed with the engine's drafters (runtime/bench/speculation.py), reported under
    results.flashpack.speculation. `baseline="transformers"` also times transformers + accelerate on the pack's first
    `baseline_layers` layers at the same budget (baseline.py)."""
    for name, value, least in (("--prompt-len", prompt_len, 1), ("--gen", gen, 1), ("--repeats", repeats, 1),
                               ("--baseline-prompt-len", baseline_prompt_len, 1), ("--baseline-gen", baseline_gen, 1)):
        if value < least:
            raise FlashpackError(f"{name} must be at least {least}, got {value}")
    if baseline is not None and baseline not in BASELINES:
        raise FlashpackError(f"unknown baseline {baseline!r}: choose one of {', '.join(BASELINES)}")
    manifest = Pack.open(pack).manifest
    cfg = manifest.config
    torch_device = parse_device(config.device)
    torch_dtype = parse_dtype(config.dtype, torch_device)
    layers = cfg.num_hidden_layers
    target = check_layers(layers, emulate_layers)
    if baseline is not None and not 1 <= baseline_layers <= layers:
        raise FlashpackError(f"--baseline-layers must be 1..{layers} (the pack's decoder layers), got {baseline_layers}")
    if prompt_len + gen + 1 > cfg.max_position_embeddings:
        raise FlashpackError(f"--prompt-len {prompt_len} + --gen {gen} exceeds the model's context "
                             f"({cfg.max_position_embeddings} positions)")
    sizes = model_sizes(manifest, torch_dtype, torch_device)
    typed = {"vram": parse_budget(config.store.vram_budget, "--vram-budget"),
             "ram": parse_budget(config.store.ram_budget, "--ram-budget")}
    fixed, engine_budgets = scaled_budgets(typed, sizes.device_fixed, layers, target)

    # the bench times steps, not generation: no prompt cache
    config = replace(config, experts="store", prompt_cache_ram=0,
                     store=replace(config.store, vram_budget=engine_budgets["vram"], ram_budget=engine_budgets["ram"]))
    engine = load_engine(pack, config)
    graphs = engine.step.graphs
    engine_setup = {"expert_source": type(engine.store).__name__, "cuda_graphs": graphs is not None,
                    "compiled_layers": graphs is not None and config.compile_layers,
                    "layers_per_graph": graphs.layers_per_graph if graphs is not None else None,
                    "prefetch": config.prefetch, "read_ahead": config.read_ahead and config.prefetch,
                    "promote": config.store.promote, "fused_mix": engine.model.fused_mix,
                    "config": asdict(config)}
    try:
        tokenizer = engine.tokenizer.tokenizer
        eos = cfg.eos_token_id if cfg.eos_token_id is not None and cfg.eos_token_id >= 0 else None
        prompt = prompt_ids(tokenizer, cfg.vocab_size, prompt_len, seed, eos)
        warmup = prompt_ids(tokenizer, cfg.vocab_size, prompt_len, seed + 1, eos)
        expert_files = sorted({r.file for r in manifest.expert_records()})
        ceilings = measure_ceilings(
            torch_device, engine.pack.root, expert_files,
            copy_bytes=parse_budget(copy_probe, "--copy-probe") if copy_probe is not None else None,
            disk_bytes=parse_budget(disk_probe, "--disk-probe"), direct_io=config.store.direct_io,
        )
        ours = run_engine(engine, prompt, gen, warmup, repeats, progress)
        speculation = None
        if engine.generator.speculation is not None:
            speculation = speculative_decode(engine, prompt, gen, repeats)
        baseline_prompt = prompt[:min(prompt_len, baseline_prompt_len)]
        ours_prefix = prefix_logits(engine.model, baseline_prompt, baseline_layers) if baseline else None
        opened = engine.pack  # the baseline reads the same mapped pack
        plan = engine.store.plan
        store_plan = {"device_slots": plan.device_slots, "host_slots": plan.host_slots,
                      "device_reserved": plan.device_reserved, "host_reserved": plan.host_reserved,
                      "record_stride": plan.record_stride}
    finally:
        engine.close()
        del engine
        gc.collect()
        if torch_device.type == "cuda":
            torch.cuda.empty_cache()

    bandwidth = tier_bandwidths(ceilings)
    ours_dict = ours.to_dict()
    ours_dict["speculation"] = speculation
    kinds = LayerKinds.of([cfg.is_linear(i) for i in range(layers)],
                          [cfg.ple_index(i) is not None for i in range(layers)], target)
    ours_dict["scaled"] = _scaled(ours_dict, ours.fixed_seconds, layers, target, kinds) if target != layers else None
    report_roofline = _rooflines(sizes, ours_dict, bandwidth, layers, target, kinds)

    baseline_dict = comparison = None
    budgets = {"typed": typed, "fixed": fixed, "engine": engine_budgets, "layers_typed_for": target,
               "pack_layers": layers, "formula": BUDGET_FORMULA, "store_plan": store_plan}
    if baseline is not None:
        base_fixed = baseline_fixed_bytes(manifest, torch_dtype)
        _, base_budgets = scaled_budgets(typed, base_fixed, baseline_layers, target)
        budgets["baseline"] = {**base_budgets, "fixed_vram": base_fixed, "layers": baseline_layers}
        max_memory = max_memory_for(torch_device, base_budgets["vram"], base_budgets["ram"])
        try:
            result = _run_baseline(opened, baseline_layers, torch_dtype, torch_device, max_memory, offload_dir,
                                   progress, baseline_prompt, baseline_gen)
        except Exception as error:  # noqa: BLE001 - the report keeps our numbers and says what failed
            baseline_dict = {"error": f"{type(error).__name__}: {error}"}
        else:
            baseline_dict = result.to_dict()
            baseline_dict["prompt_truncated"] = len(baseline_prompt) < prompt_len
            baseline_dict["check"] = compare_logits(ours_prefix, result.first_logits, torch_dtype)
            baseline_dict["scaled"] = {
                str(count): _scaled(baseline_dict, result.fixed_seconds, baseline_layers, count)
                for count in sorted({layers, target})
            }
            comparison = _compare(ours_dict, baseline_dict, layers, target)

    report = {
        "bench_version": BENCH_VERSION,
        "machine": machine_info(torch_device),
        "settings": {
            "pack": str(pack), "device": str(torch_device), "dtype": str(torch_dtype).removeprefix("torch."),
            "policy": config.store.policy, "hot_set": config.store.hot_set, "prompt_tokens": prompt_len, "gen_tokens": gen, "seed": seed,
            "repeats": repeats, "emulate_layers": emulate_layers, "pack_layers": layers, "direct_io": config.store.direct_io,
            "baseline": baseline, "baseline_layers": baseline_layers if baseline else None,
            "baseline_prompt_tokens": len(baseline_prompt) if baseline else None,
            "baseline_gen_tokens": baseline_gen if baseline else None,
            **engine_setup,
        },
        "budgets": budgets,
        "sizes": sizes.to_dict(),
        "bandwidth": ceilings,
        "results": {"flashpack": ours_dict, "transformers": baseline_dict},
        "roofline": report_roofline,
        "comparison": comparison,
        "notes": notes(layers, target, baseline_layers if baseline else None, SCALE_FORMULA, BUDGET_FORMULA),
    }
    if json_path is not None:
        write_report(report, json_path)
    return report


def _run_baseline(pack: Pack, layers: int, dtype: torch.dtype, device: torch.device, max_memory: dict | None,
                  offload_dir: Path | None, progress: bool, prompt: list[int], gen: int):
    runner = TransformersBaseline(pack, layers, dtype, device, max_memory, offload_root=offload_dir,
                                  progress=progress)
    try:
        return runner.run(prompt, gen)
    finally:
        runner.close()


def _scaled(result: dict, fixed: dict[str, float], layers: int, target: int, kinds: LayerKinds | None = None) -> dict:
    """Per-token figures of a run with `layers` layers at `target` layers: prefill by
    emulate.SCALE_FORMULA; decode by LAYER_KIND_FORMULA where each layer's time was measured (a
    CUDA graph a layer), else by LAYER_TIME_FORMULA where the layers' time was (CUDA graphs), else by
    SCALE_FORMULA too (`decode_scaling` says which; the other figures are kept beside it:
    `decode_ms_per_token_even` by SCALE_FORMULA, `decode_ms_per_token_layer_time` by LAYER_TIME_FORMULA)."""
    prefill, decode = result["prefill"], result["decode"]
    ttft = scale_to_layers(prefill["ttft_s"], fixed["prefill"], layers, target)
    tokens = decode["tokens"]
    per_token = per_token_even = scale_to_layers(decode["seconds"] / tokens, fixed["decode"], layers, target)
    scaling, out = SCALE_FORMULA, {"decode_ms_per_token_even": 1000 * per_token_even}
    if decode.get("layer_seconds") is not None:
        per_token = scale_by_layer_time(decode["seconds"] / tokens, decode["layer_seconds"] / tokens, layers, target)
        scaling, out["decode_ms_per_token_layer_time"] = LAYER_TIME_FORMULA, 1000 * per_token
        each = {int(layer): seconds / tokens for layer, seconds in (decode.get("layer_seconds_each") or {}).items()}
        tail = kinds.tail_sum(each) if kinds is not None else None
        if tail is not None:
            per_token, scaling = decode["seconds"] / tokens + tail, LAYER_KIND_FORMULA
    return {
        "layers": target, "ttft_s": ttft, "prefill_tokens_per_s": prefill["tokens"] / ttft,
        "decode_ms_per_token": 1000 * per_token, "decode_tokens_per_s": 1 / per_token,
        "decode_scaling": scaling, **out,
    }


def _rooflines(sizes, ours: dict, bandwidth: dict, layers: int, target: int, kinds: LayerKinds) -> dict:
    out = {}
    for phase in ("prefill", "decode"):
        result = ours[phase]
        tokens = result["tokens"]
        forwards = 1 if phase == "prefill" else tokens
        achieved = result["ttft_s"] if phase == "prefill" else result["seconds"]
        store = result["store"]
        repeats = store["tokens"] / tokens
        traffic = phase_traffic(sizes, forwards=forwards, tokens=tokens, requests=store["requests"] / repeats,
                                host_to_device=store["bytes"]["host_to_device"] / repeats,
                                disk_to_host=store["bytes"]["disk_to_host"] / repeats)
        out[phase] = roofline(traffic, bandwidth, tokens, achieved)
        if target != layers:
            fixed_device = forwards * sizes.head_read + tokens * sizes.embed_row
            scaled = ours["scaled"]
            seconds = scaled["ttft_s"] if phase == "prefill" else scaled["decode_ms_per_token"] * tokens / 1000
            layer_dense = None  # bytes counted as the time was: by kind where decode's time was
            if phase == "decode" and scaled["decode_scaling"] == LAYER_KIND_FORMULA:
                tail_dense = kinds.tail_sum(dict(enumerate(sizes.layer_dense_each)))
                layer_dense = forwards * sizes.layer_dense, forwards * (sizes.layer_dense + tail_dense)
            out[f"{phase}_at_{target}_layers"] = roofline(
                scale_traffic(traffic, fixed_device, layers, target, layer_dense), bandwidth, tokens, seconds)
    return out


def _compare(ours: dict, baseline: dict, layers: int, target: int) -> dict:
    """ours / baseline at the layer count the budgets were typed for (higher is better for ours)."""
    mine = ours["scaled"] if target != layers else {
        "prefill_tokens_per_s": ours["prefill"]["tokens_per_s"], "decode_tokens_per_s": ours["decode"]["tokens_per_s"],
    }
    theirs = baseline["scaled"][str(target)]
    return {
        "layers": target,
        "decode_tokens_per_s": {"flashpack": mine["decode_tokens_per_s"], "transformers": theirs["decode_tokens_per_s"],
                                "ratio": mine["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]},
        "prefill_tokens_per_s": {"flashpack": mine["prefill_tokens_per_s"],
                                 "transformers": theirs["prefill_tokens_per_s"],
                                 "ratio": mine["prefill_tokens_per_s"] / theirs["prefill_tokens_per_s"],
                                 "prompt_tokens": {"flashpack": ours["prefill"]["tokens"],
                                                   "transformers": baseline["prefill"]["tokens"]}},
        "same_first_token": baseline["check"]["same_top1"],
    }
