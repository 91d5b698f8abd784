"""What a warmed-up engine's first requests of each kind still pay: each request's time to first
token (TTFT) and whole time against a request of the same shape sent next, with the kernels each
built: the files Triton's and TorchInductor's compile caches gained meanwhile (Inductor builds in
worker processes, which a profile of the request does not see).

    python bench/first_requests.py PACK [--device cuda] [--vram-budget 24GiB --ram-budget 64GiB
        --emulate-layers 48 --hot-set '*'] [--document-tokens 32768] --json OUT

The requests, each with the prompt cache on and checkpoints at its message boundaries, as the server
sends them:
  chat          a system message and ~--turn-tokens tokens of Python source (nothing to restore)
  chat again    the same shape, other text and another system message
  follow-up     the chat, its reply and ~--turn-tokens more: a live hit and an extension prefill
  follow-up again  the same on "chat again"
  document      a --document-tokens document (skipped at 0), then another, then a follow-up on each

Engine.warm_up is meant to build what a first request would: a first request far slower than its
repeat, with kernels built, is what it missed (on a machine whose compile caches are empty: later
starts find what the first built). A cProfile summary of every request goes to `--profiles`
(default: beside the JSON): the 40 functions of most cumulative and of most own time, every
thread's (Python 3.12's profiler sees them all, so a background thread's calls show among the
request's).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shlex
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from flashpack.layout.pack import Pack
from flashpack.runtime.bench.emulate import check_layers, scaled_budgets
from flashpack.runtime.bench.first_use import device_segments_allocated
from flashpack.runtime.bench.machine import machine_info
from flashpack.runtime.bench.sizes import model_sizes
from flashpack.runtime.engine.build import load_engine, parse_device, parse_dtype
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.settings import with_settings
from flashpack.runtime.sampling import SamplingParams
from flashpack.runtime.store.budget import parse_budget
from flashpack.runtime.store.config import StoreConfig

from flashpack.bench.prompt_reuse import document_text, engine_arguments, source_text, source_turns  # the same texts

def compile_caches() -> list[Path]:
    """Where Triton and TorchInductor keep what they build (a build writes its files there: counted
    by the files' times, since Inductor builds in worker processes that a profile does not see)."""
    import os

    found = [Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))]
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        found.append(Path(cache_dir()))
    except ImportError:
        pass
    return found


def built_between(caches: list[Path], start: float, end: float) -> list[str]:
    """The names of the files the compile caches gained between two times (time.time())."""
    names = []
    for cache in caches:
        for path in cache.rglob("*") if cache.is_dir() else []:
            try:
                made = path.stat().st_mtime
            except OSError:
                continue
            if path.is_file() and start <= made <= end:
                names.append(path.name)
    return sorted(names)


def request(engine, ids: list[int], reply_tokens: int, profiles: Path, name: str) -> dict:
    profiler = cProfile.Profile()
    pieces, last = [], None
    segments, began = device_segments_allocated(), time.time()
    profiler.enable()
    for event in engine.generator.stream(ids, SamplingParams(max_tokens=reply_tokens),
                                         checkpoints=engine.tokenizer.message_starts(ids)):
        pieces.append(event.text)
        last = event
    profiler.disable()
    ended = time.time()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)
    (profiles / f"profile-{name.replace(' ', '-')}.txt").write_text(text.getvalue())
    return {"request": name, "prompt_tokens": len(ids), "cached_tokens": last.timings["cached_tokens"],
            "ttft_s": last.timings["first_token_seconds"], "total_s": last.timings["total_seconds"],
            "device_segments_allocated": device_segments_allocated() - segments,
            "window": [began, ended], "text": "".join(pieces)}


def chat_pair(engine, system: str, turns: list[str], reply_tokens: int, profiles: Path, name: str) -> list[dict]:
    """A chat of one turn, then its follow-up (the reply and the next turn appended)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": turns[0]}]
    first = request(engine, engine.tokenizer.encode_chat(messages), reply_tokens, profiles, name)
    messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": turns[1]}]
    follow = request(engine, engine.tokenizer.encode_chat(messages), 1, profiles, f"{name} follow-up")
    return [first, follow]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = engine_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--turn-tokens", type=int, default=500, help="tokens a chat turn adds (default %(default)s)")
    parser.add_argument("--document-tokens", type=int, default=0, help="the documents' tokens (default: none)")
    parser.add_argument("--reply-tokens", type=int, default=16, help="tokens a chat is answered with (default %(default)s)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="an EngineConfig setting (repeatable)")
    parser.add_argument("--json", type=Path, required=True, help="the report")
    parser.add_argument("--profiles", type=Path, help="where the cProfile summaries go (default: beside the JSON)")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    device = parse_device(args.device)
    manifest = Pack.open(args.pack).manifest
    layers = manifest.config.num_hidden_layers
    target = check_layers(layers, args.emulate_layers)
    sizes = model_sizes(manifest, parse_dtype(EngineConfig.dtype, device), device)
    typed = {"vram": parse_budget(args.vram_budget, "--vram-budget"), "ram": parse_budget(args.ram_budget, "--ram-budget")}
    _, budgets = scaled_budgets(typed, sizes.device_fixed, layers, target)
    profiles = args.profiles or args.json.parent / f"{args.json.stem}-profiles"
    profiles.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="prompt-states-") as folder:
        config = with_settings(EngineConfig(device=args.device, prompt_cache_dir=folder, speculate="off",
                                            store=StoreConfig(vram_budget=budgets["vram"], ram_budget=budgets["ram"],
                                                              hot_set=args.hot_set)), args.settings)
        start = time.perf_counter()
        engine = load_engine(args.pack, config)
        loaded = time.perf_counter() - start
        warm = engine.warm_up()
        turns = source_turns(engine.tokenizer, 4, args.turn_tokens)
        rows += chat_pair(engine, "You complete Python code.", turns[:2], args.reply_tokens, profiles, "chat")
        rows += chat_pair(engine, "You write Python.", turns[2:], args.reply_tokens, profiles, "chat again")
        if args.document_tokens:
            text = document_text(engine.tokenizer, source_text(), 2 * args.document_tokens)
            ids = engine.tokenizer.encode(text)
            halves = [engine.tokenizer.tokenizer.decode(ids[:args.document_tokens]),
                      engine.tokenizer.tokenizer.decode(ids[args.document_tokens:])]
            for index, half in enumerate(halves):
                name = "document" if index == 0 else "document again"
                rows += chat_pair(engine, f"Answer questions about document {index + 1}.",
                                  [half, "Which functions decide when generation stops?"], args.reply_tokens,
                                  profiles, name)
        engine.close()
    caches = compile_caches()
    for row in rows:
        row.pop("text")
        built = built_between(caches, *row.pop("window"))
        row["cache_files_built"] = len(built)
        # a Triton kernel's metadata file is named for the kernel
        row["kernels_built"] = sorted({name[:-5] for name in built if name.endswith(".json") and not name.startswith("__")})
    report = {"machine": machine_info(device), "command": shlex.join(["python", "bench/first_requests.py", *sys.argv[1:]]),
              "config": asdict(config), "load_s": loaded, "warm_up": warm, "warm_up_s": sum(warm.values()),
              "requests": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    machine = report["machine"]
    where = (machine.get("gpu") or {}).get("name") or f"{machine.get('cpu')}, {machine.get('cpu_count')} cores"
    lines = [f"# First requests after warm-up: {Path(args.pack).name} on {where}",
             "", f"`{report['command']}`", "", f"load {loaded:.1f} s, warm-up {report['warm_up_s']:.1f} s", "",
             "| request | prompt tokens | restored | TTFT s | total s | device allocations | compile-cache files built |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['request']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_s']:.3f} | {r['total_s']:.3f} | "
              f"{r['device_segments_allocated']} | {r['cache_files_built']} |"
              for r in rows]
    lines += ["", "Kernels built during each request (from the compile caches' new files):", ""]
    lines += [f"- {r['request']}: {', '.join(r['kernels_built']) or 'none'}" for r in rows]
    table = "\n".join(lines) + "\n"
    args.json.with_suffix(".md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
