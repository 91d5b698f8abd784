"""runtime/bench/gaps.py on a hand-made trace: two steps whose GPU busy time, idle time and idle
split by the main thread's calls are known exactly; another thread's calls do not count."""

from __future__ import annotations

import gzip
import json

import pytest

from flashpack.runtime.bench.gaps import UNRECORDED, gpu_gaps, load_trace

MAIN, COPIER = 1, 2


def _event(cat: str, name: str, ts: float, dur: float, tid: int = MAIN) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def _trace() -> list[dict]:
    events = []
    for start in (0.0, 1000.0):  # two steps of 1000 us
        events += [
            _event("cuda_runtime", "cudaGraphLaunch", start, 100),  # GPU idle while launching
            _event("kernel", "layer", start + 100, 500, tid=7),
            _event("kernel", "staging", start + 300, 400, tid=8),  # overlaps: busy 100..700
            _event("cpu_op", "aten::item", start + 100, 620),  # waits for the GPU, then 20 us idle
            _event("cpu_op", "aten::add", start + 110, 5),  # nested in aten::item: not top level
            _event("cpu_op", "aten::linear", start + 750, 150),  # idle while issuing eagerly
            _event("cuda_runtime", "cudaMemcpyAsync", start + 800, 200, tid=COPIER),
        ]
    events.append(_event("kernel", "lm_head", 1950.0, 50, tid=7))  # the last GPU work ends the span
    events += [_event("cpu_op", "aten::mul", t, 1) for t in (2100.0, 2101.0, 2102.0)]  # MAIN issues most
    return events


def test_idle_time_is_split_by_what_the_main_thread_ran():
    summary = gpu_gaps(_trace(), steps=2)
    assert summary["span_us"] == pytest.approx(1900 / 2)  # the GPU's first to last event, 100 .. 2000
    # busy: 100..700 and 1100..1700 and 1950..2000 = 1250; idle: 700..1100 and 1700..1950 = 650
    assert summary["gpu_busy_us"] == pytest.approx(1250 / 2)
    assert summary["gpu_idle_us"] == pytest.approx(650 / 2)
    idle = summary["idle_by_host_call_us"]
    # gap 700..1100: item 700..720, linear 750..900, launch 1000..1100, nothing 170 us
    # gap 1700..1950: item 1700..1720, linear 1750..1900, nothing 80 us
    assert idle["cudaGraphLaunch"] == pytest.approx(100 / 2)
    assert idle["aten::linear"] == pytest.approx(300 / 2)
    assert idle["aten::item"] == pytest.approx(40 / 2)
    assert idle[UNRECORDED] == pytest.approx(210 / 2)
    assert "cudaMemcpyAsync" not in idle and "aten::add" not in idle
    assert gpu_gaps(_trace())["steps"] == 2  # counted from the graph launches when not given


def test_a_trace_file_round_trips_and_a_cpu_only_trace_is_refused(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as file:
        json.dump({"traceEvents": _trace() + [{"ph": "M", "name": "process_name"}]}, file)
    assert gpu_gaps(load_trace(path), steps=2) == gpu_gaps(_trace(), steps=2)
    with pytest.raises(ValueError, match="no GPU work"):
        gpu_gaps([e for e in _trace() if e["cat"] != "kernel"])
