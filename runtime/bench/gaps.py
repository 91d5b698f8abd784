"""Where the GPU waits during profiled decode steps, from a torch.profiler Chrome trace.

    python -m flashpack.runtime.bench.gaps TRACE.json[.gz]      (bench/profile_decode.py --trace)

Figures are per step: the caller says how many steps the trace holds, or each `cudaGraphLaunch`
counts as one (a decode step from one graph: resident, or tiered from the slot table). The GPU is busy while any kernel, copy or memset runs on any
stream (their union); it is idle in the gaps between, from its first event to its last. Idle
time is then split by what the host's main thread (the one that issued the most operators) was
doing: launching a graph, running a top-level operator (by name: `aten::item` is a read-back,
`aten::linear` an eager layer), or nothing the profiler records (Python between operators, or
waiting for the GIL). Times are in microseconds, under the profiler, which slows the host: read
them as shares, not as unprofiled times.
"""

from __future__ import annotations

import gzip
import json
import sys
from bisect import bisect_right
from collections import Counter, defaultdict
from pathlib import Path

DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CALLS = ("cpu_op", "cuda_runtime", "cuda_driver")
LAUNCH = "cudaGraphLaunch"
UNRECORDED = "(no operator: Python or the GIL)"


def load_trace(path: str | Path) -> list[dict]:
    """The complete ("X") events of a Chrome trace file, gzipped or not."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as file:
        return [e for e in json.load(file)["traceEvents"] if e.get("ph") == "X"]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def _top_level(events: list[dict]) -> list[dict]:
    """Events not nested inside an earlier one (one thread's events, sorted by start)."""
    top, end = [], float("-inf")
    for event in sorted(events, key=lambda e: e["ts"]):
        if event["ts"] >= end:
            top.append(event)
            end = event["ts"] + event["dur"]
    return top


def gpu_gaps(events: list[dict], steps: int | None = None, top: int = 8) -> dict:
    """Per-step span, GPU busy and idle time, idle time by what the main thread did (the `top`
    largest), from a trace's complete events."""
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE_WORK])
    host = [e for e in events if e.get("cat") in HOST_CALLS]
    if not busy or not host:
        raise ValueError("the trace has no GPU work or no host calls: was it profiled on a GPU?")
    main = Counter(e["tid"] for e in host).most_common(1)[0][0]
    calls = _top_level([e for e in host if e["tid"] == main])
    steps = steps or sum(e["name"] == LAUNCH for e in calls) or 1
    gaps = [(end, start) for (_, end), (start, _) in zip(busy, busy[1:])]
    # top-level calls do not overlap, so their ends ascend with their starts: each gap visits
    # only the calls that overlap it (a prompt's trace holds tens of thousands of gaps and calls)
    ends = [call["ts"] + call["dur"] for call in calls]
    idle_by: dict[str, float] = defaultdict(float)
    for gap in gaps:
        covered = 0.0
        index = bisect_right(ends, gap[0])
        while index < len(calls) and calls[index]["ts"] < gap[1]:
            call = calls[index]
            share = _overlap(gap, (call["ts"], ends[index]))
            idle_by[call["name"]] += share
            covered += share
            index += 1
        idle_by[UNRECORDED] += (gap[1] - gap[0]) - covered
    span = busy[-1][1] - busy[0][0]
    idle = sum(end - start for start, end in gaps)
    ranked = sorted(idle_by.items(), key=lambda item: -item[1])[:top]
    return {
        "steps": steps,
        "span_us": span / steps,
        "gpu_busy_us": (span - idle) / steps,
        "gpu_idle_us": idle / steps,
        "idle_by_host_call_us": {name: seconds / steps for name, seconds in ranked},
    }


def format_gaps(summary: dict) -> str:
    lines = [f"{summary['steps']} steps: {summary['span_us']:.0f} us a step, GPU busy {summary['gpu_busy_us']:.0f} us, "
             f"idle {summary['gpu_idle_us']:.0f} us; idle while the host ran:"]
    lines += [f"  {us:8.0f} us  {name}" for name, us in summary["idle_by_host_call_us"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m flashpack.runtime.bench.gaps TRACE.json[.gz]")
    print(format_gaps(gpu_gaps(load_trace(sys.argv[1]))))
