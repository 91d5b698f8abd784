"""The bench's five measurements, each a function of what it reads, returning its JSON part."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from flashpack.bench.demo_model import greedy, loss
from flashpack.bench.demo_model.edit_tasks import edit_tasks
from flashpack.bench.demo_model.held_out import TextModel, code_text, file_prompts, held_out_windows, spread
from flashpack.bench.demo_model.locality import (
    PromptLocality, decode_locality, replay_misses, trace_pack, write_workload,
)
from flashpack.bench.demo_model.lookup import LookupMeter
from flashpack.bench.demo_model.settings import BenchSettings
from flashpack.bench.demo_model.sources import Engine
from flashpack.convert.train.corpus import Corpus
from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig


@dataclass
class Models:
    transformers: object  # sources.transformers_model: the BF16 snapshot upcast
    pack_weights: object  # sources.pack_weights_model: the weights the pack holds
    pack: Engine  # the engine on the NVFP4 pack
    snapshot: Engine  # the engine on the snapshot's BF16 weights


def held_out_loss(models: Models, windows: list[torch.Tensor], unigram: torch.Tensor,
                  routing: PromptLocality) -> dict:
    """(a) transformers, (b) the pack through the engine (and its MTP head), (c) unigram, (d) the
    snapshot's weights through the engine; the pack's per-token routing is observed on the way."""
    reference = loss.transformers_loss(models.transformers, windows)
    models.pack.model.observe_routing(routing)
    try:
        pack = loss.engine_loss(models.pack, windows)
    finally:
        models.pack.model.observe_routing(None)
    snapshot = loss.engine_loss(models.snapshot, windows)
    return {
        "transformers_bf16_snapshot": reference,
        "flashpack_nvfp4_pack": pack,
        "flashpack_bf16_snapshot": snapshot,
        "unigram": {"loss": loss.unigram_loss(unigram, windows)},
        "gap_nvfp4_pack_vs_transformers": loss.relative_gap(pack["loss"], reference["loss"]),
        "gap_engine_vs_transformers_same_weights": loss.relative_gap(snapshot["loss"], reference["loss"]),
    }


def greedy_tokens(models: Models, text: TextModel, corpus: Corpus, settings: BenchSettings) -> dict:
    prompts = file_prompts(text, corpus.held_out, settings.greedy_prompts, settings.greedy_prompt_tokens)
    paths, steps = [path for path, _ in prompts], settings.greedy_tokens
    run = lambda generate, model: [generate(model, ids, steps) for _, ids in prompts]  # noqa: E731
    transformers_bf16 = run(greedy.transformers_greedy, models.transformers)
    transformers_pack = run(greedy.transformers_greedy, models.pack_weights)
    engine_pack = run(greedy.engine_greedy, models.pack.model)
    engine_snapshot = run(greedy.engine_greedy, models.snapshot.model)
    return {
        "prompts": paths, "prompt_tokens": settings.greedy_prompt_tokens, "tokens": steps,
        "tie_margin": greedy.TIE_MARGIN,
        "pack_weights": greedy.compare(transformers_pack, engine_pack, paths),
        "snapshot_weights": greedy.compare(transformers_bf16, engine_snapshot, paths),
        "bf16_transformers_vs_nvfp4_pack": greedy.compare(transformers_bf16, engine_pack, paths),
    }


def prompt_lookup(engine: Engine, text: TextModel, corpus: Corpus, settings: BenchSettings) -> dict:
    """Drafts against the pack's greedy continuation: edit prompts, then plain code for contrast."""
    edit, plain = LookupMeter(settings.lookup_n_max, settings.lookup_k), LookupMeter(settings.lookup_n_max, settings.lookup_k)
    tasks = []
    for task in edit_tasks(corpus.held_out, settings.edit_prompts):
        ids = text.encode(task.prompt)
        continuation = greedy.engine_greedy(engine.model, ids, settings.lookup_tokens).tokens
        accepted = edit.add(ids, continuation)
        written = text.decode(continuation)
        tasks.append({**task.describe(), "prompt_tokens": len(ids), "mean_accepted": sum(accepted) / max(len(accepted), 1),
                      "written_as_expected_chars": _common_prefix(written, task.expected),
                      "of_chars": min(len(written), len(task.expected))})
    prompts = file_prompts(text, corpus.held_out, settings.plain_prompts, settings.plain_prompt_tokens)
    for _, ids in prompts:
        plain.add(ids, greedy.engine_greedy(engine.model, ids, settings.lookup_tokens).tokens)
    return {"n_max": settings.lookup_n_max, "k": settings.lookup_k, "decoded_tokens": settings.lookup_tokens,
            "edit": edit.result(), "plain": plain.result(), "edit_tasks": tasks,
            "plain_prompts": [path for path, _ in prompts]}


def routing(demo_prompt: dict, demo_pack: Path, synth_pack: Path, synth_text: TextModel, corpus: Corpus,
            settings: BenchSettings, work: Path) -> dict:
    """Locality per layer, demo against synth, and both traces replayed through the policies."""
    synth = load_engine(synth_pack, EngineConfig(dtype="float32", cuda_graphs=False)).model
    synth_routing = PromptLocality(synth.config.num_experts_per_tok)
    synth.observe_routing(synth_routing)
    for window in held_out_windows(synth_text, corpus, settings.windows, settings.window_length).windows:
        synth(window[:settings.window_length], synth.new_state())
    # From files that go on past the prompt, so the model has code to continue, not an end of file.
    long_files = tuple(text for text in map(code_text, corpus.held_out) if len(text) > 2 * settings.trace_prompt_chars)
    texts = [text[:settings.trace_prompt_chars].rpartition("\n")[0] + "\n" for text in spread(long_files, settings.trace_prompts)]
    workload = write_workload(work / "workload.jsonl", texts, settings.trace_tokens)
    traces = {name: trace_pack(pack, workload, work / f"{name}.trace.json", settings.trace_tokens)
              for name, pack in (("demo", demo_pack), ("synth", synth_pack))}
    cfg = synth.config
    return {
        "uniform": cfg.num_experts_per_tok / cfg.num_experts,
        "synth_model": f"flashpack synth {settings.synth_preset} --router-skew {settings.synth_router_skew} "
                       f"--seed {settings.seed} (random weights; {cfg.num_hidden_layers} layers, {cfg.num_experts} "
                       f"experts top-{cfg.num_experts_per_tok}, hidden {cfg.hidden_size}), converted to a pack",
        "locality": {"demo": {"prompt": demo_prompt, "decode": decode_locality(traces["demo"])},
                     "synth": {"prompt": synth_routing.result(), "decode": decode_locality(traces["synth"])}},
        "trace_prompts": len(texts), "trace_tokens": settings.trace_tokens,
        "replay": {name: replay_misses(trace, list(settings.capacities)) for name, trace in traces.items()},
    }


def _common_prefix(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share: how far the model wrote the edit as expected."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
