"""Host time the tiered store spends per decode layer beyond the kernels, which the GPU idles for.

    python bench/store_overhead.py PACK [--device cpu|cuda] [--calls 2000] [--decode-steps 300] --json OUT

Two measurements. Every requested expert already in the device pool: a store whose device pool
holds every record of the pack's first layer, pre-warmed, timing `stream(layer, experts)` (the
engine's call: pin, await, yield, release) for random top-k sets of that layer, median of batches;
and `record_step` for one layer's top-k, all found on the device (what a decode step from the slot
table pays per layer to count what it used).

And decode layers through the store as at 8/32: a device pool of top_k slots a layer in front of a
host cache holding every record (no disk reads, so the figures are the store's own), each layer
streaming its top-k (experts drawn by a skewed popularity) with the next layer's guess to prefetch
(7 of its picks and 3 others: right about as often as on the H200), timed per layer in total and in
the store's request, prefetch and await; once with a decode layer's copies enqueued by the calling
thread (the default) and once handed to the copy thread (a second store, built with
StoreConfig.copy_on_requesting_thread off), median of four runs each.

And a short prompt's layers (a follow-up's new tokens after a restored state) through a device share
of `--prompt-share` of a layer's experts (0.28: 24/64's with FP8 dense weights, PERFORMANCE.md) in
front of a host cache holding every record: each layer streams the union of `--prompt-tokens`
tokens' top-k picks (uniform), which is larger than its share, so the store admits the misses half
a share at a time with the chunk being consumed still pinned, and evicts as it goes; milliseconds per
layer, median of the last 100 of 200 layers (the first fill the share and the policy's history).
Its figure matters on a pack of many experts (the real model's 512), where the pins are many.

Prints and writes JSON: microseconds per call, per expert and per decode layer; milliseconds per
prompt layer.
"""

from __future__ import annotations

import argparse
import functools
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
from flashpack.runtime.store.config import StoreConfig

BATCH = 100


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pack")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--decode-steps", type=int, default=300, help="steps of all layers, per run")
    parser.add_argument("--prompt-tokens", type=int, default=91, help="a short prompt's tokens (the prompt layers)")
    parser.add_argument("--prompt-share", type=float, default=0.28, help="a layer's device share, of its experts")
    parser.add_argument("--json")
    args = parser.parse_args()
    pack = Pack.open(args.pack)
    manifest = pack.manifest
    cfg, stride = manifest.config, manifest.document["experts"]["record_stride"]
    layer = min(r.layer for r in manifest.expert_records())
    experts, top_k = cfg.num_experts, cfg.num_experts_per_tok
    records = len(manifest.expert_records())
    rng = random.Random(0)
    config = StoreConfig(vram_budget=records * stride, ram_budget=records * stride, rebalance=False)
    with build_store(pack, config, args.device, device_reserved=0) as store:
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
    calling = decode_layers(pack, args.device, args.decode_steps, copies_on_calling_thread=True)
    handed = decode_layers(pack, args.device, args.decode_steps, copies_on_calling_thread=False)
    result["decode_layer_us"] = {"copies_on_calling_thread": calling, "copies_on_copy_thread": handed,
                                 "ratio": handed["total"] / calling["total"]}
    result["prompt_layer_ms"] = prompt_layers(pack, args.device, args.prompt_tokens, args.prompt_share)
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


def decode_layers(pack: Pack, device: str, steps: int, copies_on_calling_thread: bool) -> dict[str, float]:
    """Microseconds a decode layer spends in the store (total, and in its request, prefetch and await),
    median of 4 runs."""
    manifest = pack.manifest
    cfg, stride = manifest.config, manifest.document["experts"]["record_stride"]
    layers = sorted({r.layer for r in manifest.expert_records()})
    experts, top_k = cfg.num_experts, cfg.num_experts_per_tok
    rng = random.Random(0)
    popularity = [1 / (rank + 1) ** 0.8 for rank in range(experts)]

    def picks() -> list[int]:
        chosen: set[int] = set()
        while len(chosen) < top_k:
            chosen.add(rng.choices(range(experts), popularity)[0])
        return sorted(chosen)

    runs = []
    config = StoreConfig(vram_budget=len(layers) * top_k * stride, ram_budget=len(manifest.expert_records()) * stride,
                         copy_on_requesting_thread=copies_on_calling_thread)
    with build_store(pack, config, device, device_reserved=0) as store:
        store.prewarm({layer: list(range(experts)) for layer in layers})
        timed = {"request": (store.admission, "request"), "prefetch": (store, "prefetch"), "await": (store, "_await")}
        spent = {name: 0.0 for name in timed}
        for name, (owner, method) in timed.items():
            setattr(owner, method, _timed(getattr(owner, method), spent, name))
        for run in range(5):  # the first warms up
            plan = [[picks() for _ in layers] for _ in range(steps)]
            for name in spent:
                spent[name] = 0.0
            start = time.perf_counter()
            for wanted in plan:
                for index, layer in enumerate(layers):
                    ahead = None
                    if index + 1 < len(layers):
                        ahead = (layers[index + 1], sorted(set(wanted[index + 1][:7]) | set(picks()[:3])))
                    with closing(store.stream(layer, wanted[index], ahead)) as chunks:
                        for _ in chunks:
                            pass
            calls = steps * len(layers)
            if run:
                runs.append({"total": (time.perf_counter() - start) / calls * 1e6,
                             **{name: seconds / calls * 1e6 for name, seconds in spent.items()}})
    return {name: statistics.median(run[name] for run in runs) for name in runs[0]}


def prompt_layers(pack: Pack, device: str, tokens: int, share: float) -> dict[str, float]:
    """Milliseconds the store spends on a short prompt's layer (module docstring)."""
    manifest = pack.manifest
    cfg, stride = manifest.config, manifest.document["experts"]["record_stride"]
    layers = sorted({r.layer for r in manifest.expert_records()})
    experts, top_k = cfg.num_experts, cfg.num_experts_per_tok
    slots = max(top_k, round(share * experts))
    rng = random.Random(0)
    config = StoreConfig(vram_budget=len(layers) * slots * stride, ram_budget=len(manifest.expert_records()) * stride,
                         rebalance=False)
    timed = []
    with build_store(pack, config, device, device_reserved=0) as store:
        store.prewarm({layer: list(range(experts)) for layer in layers})
        for index in range(200):
            wanted = sorted(set().union(*(rng.sample(range(experts), top_k) for _ in range(tokens))))
            start = time.perf_counter()
            with closing(store.stream(layers[index % len(layers)], wanted)) as chunks:
                for _ in chunks:
                    pass
            timed.append((time.perf_counter() - start) * 1e3)
    return {"tokens": tokens, "share_slots": slots, "experts_a_layer": experts,
            "median": statistics.median(timed[100:])}


def _timed(method, spent: dict[str, float], name: str):
    @functools.wraps(method)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start
    return timed


if __name__ == "__main__":
    main()
