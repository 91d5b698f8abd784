"""Expert-store benchmark: misses and bytes per token per tier, policies against Belady, O_DIRECT.

    python bench/store.py PACK [--device cpu|cuda] [--max-tokens 32] --json bench/results/store-<pack>-<machine>.json

1. Records the routing of a held-out workload (greedy decode) and replays it through every
   policy (fixed per-layer split and rebalanced) and Belady at several slots per layer: decode
   misses per token (the offline limit next to each policy).
2. Replays the same trace through the real TieredStore at several VRAM/RAM budgets, cold and
   pre-warmed from a hot set profiled on a *different* workload: device misses, host hits, disk
   reads and bytes moved per decode token per tier, and time waiting.
3. Reads every record of the pack with O_DIRECT and buffered (cold page cache, fadvise), at 1, 4
   and 16 threads: GB/s next to each other, and O_DIRECT with each record read as one part and as
   the store reads it (StoreConfig's read_pieces parts at once), with the mean time a
   record takes on one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path

import torch

from flashpack.layout.pack import Pack
from flashpack.runtime.store import build_store
from flashpack.runtime.store.hotset import hot_set_from_trace
from flashpack.runtime.store.config import StoreConfig
from flashpack.runtime.store.reader import RecordReader, aligned_empty
from flashpack.runtime.store.simulate import replay, simulate_policy
from flashpack.runtime.store.stats import LayerCounters
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.workload import run_workload

PROFILE_PROMPTS = [
    "Explain how a bicycle gear works to a child.",
    "def merge_sorted(a, b):\n    # merge two sorted lists",
    "Write a haiku about winter mornings in the mountains.",
    "Summarise the causes of the French revolution in three sentences.",
    "SELECT name, count(*) FROM orders GROUP BY",
    "Translate to French: the library opens at nine.",
]
TEST_PROMPTS = [
    "Describe the water cycle for a school report.",
    "class LRUCache:\n    def __init__(self, capacity):",
    "Write a limerick about a cat who learned to code.",
    "What are the trade-offs between trains and planes for a 500 km trip?",
    "import numpy as np\n\ndef moving_average(x, n):",
    "Give three tips for keeping houseplants alive.",
]


def _workload(path: Path, prompts: list[str], max_tokens: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "max_tokens": max_tokens}) + "\n" for p in prompts))
    return path


def replay_through_store(store, trace) -> dict:
    """Every fetch of the trace through the store (`load`: the bytes, no dequantising: this
    measures the tiers). Counters split into prefill and decode steps."""
    split = {"prefill": LayerCounters(), "decode": LayerCounters()}
    for step in trace.steps:
        before = store.stats.total()
        for layer, experts in step.fetches:
            store.load(layer, list(experts))
        after = store.stats.total()
        bucket = split["decode" if step.tokens == 1 else "prefill"]
        for f in fields(LayerCounters):
            setattr(bucket, f.name, getattr(bucket, f.name) + getattr(after, f.name) - getattr(before, f.name))
    tokens = trace.tokens(decode_only=True)
    d = split["decode"]
    return {
        "decode_tokens": tokens,
        "device_misses_per_token": (d.requests - d.device_hits) / tokens,
        "host_hits_per_token": d.host_hits / tokens,
        "disk_reads_per_token": d.disk_reads / tokens,
        "bytes_host_to_device_per_token": d.bytes_host_to_device / tokens,
        "bytes_disk_to_host_per_token": d.bytes_disk_to_host / tokens,
        "device_hit_rate": d.device_hits / d.requests if d.requests else None,
        "prefill_disk_reads": split["prefill"].disk_reads,
        "wait_seconds": store.stats.wait_seconds,
        "read_seconds": store.stats.read_seconds,
        "prewarm_seconds": store.stats.prewarm_seconds,
    }


def copy_speed(pack: Pack, device: str) -> dict:
    """Host-cache hits only: every record is in pinned RAM, the device pool holds one layer's
    top_k, so each request is one host->device copy through the store's copy thread/stream."""
    cfg = pack.manifest.config
    stride = pack.manifest.document["experts"]["record_stride"]
    records = pack.manifest.expert_records()
    layers = sorted({r.layer for r in records})
    store = build_store(pack, StoreConfig(vram_budget=cfg.num_experts_per_tok * stride, rebalance=False), device,
                        device_reserved=0)
    store.prewarm({layer: [r.expert for r in records if r.layer == layer] for layer in layers})
    store.stats.reset()
    start = time.perf_counter()
    for layer in layers:
        experts = sorted({r.expert for r in records if r.layer == layer})
        for first in range(0, len(experts), cfg.num_experts_per_tok):
            store.load(layer, experts[first:first + cfg.num_experts_per_tok])
    seconds = time.perf_counter() - start
    total = store.stats.total()
    store.close()
    return {"device": device, "copies": total.host_hits, "bytes": total.bytes_host_to_device, "seconds": seconds,
            "GBps": total.bytes_host_to_device / seconds / 1e9, "disk_reads": total.disk_reads}


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_speed(root: Path, records: list[tuple[str, int]], stride: int, threads: int, direct: bool,
               pieces: int = 1) -> dict:
    """GB/s reading every (file, offset) record once, in the given (shuffled) order, cold cache;
    `pieces`: parts each record's read is split into (the store's reader: StoreConfig.read_pieces)."""
    files = sorted({file for file, _ in records})
    for file in files:
        _drop_cache(root / file)
    reader = RecordReader(root, files, direct=direct, pieces=pieces, callers=threads)
    buffers = [aligned_empty(stride) for _ in range(threads)]
    chunks = [records[i::threads] for i in range(threads)]

    def work(index: int) -> None:
        for file, offset in chunks[index]:
            reader.read(file, offset, [buffers[index]], stride)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))
    seconds = time.perf_counter() - start
    reader.close()
    return {"threads": threads, "pieces": pieces, "direct": reader.direct, "records": len(records),
            "record_bytes": stride, "seconds": seconds, "GBps": len(records) * stride / seconds / 1e9,
            "ms_per_record_per_thread": seconds / len(records) * threads * 1e3, "fallback": reader.fallback_reason}


def io_table(label: str, root: Path, records: list[tuple[str, int]], stride: int, results: list) -> None:
    pieces = StoreConfig().read_pieces  # as the store reads by default
    print(f"\n## {label}: {len(records)} records of {stride} bytes, each read once, random order, cold cache\n")
    print(f"| threads | O_DIRECT GB/s (ms a record) | O_DIRECT in {pieces} parts GB/s (ms a record) "
          "| buffered GB/s |")
    print("| --- | --- | --- | --- |")
    for threads in (1, 4, 16):
        direct = read_speed(root, records, stride, threads, True)
        parted = read_speed(root, records, stride, threads, True, pieces=pieces)
        buffered = read_speed(root, records, stride, threads, False)
        for row in (direct, parted, buffered):
            row["label"] = label
        results += [direct, parted, buffered]
        print(f"| {threads} | {direct['GBps']:.3f} ({direct['ms_per_record_per_thread']:.2f}) | "
              f"{parted['GBps']:.3f} ({parted['ms_per_record_per_thread']:.2f}) | {buffered['GBps']:.3f} |")


def real_size_file(directory: Path, megabytes: int) -> tuple[Path, list[tuple[str, int]], int]:
    """A scratch file of real-model-sized records (2,764,816 bytes, stride 676 pages)."""
    stride = 676 * 4096
    count = max(1, megabytes * (1 << 20) // stride)
    path = directory / "records.bin"
    block = os.urandom(stride)
    with open(path, "wb") as handle:
        for _ in range(count):
            handle.write(block)
        os.fsync(handle.fileno())
    order = list(range(count))
    random.Random(0).shuffle(order)
    return path, [(path.name, i * stride) for i in order], stride


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pack", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--capacities", default="", help="slots per layer to replay, comma-separated")
    parser.add_argument("--io-file-mb", type=int, default=1024,
                        help="also time a scratch file of real-size records beside the pack (0: skip)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--trace-out", type=Path, help="also write the test workload's routing trace here")
    parser.add_argument("--only-io", action="store_true", help="just the copy and read-speed sections")
    parser.add_argument("--io-records", type=int, default=0, help="read this many of the pack's records (0: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only contend (25x slower on a busy 2-core VM)
    pack = Pack.open(args.pack)
    cfg = pack.manifest.config
    top_k, experts = cfg.num_experts_per_tok, cfg.num_experts
    stride = pack.manifest.document["experts"]["record_stride"]
    results: dict = {"pack": str(args.pack), "machine": platform.node(), "device": args.device,
                     "num_experts": experts, "top_k": top_k, "record_stride": stride}
    if not args.only_io:
        routing_sections(args, pack, results)
    io_sections(args, pack, results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))


def routing_sections(args, pack: Pack, results: dict) -> None:
    cfg = pack.manifest.config
    top_k, experts = cfg.num_experts_per_tok, cfg.num_experts
    stride = pack.manifest.document["experts"]["record_stride"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        config = EngineConfig(device=args.device)
        profile_trace = run_workload(args.pack, _workload(tmp / "p.jsonl", PROFILE_PROMPTS, args.max_tokens), config,
                                     max_tokens=args.max_tokens)
        trace = run_workload(args.pack, _workload(tmp / "t.jsonl", TEST_PROMPTS, args.max_tokens), config,
                             max_tokens=args.max_tokens)
        results["trace_seconds"] = time.perf_counter() - start
    if args.trace_out:
        trace.save(args.trace_out)
    layers = trace.layers
    results["decode_tokens"] = trace.tokens(decode_only=True)
    capacities = [int(c) for c in args.capacities.split(",") if c] or sorted(
        {top_k, top_k + 2, 2 * top_k, experts // 4, experts // 2})
    report = replay(trace, capacities, decode_only=True)
    results["replay"] = report.to_dict()
    print("## policies vs Belady (decode misses per token, all layers)\n")
    print(report.table())
    decode = list(trace.fetches(decode_only=True))
    tokens = trace.tokens(decode_only=True)
    results["rebalancing"] = []
    print("\n## LFU: even split vs rebalanced (ghost-hit and hit-rate signals), misses per decode token\n")
    print("| slots/layer | even | ghost | hit-rate |\n| --- | --- | --- | --- |")
    for capacity in capacities:
        row = {"capacity": capacity}
        for name, adaptive, signal in (("even", False, "ghost"), ("ghost", True, "ghost"),
                                       ("hit-rate", True, "hit-rate")):
            misses = simulate_policy(decode, layers, capacity, "lfu", adaptive, floor=top_k, signal=signal)
            row[name] = sum(misses.values()) / tokens
        results["rebalancing"].append(row)
        print(f"| {capacity} | {row['even']:.2f} | {row['ghost']:.2f} | {row['hit-rate']:.2f} |")

    profile = hot_set_from_trace(profile_trace)
    ranked = {e["layer"]: e["experts"] for e in profile["layers"]}
    counts = {e["layer"]: e["counts"] for e in profile["layers"]}
    n = len(layers)
    budgets = [(top_k + 2, top_k + 2), (top_k + 2, experts // 2), (2 * top_k, experts // 2),
               (experts // 2, experts), (experts // 4, experts // 4)]
    results["store"] = []
    print("\n## TieredStore on the same trace (per decode token)\n")
    print("| VRAM slots/layer | RAM slots/layer | pre-warm | device misses | disk reads | MB host->device | "
          "MB disk->host | device hit rate |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for device_per_layer, host_per_layer in budgets:
        for warm in (False, True):
            config = StoreConfig(vram_budget=device_per_layer * n * stride, ram_budget=host_per_layer * n * stride)
            store = build_store(pack, config, args.device, device_reserved=0)
            if warm:
                store.prewarm(ranked, counts)
            row = replay_through_store(store, trace)
            store.close()
            row.update({"vram_slots_per_layer": device_per_layer, "ram_slots_per_layer": host_per_layer,
                        "prewarm": warm})
            results["store"].append(row)
            print(f"| {device_per_layer} | {host_per_layer} | {'yes' if warm else 'no'} | "
                  f"{row['device_misses_per_token']:.2f} | {row['disk_reads_per_token']:.2f} | "
                  f"{row['bytes_host_to_device_per_token'] / 1e6:.2f} | "
                  f"{row['bytes_disk_to_host_per_token'] / 1e6:.2f} | "
                  f"{row['device_hit_rate']:.3f} |")



def io_sections(args, pack: Pack, results: dict) -> None:
    stride = pack.manifest.document["experts"]["record_stride"]
    results["copy"] = copy_speed(pack, args.device)
    copy = results["copy"]
    print(f"\n## host->device copies through the store ({args.device}): {copy['copies']} records, "
          f"{copy['GBps']:.2f} GB/s ({copy['seconds'] / max(copy['copies'], 1) * 1e6:.0f} us each)")
    results["io"] = []
    entries = [(e.file, e.offset) for e in pack.manifest.expert_records()]
    random.Random(0).shuffle(entries)
    entries = entries[:args.io_records or None]
    io_table("pack records", pack.root, entries, stride, results["io"])
    if args.io_file_mb:
        with tempfile.TemporaryDirectory(dir=args.pack.parent) as scratch:
            path, records, real_stride = real_size_file(Path(scratch), args.io_file_mb)
            io_table("real-size records", path.parent, records, real_stride, results["io"])


if __name__ == "__main__":
    main()
