"""Generation speed of `flashpack run`'s path on tiny and small packs, at several prompt lengths.

    python bench/generate_cpu.py --json bench/results/generate-cpu.json [--device cpu] [--threads 2]

Decode tokens/s at prompt lengths 16 / 256 / 1024 shows whether per-token cost grows with context
beyond what attention needs (it should stay nearly flat: DeltaNet state is constant-size and the QSA
indexer attends at most budget + ratio - 1 keys). Greedy, FP32 on CPU (BF16 on CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from flashpack.convert.pipeline import convert
from flashpack.convert.synth import synthesize
from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.sampling import SamplingParams


def measure(pack: Path, device: str, prompt_len: int, new_tokens: int) -> dict:
    engine = load_engine(pack, EngineConfig(device=device))
    vocab = engine.model.config.vocab_size
    prompt = torch.randint(10, vocab - 10, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.generator.generate(prompt[:8], SamplingParams(max_tokens=2))  # warm-up
    result = engine.generator.generate(prompt, SamplingParams(max_tokens=new_tokens, stop_token_ids=()))
    prefill = result.first_token_seconds
    return {
        "prompt_tokens": prompt_len, "generated": result.completion_tokens,
        "prefill_seconds": round(prefill, 4), "prefill_tok_s": round(prompt_len / prefill, 1),
        "decode_tok_s": round(result.decode_tokens_per_second, 2),
        "ms_per_token": round(1000 / result.decode_tokens_per_second, 2) if result.decode_tokens_per_second else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-lengths", default="16,256,1024")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for preset in ("tiny", "small"):
            snapshot = synthesize(preset, Path(work) / preset, seed=0)
            pack = convert(str(snapshot), Path(work) / f"{preset}.pack", progress=False)
            for length in (int(n) for n in args.prompt_lengths.split(",")):
                started = time.perf_counter()
                row = {"preset": preset, **measure(pack, args.device, length, args.new_tokens)}
                row["wall_seconds"] = round(time.perf_counter() - started, 2)
                rows.append(row)
                print(row, flush=True)
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads": args.threads, "torch": torch.__version__, "device": args.device},
        "settings": {"new_tokens": args.new_tokens, "dtype": "auto", "sampling": "greedy",
                     "experts": "decoded from the memory-mapped pack each fetch (no store)"},
        "results": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\n{'preset':<6} {'prompt':>6} {'prefill tok/s':>13} {'decode tok/s':>12} {'ms/token':>9}")
    for row in rows:
        print(f"{row['preset']:<6} {row['prompt_tokens']:>6} {row['prefill_tok_s']:>13} {row['decode_tok_s']:>12} "
              f"{row['ms_per_token']:>9}")


if __name__ == "__main__":
    main()
