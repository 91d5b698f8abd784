"""Host time the tiered store spends per decode layer when every requested expert is already in the
device pool: what a tiered decode step pays per layer beyond the kernels, and the GPU idles for.

    python bench/store_overhead.py PACK [--device cpu|cuda] [--calls 2000] --json OUT

Builds a store whose device pool holds every record of the pack's first layer, pre-warms it, then
times `stream(layer, experts)` (the engine's call: pin, await, yield, release) for random top-k
sets of that layer, median of batches; and `record_step` for one layer's top-k, all found on the
device (what a decode step from the slot table pays per layer to count what it used). Prints and
writes JSON: microseconds per call and per expert.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from contextlib import closing
from pathlib import Path

import torch

from flashpack.layout.pack import Pack
from flashpack.runtime.store import build_store

BATCH = 100


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pack")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json")
    args = parser.parse_args()
    pack = Pack.open(args.pack)
    manifest = pack.manifest
    cfg, stride = manifest.config, manifest.document["experts"]["record_stride"]
    layer = min(r.layer for r in manifest.expert_records())
    experts, top_k = cfg.num_experts, cfg.num_experts_per_tok
    records = len(manifest.expert_records())
    rng = random.Random(0)
    with build_store(pack, vram_budget=records * stride, ram_budget=records * stride, device=args.device,
                     device_reserved=0, rebalance=False) as store:
        store.prewarm({layer: list(range(experts))})
        batches, recorded = [], []
        for _ in range(max(1, args.calls // BATCH)):
            requests = [sorted(rng.sample(range(experts), top_k)) for _ in range(BATCH)]
            start = time.perf_counter()
            for wanted in requests:
                with closing(store.stream(layer, wanted)) as chunks:
                    for _ in chunks:
                        pass
            batches.append((time.perf_counter() - start) / BATCH)
            start = time.perf_counter()
            for wanted in requests:
                store.record_step([(layer, wanted, [], 0)])
            recorded.append((time.perf_counter() - start) / BATCH)
        hits = store.stats.total().device_hits
    per_call = statistics.median(batches)
    result = {
        "pack": str(args.pack), "device": args.device, "machine": platform.node(), "top_k": top_k,
        "calls": len(batches) * BATCH, "device_hits": hits, "us_per_call": per_call * 1e6,
        "us_per_expert": per_call * 1e6 / top_k, "us_per_record_step_layer": statistics.median(recorded) * 1e6,
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
