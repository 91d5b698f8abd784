"""What a fresh process pays before it answers quickly: loading, warm-up, first requests, short runs.

    python bench/startup.py PACK --mode load        # load_engine: seconds, expert bytes, GB/s
    python bench/startup.py PACK --mode requests --lengths 12,6900,12,6900,5000 [--warm-up]
    python bench/startup.py PACK --mode one-shot --tokens 24 [--no-cuda-graphs]

`requests` times prompt + 2 decode tokens for each length in turn, in one process, so the first of
each kind shows what compiling and tuning cost against the repeats; with `--warm-up` the engine's
warm-up runs first and is timed. `one-shot` is `flashpack run`'s path: load, one prompt, N tokens.
Run each mode in a fresh process (the script does one mode per process); point TRITON_CACHE_DIR
and TORCHINDUCTOR_CACHE_DIR at empty folders to see a fresh machine. Appends one JSON line to
--json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.sampling import SamplingParams


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    return torch.randint(10, vocab - 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack", type=Path)
    parser.add_argument("--mode", choices=["load", "requests", "one-shot"], required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", default="12,6900,12,6900,5000,7300,300,3000")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--warm-up", action="store_true")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--label", default="")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    started = time.perf_counter()
    engine = load_engine(args.pack, EngineConfig(device=args.device, cuda_graphs=not args.no_cuda_graphs))
    _sync()
    loaded = time.perf_counter() - started
    row: dict = {"mode": args.mode, "label": args.label, "load_seconds": round(loaded, 3)}
    records = engine.pack.manifest.expert_records()
    record_bytes = sum(r.length for r in records)
    row["expert_gb"] = round(record_bytes / 1e9, 3)
    row["expert_gb_per_s_over_load"] = round(record_bytes / 1e9 / loaded, 3)
    vocab = engine.model.config.vocab_size
    if args.warm_up:
        begin = time.perf_counter()
        row["warm_up"] = engine.warm_up()
        row["warm_up_seconds"] = round(time.perf_counter() - begin, 3)
    if args.mode == "requests":
        timings = []
        for index, length in enumerate(int(n) for n in args.lengths.split(",")):
            begin = time.perf_counter()
            result = engine.generator.generate(_prompt(vocab, length, index), SamplingParams(max_tokens=3))
            _sync()
            timings.append({"prompt_tokens": length, "seconds": round(time.perf_counter() - begin, 3),
                            "first_token_seconds": round(result.first_token_seconds, 3)})
            print(timings[-1], flush=True)
        row["requests"] = timings
    elif args.mode == "one-shot":
        result = engine.generator.generate(_prompt(vocab, 12, 0), SamplingParams(max_tokens=args.tokens))
        row.update(first_token_seconds=round(result.first_token_seconds, 3), tokens=result.completion_tokens,
                   decode_tok_s=round(result.decode_tokens_per_second, 2),
                   total_seconds=round(result.total_seconds, 3))
    row["process_seconds"] = round(time.perf_counter() - started, 3)
    print(json.dumps(row), flush=True)
    with open(args.json, "a") as out:
        out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
