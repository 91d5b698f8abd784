"""What a profiled decode step's device time is spent on, by kind of kernel, from a Chrome trace.

    python -m flashpack.runtime.bench.kernel_classes TRACE.json[.gz] STEPS

Each kernel, copy or memset is put in the first class whose pattern its name contains (classes
below, in order); per step: microseconds (the sum of the events' durations) and how many events.
At batch 1 most kernels are short, so the count matters as much as the time: in a CUDA graph each
costs about half a microsecond of gap on top of its own run.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

from flashpack.runtime.bench.gaps import DEVICE_WORK, load_trace

# (class, name patterns): the first match wins, so specific patterns come before general ones
CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("hyper-connection mixes (hc_mix)", ("_mix_down_kernel", "_mix_up_kernel")),
    ("routed experts (NVFP4 kernels)", ("_gate_up_kernel", "_down_kernel", "_grouped")),
    ("dense matrix-vector (our matvec)", ("_matvec_kernel",)),
    ("dense tiles (our tile kernel)", ("_tile_kernel",)),
    ("sums of partial products (experts)", ("_sum_partials_kernel",)),
    ("router and indexer top-k", ("_router_top_k_kernel", "TopK", "SortKV", "topk")),
    ("expert staging", ("_stage_records",)),
    ("attention (split-K decode kernels)", ("_split_kernel", "_combine_kernel")),
    ("attention (SDPA)", ("fmha", "flash_fwd", "Attention")),
    ("dense matrix-vector (cuBLAS)", ("nvjet", "gemv", "gemm", "cutlass", "splitKreduce")),
    ("DeltaNet recurrence (fla)", ("gated_delta_rule", "fused_recurrent", "chunk_")),
    ("fused elementwise (Inductor)", ("triton_",)),
    ("copies and memsets", ("Memcpy", "Memset", "memcpy", "copy_kernel")),
    ("other PyTorch kernels", ("at::native",)),
)
OTHER = "other"


def classify(name: str) -> str:
    for label, patterns in CLASSES:
        if any(pattern in name for pattern in patterns):
            return label
    return OTHER


def kernel_classes(events: list[dict], steps: int) -> dict[str, dict[str, float]]:
    """{class: {"us_per_step", "events_per_step"}} over a trace's device events, largest first."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    time: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for event in events:
        if event.get("cat") in DEVICE_WORK:
            label = classify(event["name"])
            time[label] += event["dur"]
            count[label] += 1
    order = sorted(time, key=time.get, reverse=True)
    return {label: {"us_per_step": time[label] / steps, "events_per_step": count[label] / steps} for label in order}


def format_classes(classes: dict[str, dict[str, float]]) -> str:
    total = sum(c["us_per_step"] for c in classes.values())
    lines = [f"{'device time a step, by kind of kernel':<40}{'us':>9}{'share':>8}{'events':>8}"]
    for label, c in classes.items():
        lines.append(f"{label:<40}{c['us_per_step']:9.1f}{c['us_per_step'] / total:8.1%}{c['events_per_step']:8.1f}")
    lines.append(f"{'total':<40}{total:9.1f}{1:8.1%}{sum(c['events_per_step'] for c in classes.values()):8.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m flashpack.runtime.bench.kernel_classes TRACE.json[.gz] STEPS")
    result = kernel_classes(load_trace(sys.argv[1]), int(sys.argv[2]))
    print(format_classes(result))
    print(json.dumps(result))
