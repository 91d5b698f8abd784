"""Measure the embedded demo model through flashpack (CPU, FP32); see __init__.py for the parts.

    python -m flashpack.bench.demo_model --json bench/results/demo-model-cpu.json [--quick]

Writes the JSON and, beside it, the same numbers as Markdown tables (.md); prints the tables.
Exits 1 when a target is missed (the NVFP4 pack's held-out loss within 5 % of transformers', the
loss below half the unigram baseline's, MTP agreement >= 0.4, identical-weight greedy tokens equal
but for logit ties), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import transformers

from flashpack import demo_model
from flashpack.bench.demo_model import measure, sources
from flashpack.bench.demo_model.held_out import TextModel, held_out_windows, unigram_baseline
from flashpack.bench.demo_model.locality import PromptLocality
from flashpack.bench.demo_model.report import tables
from flashpack.bench.demo_model.settings import FULL, QUICK, BenchSettings
from flashpack.convert.pipeline import convert
from flashpack.convert.synth import synthesize
from flashpack.convert.train.corpus import load_corpus
from flashpack.errors import FlashpackError

NVFP4_GAP_TARGET, MTP_TARGET = 0.05, 0.4


def run(settings: BenchSettings, work: Path) -> dict:
    seconds: dict[str, float] = {}
    snapshot = demo_model.snapshot_path()
    with _timed(seconds, "packs"):
        pack = convert(str(snapshot), work / "demo.pack", progress=False)
        synth_snapshot = synthesize(settings.synth_preset, work / "synth", format="bf16", seed=settings.seed,
                                    router_skew=settings.synth_router_skew)
        synth_pack = convert(str(synth_snapshot), work / "synth.pack", progress=False)
    models = measure.Models(sources.transformers_model(snapshot), sources.pack_weights_model(snapshot),
                            sources.pack_engine(pack), sources.snapshot_engine(snapshot))
    text = TextModel.load(snapshot)
    corpus = load_corpus(max_train_files=settings.unigram_train_files)
    with _timed(seconds, "unigram"):
        unigram, counted = unigram_baseline(text, corpus, models.pack.model.config.vocab_size)
    windows = held_out_windows(text, corpus, settings.windows, settings.window_length)
    demo_routing = PromptLocality(models.pack.model.config.num_experts_per_tok)
    with _timed(seconds, "held_out_loss"):
        losses = measure.held_out_loss(models, windows.windows, unigram, demo_routing)
    with _timed(seconds, "greedy"):
        greedy = measure.greedy_tokens(models, text, corpus, settings)
    with _timed(seconds, "prompt_lookup"):
        lookup = measure.prompt_lookup(models.pack, text, corpus, settings)
    with _timed(seconds, "routing"):
        routing = measure.routing(demo_routing.result(), pack, synth_pack, TextModel.load(synth_snapshot), corpus,
                                  settings, work)
    result = {
        "bench": "demo_model", "version": 1, "machine": _machine(), "settings": settings.to_dict(),
        "held_out_windows": windows.describe(), "unigram": counted,
        "training_record": demo_model.training_record()["final"],
        "held_out_loss": losses, "greedy": greedy, "prompt_lookup": lookup, "routing": routing, "seconds": seconds,
    }
    result["targets"] = targets(result)
    return result


def targets(result: dict) -> dict[str, bool]:
    losses, greedy = result["held_out_loss"], result["greedy"]
    pack = losses["flashpack_nvfp4_pack"]
    same_weights = [greedy["pack_weights"], greedy["snapshot_weights"]]
    return {
        "NVFP4 pack's loss below half the unigram baseline's": pack["loss"] < losses["unigram"]["loss"] / 2,
        f"NVFP4 pack's loss within {NVFP4_GAP_TARGET:.0%} of transformers'": abs(losses["gap_nvfp4_pack_vs_transformers"]) < NVFP4_GAP_TARGET,
        f"MTP agreement with greedy >= {MTP_TARGET} (NVFP4 pack)": pack["mtp_agreement_with_greedy"] >= MTP_TARGET,
        "identical-weight greedy tokens equal but for logit ties": all(c["all_explained_by_ties"] for c in same_weights),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("bench/results/demo-model-cpu.json"))
    parser.add_argument("--quick", action="store_true", help="a few windows and tokens: the test's run (< 60 s)")
    parser.add_argument("--windows", help="held-out windows to read, a number or 'all' (default: the settings')")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args(argv)
    if args.threads < 1:
        return _fail(f"--threads must be at least 1, got {args.threads}")
    settings = QUICK if args.quick else FULL
    if args.windows is not None:
        if args.windows != "all" and not (args.windows.isdigit() and int(args.windows) > 0):
            return _fail(f"--windows takes a positive number or 'all', got {args.windows!r}")
        settings = replace(settings, windows=None if args.windows == "all" else int(args.windows))
    torch.set_num_threads(args.threads)
    try:
        with tempfile.TemporaryDirectory(prefix="demo-model-bench-") as work:
            result = run(settings, Path(work))
    except FlashpackError as error:
        return _fail(str(error))
    result["machine"]["threads"] = args.threads
    table = tables(result)
    _write(args.json, json.dumps(result, indent=1) + "\n")
    _write(args.json.with_suffix(".md"), table)
    print(table)
    return 0 if all(result["targets"].values()) else 1


@contextmanager
def _timed(seconds: dict[str, float], name: str):
    started = time.perf_counter()
    yield
    seconds[name] = round(time.perf_counter() - started, 2)


def _machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__, "device": "cpu", "dtype": "float32"}


def _write(path: Path, text: str) -> None:
    """Whole or not at all: a killed run leaves no half-written result that looks valid."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.partial-{os.getpid()}")
    temporary.write_text(text)
    temporary.replace(path)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
