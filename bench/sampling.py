"""What choosing a token costs per decode step, where the Generator samples: on the logits' device.

    python bench/sampling.py [--device cpu|cuda] [--vocab 248320] [--steps 200] --json OUT

For greedy, top-k and top-p (nucleus) parameters, times `Sampler(params, device)(logits)` on random
logits of the model's vocabulary (median per call, the token id read back each time, as the
Generator does). On a GPU it also times the same call after copying the logits to the host first: the
cost the Generator avoids by sampling on the logits' device. Prints a table and writes JSON: milliseconds per token.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from flashpack.runtime.sampling import Sampler, SamplingParams

CASES = {
    "greedy": SamplingParams(),
    "top-k 40": SamplingParams(temperature=0.7, top_k=40, seed=0),
    "top-p 0.95": SamplingParams(temperature=0.7, top_p=0.95, seed=0),
}


def per_call_ms(sample, logits: torch.Tensor, steps: int) -> float:
    for _ in range(5):
        sample(logits)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        sample(logits)  # returns an int: the token id is on the host when it does
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--vocab", type=int, default=248_320)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device(args.device)
    logits = torch.randn(args.vocab, generator=torch.Generator().manual_seed(0)).to(device)
    rows = []
    for name, params in CASES.items():
        row = {"case": name, "on_device_ms": per_call_ms(Sampler(params, device), logits, args.steps)}
        if device.type == "cuda":
            on_host = Sampler(params, "cpu")
            row["copied_to_host_ms"] = per_call_ms(lambda x: on_host(x.float().cpu()), logits, args.steps)
        rows.append(row)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch_threads": torch.get_num_threads(), "vocab": args.vocab, "steps": args.steps, "rows": rows,
    }
    print(f"{'case':12} {'on ' + device.type + ' ms':>12} {'via host ms':>12}")
    for row in rows:
        via_host = f"{row['copied_to_host_ms']:.3f}" if "copied_to_host_ms" in row else "-"
        print(f"{row['case']:12} {row['on_device_ms']:12.3f} {via_host:>12}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
