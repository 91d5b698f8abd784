"""runtime/bench/kernel_classes.py on hand-made events: each device event lands in the first class
whose pattern its name holds, per-step sums and counts are exact, host events do not count."""

from __future__ import annotations

import pytest

from flashpack.runtime.bench.kernel_classes import OTHER, classify, format_classes, kernel_classes


def _event(cat: str, name: str, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": 0.0, "dur": dur, "pid": 0, "tid": 1}


def test_first_matching_class_wins():
    # a memory-efficient attention kernel's name also holds "cutlass" (a dense GEMM pattern)
    assert classify("fmha_cutlassF_bf16_aligned_32x128_gmem_sm80(PyTorchMemEffAttention)") == "attention (SDPA)"
    assert classify("nvjet_sm90_tst_128x8_64x12_4x1_v_bz_TNT") == "dense matrix-vector (cuBLAS)"
    assert classify("_gate_up_kernel") == "routed experts (NVFP4 kernels)"
    # the hyper-connection mix's first kernel also holds "_down_kernel" (the experts' pattern)
    assert classify("_mix_down_kernel") == "hyper-connection mixes (hc_mix)"
    assert classify("_matvec_kernel") == "dense matrix-vector (our matvec)"
    assert classify("void at::native::sbtopk::gatherTopK<float>") == "router and indexer top-k"
    assert classify("triton_poi_fused_add_mul_0") == "fused elementwise (Inductor)"
    assert classify("some_new_kernel") == OTHER


def test_per_step_time_and_counts():
    events = [
        _event("kernel", "nvjet_a", 10.0), _event("kernel", "gemv2T_kernel", 6.0),
        _event("kernel", "_down_kernel", 4.0), _event("gpu_memcpy", "Memcpy HtoD", 2.0),
        _event("cpu_op", "aten::mm", 500.0),  # host time is not device time
    ]
    classes = kernel_classes(events, steps=2)
    assert list(classes) == ["dense matrix-vector (cuBLAS)", "routed experts (NVFP4 kernels)", "copies and memsets"]
    assert classes["dense matrix-vector (cuBLAS)"] == {"us_per_step": 8.0, "events_per_step": 1.0}
    assert classes["copies and memsets"] == {"us_per_step": 1.0, "events_per_step": 0.5}
    assert format_classes(classes).splitlines()[-1].split()[1] == "11.0"  # the total a step


def test_steps_must_be_positive():
    with pytest.raises(ValueError, match="steps must be at least 1"):
        kernel_classes([], steps=0)
