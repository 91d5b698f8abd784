"""A short prompt step's time (a follow-up's new tokens after a context), engine settings against each
other, alternated in one process.

    python bench/prompt_step.py [PACK] --device cuda --variant base= --variant "pieces=compile_prompt_pieces=true" --json OUT

Each variant is an engine built with its settings (`--set`'s KEY=VALUE, comma-separated) and warmed
up. A context of CONTEXT tokens is prefilled once per engine; then, REPEATS times in turn over the
variants (A/B/A/B), the state is restored and a step of each of NEW tokens runs (each step timed to
its logits on the host). Without PACK, a tiny NVFP4 model is synthesised and converted in a temporary
folder: its layers' arithmetic is a few microseconds, so its step time is the host's, launches and
Python, a layer at a time (the figure a short prompt through a real pack's layers approaches when
the host, not the GPU, sets its pace). Writes JSON and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from flashpack.bench.collector_pauses import tiny_pack
from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.settings import with_settings


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, settings = text.partition("=")
    if not name:
        raise SystemExit(f"--variant takes NAME=[KEY=VALUE,...], got {text!r}")
    return name, [item for item in settings.split(",") if item]


def timed_step(engine, state, saved, tokens: torch.Tensor) -> float:
    """One step of `tokens` after the context, timed; `state` reset to `saved` in place first, as
    the Generator resets its one state, so graphs bound to its buffers stay valid."""
    state.restore(saved)
    start = time.perf_counter()
    logits = engine.step.forward(tokens, state, last_only=True).logits
    logits.float().cpu()  # waits for the step
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pack", nargs="?", help="a pack (default: a tiny synthetic one)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variant", action="append", type=parse_variant, required=True,
                        help="NAME=[KEY=VALUE,...]: an engine with these settings (repeatable)")
    parser.add_argument("--context", type=int, default=2048, help="tokens before the step (default 2048)")
    parser.add_argument("--new", type=int, action="append", help="the step's new tokens (repeatable; default 92)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the variants (default 3)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps a round, the median kept (default 5)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    lengths = args.new or [92]
    with tempfile.TemporaryDirectory() as folder:
        pack = args.pack or tiny_pack(Path(folder))
        engines, saved, states = {}, {}, {}
        for name, settings in args.variant:
            engine = load_engine(pack, with_settings(EngineConfig(device=args.device, prompt_cache_ram=0), settings))
            lengths_warm, depth = engine.warm_up_plan()
            engine.generator.warm_up(lengths_warm, prompt_depth=depth)
            context = torch.arange(args.context, dtype=torch.int64).mul_(7919).remainder_(900).add_(5)
            state = engine.step.new_state()
            state.reserve(args.context + max(lengths))
            engine.step.forward(context.to(args.device), state, last_only=True)
            engines[name], saved[name], states[name] = engine, state.snapshot(), state
            for length in lengths:  # first steps of each length: compiles, tunes and captures are not timed
                for _ in range(2):
                    timed_step(engine, state, saved[name], torch.arange(length).add_(11).to(args.device))
        rows = []
        for round_ in range(args.repeats):
            for name, engine in engines.items():
                for length in lengths:
                    tokens = torch.arange(length).mul_(31).remainder_(900).add_(11).to(args.device)
                    step_s = statistics.median(timed_step(engine, states[name], saved[name], tokens)
                                               for _ in range(args.steps))
                    rows.append({"variant": name, "round": round_ + 1, "new_tokens": length, "step_s": step_s,
                                 "per_layer_ms": 1e3 * step_s / engine.model_config.num_hidden_layers})
                    print(json.dumps(rows[-1]), flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine()
    report = {"pack": str(args.pack or "tiny synthetic"), "device": device, "context": args.context,
              "variants": {name: settings for name, settings in args.variant}, "rows": rows}
    args.json.write_text(json.dumps(report, indent=1))
    table = [f"# A short prompt step: {report['pack']} on {device}", "",
             f"Context {args.context} tokens; median of {args.steps} steps a round; rounds alternate the variants.", "",
             "| variant | settings | round | new tokens | step ms | ms a layer |", "| --- | --- | --- | --- | --- | --- |"]
    table += [f"| {r['variant']} | {', '.join(report['variants'][r['variant']]) or 'defaults'} | {r['round']} | "
              f"{r['new_tokens']} | {1e3 * r['step_s']:.2f} | {r['per_layer_ms']:.3f} |" for r in rows]
    args.json.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
