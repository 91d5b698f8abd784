"""Kernel benchmark on one CUDA GPU: each Triton kernel against its reference at the real dims.

    python bench/kernels.py --json $OUT/kernels.json [--sweep]

Needs torch + triton + CUDA; no install of flashpack (the repository root is the package, so the
script loads it from here under the name `flashpack` when it is not importable). Real dims:
H = 2560, I = 640, 512 experts per layer, top-10; FP8 matrix 8192 x 2560.

  decode    1 token, 10 experts: matvec kernels; also 2..32 tokens, matvec vs grouped (crossover)
  prefill   2048 tokens: grouped W4A16 kernels (bf16 tensor cores)
  fp8       8192 x 2560 row-scaled: matvec (1 token), matvec against tile GEMM (3, 5, 8), tile GEMM (2048)
  fp8-few   a checked step's FP8 projections (DeltaNet's stacked input and its output projection, the
            attention's query, the shared expert's gate and up) at 1, 3, 5 and 8 tokens: the matvec
            against the tile kernel's few-token tiles (fp8_linear.tile_blocks), against BF16 cuBLAS;
            --sweep also times a grid of few-token tiles
  staging   5 and 10 records from pinned host memory into device rows: the stage_records kernel
            (reads over PCIe from the SMs) against the copy engine (one copy_ per record), both
            in a graph, GB/s held against one large pinned host-to-device copy
  router    softmax + top-10 of 512 + renormalise for 1 token: the router_top_k kernel against torch
  dense     the BF16 products of a decode layer (real shapes) at 1 token and at a checked step's 2, 3
            and 5: matvec.py's kernels against cuBLAS, each matrix rotated past the L2
  dense-few the BF16 products of a checked step beside FP8 projections (the hyper-connections', the
            router's stack, DeltaNet's b and a, the indexer's) and a few of a BF16 pack's, at 2-16
            tokens: cuBLAS, the matvec and the tile kernel's few-token tiles (tile_linear.py); --sweep
            also times a grid of column splits, tiles and launches
  attention one token's masked QSA attention (capacity 600 and 32768): decode_attention's split-K
            kernels against the SDPA call attend_step made before
  hc-mix    a hyper-connection mix (hc = 4, rank 320, with injection) for 1, 3 and 5 tokens: hc_mix's
            two kernels against the module's code compiled by torch.compile, 8 mixers rotated (106 MB,
            more than the L2), both in a CUDA graph
  delta-steps a checked step's DeltaNet recurrence (16 key heads, 32 value heads of 128) at 2, 3, 5, 8
            and 16 tokens, the state after each kept: delta_rule_steps' one launch against
            flash-linear-attention's recurrent kernel a token at a time and the states stacked, checked
            against it (states 1e-5, bf16 outputs 2^-7 relative; needs fla-core)
  eager-pieces  pieces a prompt step issues from the host in every layer, one call at a time on an
            idle GPU (an eager step's pace): the grouped experts' tile plan (tile_plan.py) against its
            torch reference for 92 and 2,048 tokens' top-10 over a resident bank of 16 layers' 8,192
            rows (equal exactly), and the RMS norm kernel (rms_norm.py) against the module's code on
            a hyper-connection row of 92 tokens (4 x H, grouped by H) and on 92 tokens' 32 heads of 128

Bytes moved count what a kernel must read and write: each selected expert's record data
(2,764,800 bytes) once, the distinct experts once for the grouped path, plus activations and
scratch. GB/s is set against a device-to-device copy measured in the same run (the practical
roofline) and the 4.8 TB/s datasheet peak; TFLOP/s against a bf16 matmul measured here. "us" is
GPU time per call: many calls on rotated inputs (a new expert set or matrix copy each, so the 60 MB
L2 does not serve them) captured in one CUDA graph, median replay / calls; references that sync
with the host are timed eagerly. "eager us" is one call on an idle GPU, launch overhead included,
what an engine pays without graphs. Each Triton result is checked against the plain-PyTorch
reference (and a float64 one) at full size; the exit status is 1 if any check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
HBM_PEAK_GBS = 4800.0
H, I, EXPERTS, TOP_K = 2560, 640, 512, 10
FP8_ROWS, FP8_COLS = 8192, 2560
PREFILL_TOKENS = 2048


def import_flashpack():
    """The checkout this script sits in, as `flashpack` (pip install -e . not needed)."""
    try:
        import flashpack  # noqa: F401
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "flashpack", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["flashpack"] = module
        spec.loader.exec_module(module)
    import flashpack

    return flashpack


def eager_ms(fn, repeats: int, warmup: int = 2) -> float:
    """Median of `repeats` event-timed single calls fn(i), the GPU idle before each: launch overhead
    included, as an engine without CUDA graphs pays it."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    times = []
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(warmup + i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fn, calls: int, replays: int = 7) -> float:
    """GPU time of one call: fn(0) .. fn(calls - 1) (rotated inputs) captured in one CUDA graph, the
    median replay divided by `calls`. No launch gaps: this is the kernel's own time."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(2):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


class Report:
    def __init__(self, copy_gbs: float, bf16_tflops: float, sweep_seconds: float = 0.0):
        self.copy_gbs, self.bf16_tflops = copy_gbs, bf16_tflops
        self.sweep_seconds, self.sweep_deadline = sweep_seconds, 0.0
        self.rows: list[dict] = []
        self.checks: list[dict] = []

    def timing(self, case: str, impl: str, ms: float, bytes_moved: int, flops: int = 0, **extra) -> None:
        """ms: GPU time of one call (graph replay) unless the impl syncs with the host (then eager)."""
        gbs = bytes_moved / ms / 1e6
        extra = {k: round(v, 1) if isinstance(v, float) else v for k, v in extra.items()}
        row = {
            "case": case, "impl": impl, "us": round(ms * 1e3, 2), "bytes": bytes_moved, "gb_s": round(gbs, 1),
            "pct_copy": round(100 * gbs / self.copy_gbs, 1), "pct_peak": round(100 * gbs / HBM_PEAK_GBS, 1),
            "tflop_s": round(flops / ms / 1e9, 1) if flops else None, **extra,
        }
        self.rows.append(row)
        print(f"  {case:<24}{impl:<58}{row['us']:>10.1f} us{row['gb_s']:>8.0f} GB/s"
              f"{row['tflop_s'] or '':>8}{'  eager ' + str(row['eager_us']) if 'eager_us' in row else ''}", flush=True)

    def start_sweep(self) -> None:
        self.sweep_deadline = time.time() + self.sweep_seconds

    def sweeping(self) -> bool:
        """Whether this section's sweep still has time (each section gets --sweep-seconds)."""
        return time.time() < self.sweep_deadline

    def check(self, case: str, error: float, tolerance: float, against: str) -> None:
        self.checks.append({"case": case, "against": against, "rel_err": error, "tol": tolerance,
                            "ok": bool(error <= tolerance)})
        print(f"  check {case:<36}{against:<22}{error:.2e} <= {tolerance:.0e}: {error <= tolerance}", flush=True)

    def print(self) -> None:
        print(f"\ncopy roofline {self.copy_gbs:.0f} GB/s (datasheet {HBM_PEAK_GBS:.0f}); "
              f"bf16 matmul {self.bf16_tflops:.0f} TFLOP/s")
        print(f"{'case':<22}{'impl':<32}{'us':>10}{'eager us':>10}{'MB':>9}{'GB/s':>8}{'%copy':>7}{'TFLOP/s':>9}")
        for r in sorted(self.rows, key=lambda r: r["case"].startswith("sweep")):
            print(f"{r['case']:<22}{r['impl']:<32}{r['us']:>10.1f}{r.get('eager_us', ''):>10}{r['bytes'] / 1e6:>9.1f}"
                  f"{r['gb_s']:>8.0f}{r['pct_copy']:>7.1f}{r['tflop_s'] or '':>9}")
        print(f"\n{'check':<34}{'against':<26}{'rel_err':>10}{'tol':>9}  ok")
        for c in self.checks:
            print(f"{c['case']:<34}{c['against']:<26}{c['rel_err']:>10.2e}{c['tol']:>9.0e}  {c['ok']}")


def measure_rooflines(device) -> tuple[float, float]:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    deadline = time.time() + 1.0  # raise the clocks from idle before anything is timed
    while time.time() < deadline:
        a @ b
        torch.cuda.synchronize()
    mm_ms = graph_ms(lambda i: a @ b, calls=4)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    # Eager: inside a graph the copy became a memcpy node that ran at ~2.7 TB/s against ~4.1 eager.
    copy_ms = eager_ms(lambda i: dst.copy_(src), repeats=10)
    return 2 * (1 << 30) / copy_ms / 1e6, 2 * 8192**3 / mm_ms / 1e9


def random_bank(device, seed: int = 0):
    """512 random records in a device slot pool laid out as FORMAT.md says; weights ~ 0.02 in size."""
    from flashpack.layout.records import RECORD_MAGIC, RecordGeometry
    from flashpack.runtime.kernels import ExpertBank

    geometry = RecordGeometry(H, I)
    generator = torch.Generator(device).manual_seed(seed)
    pool = torch.randint(0, 256, (EXPERTS, geometry.stride), dtype=torch.uint8, device=device, generator=generator)
    bank = ExpertBank.from_pool(pool, geometry)
    for projection in ("gate", "up", "down"):
        scales = bank.scales(projection)
        values = torch.rand(scales.shape, device=device, generator=generator) * 432 + 16
        scales.copy_(values.to(torch.float8_e4m3fn))
    bank.global_scales.copy_(torch.full((EXPERTS, 3), 0.02 / (2 * 232), device=device))
    trailer = geometry.parts()[-1][1]
    pool[:, trailer + 12:trailer + 16] = torch.tensor(list(RECORD_MAGIC), dtype=torch.uint8, device=device)
    return bank, geometry


def routings(tokens: int, count: int, device, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator(device).manual_seed(seed)
    out = []
    for _ in range(count):
        logits = torch.randn(tokens, EXPERTS, device=device, generator=generator)
        weights, slots = torch.topk(torch.softmax(logits, -1), TOP_K, dim=-1)
        out.append((slots.to(torch.int32), (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)))
    return out


def float64_reference(x, bank, slots, weights) -> torch.Tensor:
    """The float32 reference's formula in float64, token by token: the referee for both."""
    from flashpack.runtime.kernels.reference import dequantize_expert

    out = torch.zeros(x.shape[0], H, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        xt = x[t].double()
        for k, e in enumerate(slots[t].tolist()):
            gate, up, down = (dequantize_expert(bank, e, p).double() for p in ("gate", "up", "down"))
            out[t] += weights[t, k].double() * (down @ (torch.nn.functional.silu(gate @ xt) * (up @ xt)))
    return out


def bench_decode(report: Report, bank, geometry, device, sweep: bool) -> None:
    from flashpack.runtime.kernels.expert_decode import nvfp4_expert_swiglu
    from flashpack.runtime.kernels.reference import dequantize_expert, expert_swiglu_reference

    sets = routings(1, 64, device)
    xs = [torch.randn(1, H, device=device, dtype=torch.bfloat16) for _ in range(8)]
    weight_bytes = TOP_K * geometry.data_bytes
    moved = weight_bytes + H * 2 * 2 + TOP_K * I * 4 * 2
    run = lambda i, **kw: nvfp4_expert_swiglu(xs[i % 8], bank, *sets[i % 64], **kw)  # noqa: E731
    report.timing("decode T=1", "triton nvfp4 matvec", graph_ms(run, 64), moved, eager_us=eager_ms(run, 20) * 1e3)
    report.timing("decode T=1", "reference (fp32 dequant)",
                  eager_ms(lambda i: expert_swiglu_reference(xs[i % 8], bank, *sets[i % 64]), 10), moved)
    # What the engine does today once experts are dequantised: bf16 F.linear per expert (4x the bytes).
    dense = {}
    for slots, _ in sets[:16]:
        for e in slots.flatten().tolist():
            if e not in dense:
                dense[e] = [dequantize_expert(bank, e, p).to(torch.bfloat16) for p in ("gate", "up", "down")]
    lists = [slots[0].tolist() for slots, _ in sets[:16]]

    def torch_bf16(i):
        x, weights, out = xs[i % 8], sets[i % 16][1], torch.zeros(1, H, device=device, dtype=torch.bfloat16)
        for k, e in enumerate(lists[i % 16]):
            gate, up, down = dense[e]
            out += torch.nn.functional.linear(
                torch.nn.functional.silu(x @ gate.T) * (x @ up.T), down) * weights[0, k]
        return out

    report.timing("decode T=1", "torch bf16 pre-dequantised", graph_ms(torch_bf16, 16),
                  TOP_K * 3 * H * I * 2 + moved - weight_bytes, eager_us=eager_ms(torch_bf16, 20) * 1e3)
    for index in range(3):
        slots, weights = sets[index]
        x = xs[index]
        expected = expert_swiglu_reference(x, bank, slots, weights, out_dtype=torch.float32)
        exact = float64_reference(x, bank, slots, weights)
        got = nvfp4_expert_swiglu(x, bank, slots, weights, out=torch.full((1, H), float("nan"), device=device))
        report.check(f"decode T=1 #{index}", relative_error(got, expected), 1e-5, "reference fp32")
        report.check(f"decode T=1 #{index}", relative_error(got, exact), 1e-5, "float64")
    if sweep:
        # By rows per thread, block_i * block_h / (512 * num_warps) for gate/up and
        # block_o * block_down_in / (512 * num_warps) for down (4 and 4 at the defaults), then
        # narrower chunks at the default rows (29 configurations).
        configs = [dict(block_i=w * gate_up, block_h=512, block_o=4 * w * down, block_down_in=128, num_warps=w)
                   for w in (4, 8, 2) for gate_up in (4, 2, 8) for down in (4, 2, 8)]
        configs += [dict(block_i=16, block_h=bh, block_o=64, block_down_in=bd, num_warps=4)
                    for bh, bd in ((256, 128), (512, 64))]
        report.start_sweep()
        for cfg in configs:
            if not report.sweeping():
                break
            try:
                report.timing("sweep decode T=1", " ".join(f"{k}={v}" for k, v in cfg.items()),
                              graph_ms(lambda i: run(i, **cfg), 64), moved)
            except Exception as error:  # a config the compiler rejects is data, not a failure
                print(f"sweep {cfg}: {error!r}"[:200])


def bench_router(report: Report, device) -> None:
    from flashpack.runtime.kernels.reference import router_top_k_reference
    from flashpack.runtime.kernels.router_top_k import router_top_k_triton

    logits = [torch.randn(1, EXPERTS, device=device, dtype=torch.bfloat16) for _ in range(8)]
    moved = EXPERTS * 2 + TOP_K * 12
    for warps in (4, 1):
        run = lambda i, w=warps: router_top_k_triton(logits[i % 8], TOP_K, True, num_warps=w)  # noqa: E731
        report.timing("router T=1", f"triton router_top_k num_warps={warps}", graph_ms(run, 64), moved)
    report.timing("router T=1", "torch softmax + topk + renormalise",
                  graph_ms(lambda i: router_top_k_reference(logits[i % 8], TOP_K, True), 64), moved)
    for index in range(3):  # bf16 logits tie: the same weights, and the same ids up to their order among ties
        weights, ids = router_top_k_triton(logits[index], TOP_K, True, num_warps=1)
        want_weights, want_ids = router_top_k_reference(logits[index], TOP_K, True)
        same = set(ids[0].tolist()) == set(want_ids[0].tolist())
        report.check(f"router T=1 #{index}", 0.0 if same else float("inf"), 0.0, "torch's experts")
        report.check(f"router T=1 #{index}", relative_error(weights, want_weights), 1e-6, "torch's weights")


class _MixerWeights:
    """Random weights of one hyper-connection mix at the real dims (a WeightSource's `dense`)."""

    def __init__(self, hc: int, rank: int, device, seed: int):
        from types import SimpleNamespace

        gen = torch.Generator(device).manual_seed(seed)
        self.config = SimpleNamespace(hc_count=hc, hidden_size=H, rms_norm_eps=1e-6)
        self.tensors = {
            "hc_norm.weight": 0.1 * torch.randn(hc * H, device=device, generator=gen),
            "input_mix_weight_down.weight": torch.randn(rank, hc * H, device=device, generator=gen) / (hc * H) ** 0.5,
            "block_inject_weight.weight": torch.randn(hc, hc * H, device=device, generator=gen) / (hc * H) ** 0.5,
            "input_mix_weight_up.weight": torch.randn(hc * H, rank, device=device, generator=gen) / rank**0.5,
        }

    def dense(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def bench_hc_mix(report: Report, device, sweep: bool) -> None:
    from flashpack.runtime.kernels.hc_mix import hc_mix_triton
    from flashpack.runtime.model.hyper_connection import GatedResidual

    hc, rank, copies = 4, 320, 8
    mixers = []
    for seed in range(copies):
        weights = _MixerWeights(hc, rank, device, seed)
        mixers.append(GatedResidual(weights.config, weights, "", torch.bfloat16, device))

    def fused(x, i, **blocks):
        mixer = mixers[i % copies]
        return hc_mix_triton(x, mixer.norm.weight, mixer.norm.eps, mixer.in_proj.weight, mixer.mix_up.weight, hc, True,
                             **blocks)

    compiled = torch.compile(lambda mixer, x: mixer.mix(x))  # one graph for every mixer: weights are inputs
    for tokens in (1, 3, 5):  # a decode's token, a checked step's rows (which the engine gives the module)
        case = f"hc mix T={tokens}"
        xs = [torch.randn(tokens, hc * H, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        moved = (rank + hc) * hc * H * 2 + hc * H * rank * 2 + tokens * (2 * hc * H * 2 + H * 2)
        report.timing(case, "torch.compile'd module (cuBLAS + Inductor)",
                      graph_ms(lambda i: compiled(mixers[i % copies], xs[i % copies]), 32), moved)
        report.timing(case, "triton hc_mix (2 kernels)", graph_ms(lambda i: fused(xs[i % copies], i), 32), moved)
        for index in range(3):
            want_input, want_inject = mixers[index].mix(xs[index])
            got_input, got_inject = fused(xs[index], index)
            report.check(f"{case} #{index}", relative_error(got_input, want_input), 2.0**-6, "module, bf16")
            report.check(f"{case} #{index} inject", relative_error(got_inject.to(want_inject.dtype), want_inject),
                         2.0**-6, "module, bf16")
    if sweep:
        xs = [torch.randn(1, hc * H, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        moved = (rank + hc) * hc * H * 2 + hc * H * rank * 2 + 2 * hc * H * 2 + H * 2
        report.start_sweep()
        for cfg in [dict(block_rows=r, block_h=h, block_j=j, num_warps=w) for j in (4, 8, 16) for r in (1, 2, 4)
                    for h in (512, 1024) for w in (4, 8)]:
            if not report.sweeping():
                break
            report.timing("sweep hc mix T=1", " ".join(f"{k}={v}" for k, v in cfg.items()),
                          graph_ms(lambda i: fused(xs[i % copies], i, **cfg), 32), moved)


DENSE_SHAPES = {  # [rows, cols] of the BF16 products a decode layer makes at the real dims
    "deltanet in_proj": (12352, 2560), "deltanet out_proj": (H, 4096), "qsa o_proj": (H, 6144),
    "router + shared gate/up": (1793, H), "shared down": (H, I), "hc mix down + inject": (324, 4 * H),
    "hc mix up": (4 * H, 320),
}


MATVEC_SWEEP_ONE = [dict(block_r=r, num_warps=w) for r in (1, 2, 4, 8, 16) for w in (4, 8)] + [
    dict(block_c=c) for c in (128, 256)]
MATVEC_SWEEP_SEVERAL = [dict(block_r=r, block_c=c) for r, c in (
    (1, 512), (4, 128), (8, 128), (16, 128), (32, 128), (8, 64), (16, 64), (32, 64), (4, 256), (8, 256))] + [
    dict(block_r=r, block_c=128, num_warps=8) for r in (16, 32)]


def bench_dense(report: Report, device, sweep: bool) -> None:
    from flashpack.runtime.kernels.matvec import matvec

    for name, (rows, cols) in DENSE_SHAPES.items():
        copies = max(2, -(-120 * 2**20 // (rows * cols * 2)))  # rotated past the 60 MB L2
        weights = [torch.randn(rows, cols, device=device, dtype=torch.bfloat16) / cols**0.5 for _ in range(copies)]
        for tokens in (1, 2, 3, 5):  # a decode step, and a speculative step's checked rows
            xs = [torch.randn(tokens, cols, device=device, dtype=torch.bfloat16) for _ in range(copies)]
            moved = rows * cols * 2 + tokens * (rows + cols) * 2
            case = f"dense {name} {rows}x{cols} T={tokens}"
            report.timing(case, "cuBLAS F.linear", graph_ms(
                lambda i: torch.nn.functional.linear(xs[i % copies], weights[i % copies]), 32), moved)
            run = lambda i, **kw: matvec(xs[i % copies], weights[i % copies], **kw)  # noqa: E731
            report.timing(case, "triton matvec", graph_ms(run, 32), moved)
            want = torch.nn.functional.linear(xs[0].double(), weights[0].double())
            report.check(case, relative_error(matvec(xs[0], weights[0]), want), 2.0**-8, "float64, bf16 output")
            if sweep:
                report.start_sweep()
                for cfg in MATVEC_SWEEP_ONE if tokens == 1 else MATVEC_SWEEP_SEVERAL:
                    if not report.sweeping():
                        break
                    report.timing("sweep " + case, " ".join(f"{k}={v}" for k, v in cfg.items()),
                                  graph_ms(lambda i: run(i, **cfg), 32), moved)


DENSE_FEW_SHAPES = {  # [rows, cols] of the BF16 products a checked step makes beside FP8 projections (`--dense-fp8`)
    "hc mix down + inject": (324, 4 * H), "hc mix up": (4 * H, 320), "router + shared gate": (513, H),
    "deltanet b + a": (64, H), "qsa indexer qk": (2176, H), "router + shared gate/up": (1793, H),
    "deltanet out_proj": (H, 4096),
}
DENSE_FEW_SWEEP = [dict(splits=sp, block_n=n, block_k=k) for sp in (1, 2, 4, 8, 16, 32) for n in (16, 32)
                   for k in (64, 128, 256)] + [dict(num_warps=w, num_stages=st) for w in (2, 4, 8) for st in (2, 3, 4)]


def bench_dense_few(report: Report, device, sweep: bool) -> None:
    """A checked step's BF16 products: cuBLAS, the matvec and the tile kernel's few-token tiles
    (tile_linear.py, its column splits as tile_linear picks them; --sweep also a grid of splits, tiles
    and launches)."""
    from flashpack.runtime.kernels.matvec import matvec
    from flashpack.runtime.kernels.tile_linear import tile_linear

    for name, (rows, cols) in DENSE_FEW_SHAPES.items():
        copies = max(2, -(-120 * 2**20 // (rows * cols * 2)))  # rotated past the 60 MB L2
        weights = [torch.randn(rows, cols, device=device, dtype=torch.bfloat16) / cols**0.5 for _ in range(copies)]
        for tokens in (2, 3, 4, 5, 8, 16):
            xs = [torch.randn(tokens, cols, device=device, dtype=torch.bfloat16) for _ in range(copies)]
            moved = rows * cols * 2 + tokens * (rows + cols) * 2
            case = f"dense-few {name} {rows}x{cols} T={tokens}"
            report.timing(case, "cuBLAS F.linear", graph_ms(
                lambda i: torch.nn.functional.linear(xs[i % copies], weights[i % copies]), 32), moved)
            if tokens <= 8:
                report.timing(case, "triton matvec", graph_ms(lambda i: matvec(xs[i % copies], weights[i % copies]), 32),
                              moved)
            run = lambda i, **kw: tile_linear(xs[i % copies], weights[i % copies], **kw)  # noqa: E731
            report.timing(case, "triton tiles", graph_ms(run, 32), moved)
            want = torch.nn.functional.linear(xs[0].double(), weights[0].double())
            report.check(case + " tiles", relative_error(tile_linear(xs[0], weights[0], out=torch.full(
                (tokens, rows), float("nan"), device=device)), want), 1e-5, "float64, float32 output")
            if sweep and tokens == 5:
                report.start_sweep()
                for cfg in DENSE_FEW_SWEEP:
                    if not report.sweeping():
                        break
                    report.timing("sweep " + case, " ".join(f"{k}={v}" for k, v in cfg.items()),
                                  graph_ms(lambda i: run(i, **cfg), 32), moved)


def bench_delta_steps(report: Report, device) -> None:
    """A checked step's DeltaNet recurrence, each token's state kept: delta_rule_steps against fla's
    one-token kernel called a token at a time (what plain decoding runs) and the states stacked."""
    from flashpack.runtime.kernels.delta_rule_steps import delta_rule_steps
    from flashpack.runtime.model.delta_rule import fla_gated_delta_rule

    key_heads, value_heads, dim = 16, 32, 128
    copies = 8  # states of 2 MB rotated with their inputs past the L2
    for tokens in (2, 3, 5, 8, 16):
        width = 2 * key_heads * dim + value_heads * dim
        # columns of one [T, C] conv output, as the engine hands them over
        qkvs = [torch.randn(width, tokens, device=device, dtype=torch.bfloat16).t() for _ in range(copies)]
        heads = [torch.split(qkv, [key_heads * dim, key_heads * dim, value_heads * dim], dim=-1) for qkv in qkvs]
        qkv = [(q.unflatten(1, (key_heads, dim)), k.unflatten(1, (key_heads, dim)), v.unflatten(1, (value_heads, dim)))
               for q, k, v in heads]
        gs = [-torch.rand(tokens, value_heads, device=device) for _ in range(copies)]
        betas = [torch.rand(tokens, value_heads, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        states = [torch.randn(value_heads, dim, dim, device=device) * 0.5 for _ in range(copies)]

        def one_launch(i):
            return delta_rule_steps(*qkv[i % copies], gs[i % copies], betas[i % copies], states[i % copies])

        def token_by_token(i):
            (q, k, v), g, beta, state = qkv[i % copies], gs[i % copies], betas[i % copies], states[i % copies]
            outs, kept = [], []
            for t in range(tokens):
                out, state = fla_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
                outs.append(out)
                kept.append(state)
            return torch.cat(outs), torch.stack(kept)

        moved = (1 + tokens) * value_heads * dim * dim * 4 + tokens * (width + value_heads * dim) * 2
        case = f"delta-steps T={tokens}"
        report.timing(case, "triton delta_rule_steps", graph_ms(one_launch, 32), moved)
        report.timing(case, "fla a token at a time + stack", graph_ms(token_by_token, 32), moved)
        (out, states), (want_out, want_states) = one_launch(0), token_by_token(0)
        report.check(case + " states", relative_error(states, want_states), 1e-5, "fla a token at a time")
        report.check(case + " outputs", relative_error(out, want_out), 2.0**-7, "fla a token at a time (bf16)")


def bench_eager_pieces(report: Report, device) -> None:
    """Per-layer host pieces of a prompt step, timed eagerly (launches included): the tile plan and
    the RMS norm, each kernel against the code it replaces."""
    from flashpack.runtime.kernels.rms_norm import rms_norm_triton
    from flashpack.runtime.kernels.tile_plan import plan_tiles, plan_tiles_reference
    from flashpack.runtime.model.norms import rms_norm

    rows = 16 * EXPERTS  # a resident bank holds every layer's experts
    for tokens in (92, PREFILL_TOKENS):
        slots = torch.rand(tokens, rows, device=device).argsort(dim=-1)[:, :TOP_K].to(torch.int32)
        case = f"tile plan T={tokens}"
        moved = slots.numel() * 4 * 3
        report.timing(case, "triton tile_plan", eager_ms(lambda i: plan_tiles(slots, rows, 64), 20), moved)
        report.timing(case, "torch reference", eager_ms(lambda i: plan_tiles_reference(slots, rows, 64), 20), moved)
        found, expected = plan_tiles(slots, rows, 64), plan_tiles_reference(slots, rows, 64)
        equal = all(torch.equal(a, b) for a, b in zip(found, expected))
        report.check(case, 0.0 if equal else 1.0, 0.0, "torch reference (exact)")
    for shape, group in (((92, 4 * H), H), ((92, 32, 128), None)):
        x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
        weight = torch.randn(shape[-1], device=device, dtype=torch.bfloat16) * 0.1
        case = f"rms norm {'x'.join(map(str, shape))}"
        moved = 2 * x.numel() * 2
        report.timing(case, "triton rms_norm", eager_ms(lambda i: rms_norm_triton(x, weight, 1e-6, group), 20), moved)
        report.timing(case, "module code", eager_ms(lambda i: rms_norm(x, weight, 1e-6, group), 20), moved)
        report.check(case, relative_error(rms_norm_triton(x, weight, 1e-6, group).float(),
                                          rms_norm(x, weight, 1e-6, group).float()), 2.0**-7, "module code (bf16)")


def bench_attention(report: Report, device, sweep: bool) -> None:
    """QSA decode attention (attend_step's masked attention) at the real dims: 2 KV heads, group 12,
    head_dim 256, bf16. Capacity 600 with a causal prefix of 550 keys; capacity 32768 with the
    indexer's budget (512 random complete 4-key blocks) plus a 2-key tail. Caches rotated past the L2
    (a layer's cache is cold in a decode step); bytes moved count the kept keys and values, q and the
    output, the same for both impls (SDPA reads the whole capacity: its GB/s is of the useful bytes)."""
    from flashpack.runtime.kernels.decode_attention import decode_attention
    from flashpack.runtime.kernels.reference import decode_attention_reference

    kv_heads, group, hd, ratio, budget = 2, 12, 256, 4, 2048
    scale = hd ** -0.5
    generator = torch.Generator(device).manual_seed(11)
    for capacity in (600, 32768):
        cache_bytes = 2 * kv_heads * capacity * hd * 2
        copies = max(2, -(-120 * 2**20 // cache_bytes))  # rotated past the 60 MB L2
        caches = [[torch.randn(kv_heads, capacity, hd, device=device, dtype=torch.bfloat16, generator=generator)
                   for _ in range(2)] for _ in range(copies)]
        qs = [torch.randn(kv_heads, group, hd, device=device, dtype=torch.bfloat16, generator=generator)
              for _ in range(copies)]
        tokens = torch.arange(capacity, device=device)
        if capacity == 600:
            masks = [tokens < 550]
        else:
            position = capacity - 3  # 8191 complete blocks, a 2-key tail
            complete = (position + 1) // ratio
            masks = []
            for _ in range(4):
                chosen = torch.zeros(capacity // ratio, dtype=torch.bool, device=device)
                chosen[torch.randperm(complete, device=device, generator=generator)[:budget // ratio]] = True
                masks.append((chosen.repeat_interleave(ratio) | (tokens >= complete * ratio)) & (tokens <= position))
        kept = int(masks[0].sum())
        case = f"attn {capacity} keep {kept}"
        moved = 2 * kv_heads * kept * hd * 2 + 2 * kv_heads * group * hd * 2 + capacity
        run = lambda i, **kw: decode_attention(  # noqa: E731
            qs[i % copies], *caches[i % copies], masks[i % len(masks)], scale, **kw)
        sdpa = lambda i: decode_attention_reference(  # noqa: E731
            qs[i % copies], *caches[i % copies], masks[i % len(masks)], scale, dtype=None)
        report.timing(case, "triton decode_attention (split-K)", graph_ms(run, 32), moved, kept_keys=kept,
                      eager_us=eager_ms(run, 20) * 1e3)
        report.timing(case, "sdpa bf16 (attend_step's call before)", graph_ms(sdpa, 32), moved, kept_keys=kept,
                      eager_us=eager_ms(sdpa, 20) * 1e3)
        for index in range(min(3, len(masks))):
            got = run(index)
            report.check(f"{case} #{index}", relative_error(got, sdpa(index)), 2.0**-6, "sdpa")
            want = decode_attention_reference(qs[index % copies], *caches[index % copies], masks[index], scale)
            report.check(f"{case} #{index}", relative_error(got, want), 2.0**-7, "sdpa fp32")
            report.check(f"{case} #{index} no skip", relative_error(run(index, skip_empty=False), want),
                         2.0**-7, "sdpa fp32")
        if sweep:
            report.start_sweep()
            for cfg in [dict(block_n=n, max_splits=s, skip_empty=skip, num_warps=w)
                        for w in (4, 8) for n in (16, 32, 64) for skip in (True, False) for s in (128, 256, 64)]:
                if not report.sweeping():
                    break
                try:
                    report.timing("sweep " + case, " ".join(f"{k}={v}" for k, v in cfg.items()),
                                  graph_ms(lambda i: run(i, **cfg), 32), moved)
                except Exception as error:  # a config the compiler rejects is data, not a failure
                    print(f"sweep {cfg}: {error!r}"[:200])


def bench_crossover(report: Report, bank, geometry, device) -> None:
    from flashpack.runtime.kernels.expert_decode import nvfp4_expert_swiglu
    from flashpack.runtime.kernels.expert_grouped import nvfp4_expert_swiglu_grouped

    for tokens in (2, 4, 8, 16, 32):
        sets = routings(tokens, 32, device, seed=tokens)
        x = torch.randn(tokens, H, device=device, dtype=torch.bfloat16)
        distinct = statistics.mean(len(torch.unique(s)) for s, _ in sets)
        report.timing(f"decode T={tokens}", "triton nvfp4 matvec",
                      graph_ms(lambda i: nvfp4_expert_swiglu(x, bank, *sets[i % 32]), 32),
                      tokens * TOP_K * geometry.data_bytes)
        for block_m in (16, 64):
            report.timing(f"decode T={tokens}", f"triton grouped bf16 m={block_m}",
                          graph_ms(lambda i: nvfp4_expert_swiglu_grouped(x, bank, *sets[i % 32], block_m=block_m), 32),
                          int(distinct * geometry.data_bytes))


def bench_prefill(report: Report, bank, geometry, device, sweep: bool) -> None:
    from flashpack.runtime.kernels.expert_decode import nvfp4_expert_swiglu
    from flashpack.runtime.kernels.expert_grouped import nvfp4_expert_swiglu_grouped
    from flashpack.runtime.kernels.reference import expert_swiglu_reference

    tokens = PREFILL_TOKENS
    sets = routings(tokens, 2, device, seed=7)
    x = torch.randn(tokens, H, device=device, dtype=torch.bfloat16)
    distinct = len(torch.unique(sets[0][0]))
    pairs = tokens * TOP_K
    moved = (distinct * geometry.data_bytes + tokens * H * 2 * 2 + pairs * I * 2 * 2 + pairs * H * 4 * 2)
    flops = 2 * pairs * 3 * H * I
    run = lambda i, **kw: nvfp4_expert_swiglu_grouped(x, bank, *sets[i % 2], **kw)  # noqa: E731
    report.timing(f"prefill T={tokens}", "triton grouped bf16", graph_ms(run, 2), moved, flops,
                  distinct_experts=distinct, eager_us=eager_ms(run, 5) * 1e3)
    report.timing(f"prefill T={tokens}", "reference (fp32 dequant)",
                  eager_ms(lambda i: expert_swiglu_reference(x, bank, *sets[i % 2]), 1, warmup=0), moved, flops)
    slots, weights = sets[0]
    got = run(0, out=torch.full((tokens, H), float("nan"), device=device))  # float32 out: the kernel's own error
    report.check(f"prefill T={tokens} bf16", relative_error(got, expert_swiglu_reference(
        x, bank, slots, weights, act_dtype=torch.bfloat16, out_dtype=torch.float32)), 1e-3, "reference bf16 acts")
    report.check(f"prefill T={tokens} bf16", relative_error(got, expert_swiglu_reference(
        x, bank, slots, weights, out_dtype=torch.float32)), 1e-2, "reference fp32")
    few, some = slice(0, 8), slice(0, min(256, tokens))
    exact = float64_reference(x[few], bank, slots[few], weights[few])
    report.check(f"prefill T={tokens} bf16, 8 tokens", relative_error(got[few], exact), 1e-2, "float64")
    n = some.stop
    checks = {
        "grouped fp32 ieee": nvfp4_expert_swiglu_grouped(x[some], bank, slots[some], weights[some], precision="fp32",
                                                         out=torch.empty(n, H, device=device)),
        "decode matvec": nvfp4_expert_swiglu(x[some], bank, slots[some], weights[some],
                                             out=torch.empty(n, H, device=device)),
        "reference fp32": expert_swiglu_reference(x[some], bank, slots[some], weights[some], out_dtype=torch.float32),
    }
    for name, value in checks.items():
        report.check(f"T={n} {name}, 8 tokens", relative_error(value[few], exact), 1e-5, "float64")
    if sweep:
        report.start_sweep()
        for cfg in [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w)
                    for bm in (64, 128) for bn in (64, 128) for bk in (64, 128) for w in (4, 8)]:
            if not report.sweeping():
                break
            try:
                report.timing(f"sweep prefill T={tokens}", " ".join(f"{k}={v}" for k, v in cfg.items()),
                              graph_ms(lambda i: run(i, **cfg), 2, replays=3), moved, flops)
            except Exception as error:
                print(f"sweep {cfg}: {error!r}"[:200])


def bench_fp8(report: Report, device, sweep: bool) -> None:
    from flashpack.runtime.kernels.fp8_linear import fp8_linear_triton
    from flashpack.runtime.kernels.matvec import ROWS_AT_ONCE
    from flashpack.runtime.kernels.reference import fp8_linear_reference

    copies = 8  # 8 x 21 MB rotate past the 60 MB L2
    mats = []
    for _ in range(copies):
        w = torch.randn(FP8_ROWS, FP8_COLS, device=device) * 0.02
        scale = w.abs().amax(-1) / 448
        mats.append(((w / scale[:, None]).to(torch.float8_e4m3fn), scale))
    dense = [(v.float() * s[:, None]).to(torch.bfloat16) for v, s in mats]
    matrix_bytes = FP8_ROWS * FP8_COLS + FP8_ROWS * 4
    for tokens in (1, 3, 5, 8, PREFILL_TOKENS):  # decode, a checked step's rows, a prompt
        x = torch.randn(tokens, FP8_COLS, device=device, dtype=torch.bfloat16)
        moved = matrix_bytes + tokens * (FP8_COLS + FP8_ROWS) * 2
        flops = 2 * tokens * FP8_ROWS * FP8_COLS
        case = f"fp8 {FP8_ROWS}x{FP8_COLS} T={tokens}"
        calls = 16 if tokens <= ROWS_AT_ONCE else 4
        run = lambda i, **kw: fp8_linear_triton(x, *mats[i % copies], **kw)  # noqa: E731
        kinds = (["matvec"] if tokens <= ROWS_AT_ONCE else []) + (["gemm bf16"] if tokens > 1 else [])
        for kind in kinds:
            chosen = dict(matvec_max_tokens=ROWS_AT_ONCE if kind == "matvec" else 0)
            report.timing(case, f"triton {kind}", graph_ms(lambda i: run(i, **chosen), calls), moved,
                          flops, eager_us=eager_ms(lambda i: run(i, **chosen), 20) * 1e3)
        report.timing(case, "reference (fp32 dequant)",
                      graph_ms(lambda i: fp8_linear_reference(x, *mats[i % copies]), calls), moved, flops)
        report.timing(case, "torch bf16 pre-dequantised",
                      graph_ms(lambda i: torch.nn.functional.linear(x, dense[i % copies]), calls),
                      FP8_ROWS * FP8_COLS * 2 + tokens * (FP8_COLS + FP8_ROWS) * 2, flops)
        if 1 < tokens <= ROWS_AT_ONCE:
            got = fp8_linear_triton(x, *mats[0], out=torch.full((tokens, FP8_ROWS), float("nan"), device=device),
                                    matvec_max_tokens=ROWS_AT_ONCE)
            report.check(case + " matvec", relative_error(got, fp8_linear_reference(
                x, *mats[0], out_dtype=torch.float32)), 1e-5, "reference fp32")
        values, scale = mats[0]
        got = fp8_linear_triton(x, values, scale, out=torch.full((tokens, FP8_ROWS), float("nan"), device=device))
        if tokens == 1:
            report.check(case, relative_error(got, fp8_linear_reference(x, values, scale, out_dtype=torch.float32)),
                         1e-5, "reference fp32")
        else:
            report.check(case, relative_error(got, fp8_linear_reference(
                x, values, scale, act_dtype=torch.bfloat16, out_dtype=torch.float32)), 1e-5, "reference bf16 acts")
        if sweep:
            report.start_sweep()
        if sweep and 1 < tokens <= ROWS_AT_ONCE:
            for cfg in MATVEC_SWEEP_SEVERAL:
                if not report.sweeping():
                    break
                report.timing("sweep " + case, " ".join(f"{k}={v}" for k, v in cfg.items()),
                              graph_ms(lambda i: run(i, matvec_max_tokens=ROWS_AT_ONCE, **cfg), calls), moved)
        if sweep and tokens == 1:
            for cfg in [dict(block_r=br, block_c=bc, num_warps=w) for br in (4, 8, 16, 32)
                        for bc in (256, 512, 1024) for w in (2, 4, 8)]:
                if not report.sweeping():
                    break
                report.timing("sweep " + case, " ".join(f"{k}={v}" for k, v in cfg.items()),
                              graph_ms(lambda i: run(i, **cfg), calls), moved)
        if sweep and tokens == PREFILL_TOKENS:
            for cfg in [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w) for bm in (64, 128)
                        for bn in (64, 128, 256) for bk in (64, 128) for w in (4, 8)]:
                if not report.sweeping():
                    break
                try:
                    report.timing("sweep " + case, " ".join(f"{k}={v}" for k, v in cfg.items()),
                                  graph_ms(lambda i: run(i, **cfg), calls, replays=3), moved, flops)
                except Exception as error:
                    print(f"sweep {cfg}: {error!r}"[:200])


FP8_FEW_SHAPES = {  # [rows, cols] of the FP8 projections (`--dense-fp8`) a checked step makes at the real dims
    "deltanet in_proj qkv + z": (12288, H), "deltanet out_proj": (H, 4096), "qsa q_proj": (6144, H),
    "shared gate + up": (2 * I, H),
}
FP8_FEW_SWEEP = [dict(block_n=n, block_k=k, num_warps=w, num_stages=st) for n in (16, 32, 64) for k in (128, 256)
                 for w in (4,) for st in (3, 5)] + [dict(block_n=32, block_k=128, num_warps=2, num_stages=4)]


def bench_fp8_few(report: Report, device, sweep: bool) -> None:
    from flashpack.runtime.kernels.fp8_linear import fp8_linear_triton, tile_blocks
    from flashpack.runtime.kernels.matvec import ROWS_AT_ONCE
    from flashpack.runtime.kernels.reference import fp8_linear_reference

    for label, (rows, cols) in FP8_FEW_SHAPES.items():
        copies = max(2, -(-120_000_000 // (rows * cols)))  # rotated past the 60 MB L2
        mats = []
        for _ in range(copies):
            w = torch.randn(rows, cols, device=device) * 0.02
            scale = w.abs().amax(-1) / 448
            mats.append(((w / scale[:, None]).to(torch.float8_e4m3fn), scale))
        dense = [(v.float() * sc[:, None]).to(torch.bfloat16) for v, sc in mats]
        for tokens in (1, 3, 5, 8):
            x = torch.randn(tokens, cols, device=device, dtype=torch.bfloat16)
            moved = rows * cols + rows * 4 + tokens * (cols + rows) * 2
            case = f"fp8 {label} {rows}x{cols} T={tokens}"
            run = lambda i, **kw: fp8_linear_triton(x, *mats[i % copies], **kw)  # noqa: E731
            report.timing(case, "triton matvec", graph_ms(lambda i: run(i, matvec_max_tokens=ROWS_AT_ONCE), 16),
                          moved)
            report.timing(case, "triton tile, few-token tiles",
                          graph_ms(lambda i: run(i, matvec_max_tokens=0), 16), moved)
            report.timing(case, "cuBLAS bf16 pre-dequantised",
                          graph_ms(lambda i: torch.nn.functional.linear(x, dense[i % copies]), 16),
                          rows * cols * 2 + tokens * (cols + rows) * 2)
            want = fp8_linear_reference(x, *mats[0], act_dtype=torch.bfloat16, out_dtype=torch.float32)
            got = fp8_linear_triton(x, *mats[0], out=torch.full((tokens, rows), float("nan"), device=device),
                                    matvec_max_tokens=0)
            report.check(case + " tile", relative_error(got, want), 1e-5, "reference bf16 acts")
            if sweep and tokens > 1:
                report.start_sweep()
                for cfg in FP8_FEW_SWEEP:
                    if not report.sweeping():
                        break
                    name = " ".join(f"{k}={v}" for k, v in (tile_blocks(tokens) | cfg).items())
                    report.timing("sweep " + case, name, graph_ms(lambda i: run(i, matvec_max_tokens=0, **cfg), 16),
                                  moved)


def bench_staging(report: Report, geometry, device, sweep: bool) -> None:
    from flashpack.runtime.kernels.reference import stage_records_reference
    from flashpack.runtime.kernels.stage_records import stage_records_triton

    host_slots, words = 64, geometry.stride // 4
    host = torch.randint(-2**31, 2**31 - 1, (host_slots * words,), dtype=torch.int32).pin_memory()
    target = torch.zeros(TOP_K, words, dtype=torch.int32, device=device)
    big = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    host_big = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    h2d_ms = eager_ms(lambda i: big.copy_(host_big, non_blocking=True), repeats=5)
    print(f"  pinned host-to-device copy: {(1 << 30) / h2d_ms / 1e6:.1f} GB/s", flush=True)
    report.timing("staging h2d", "one 1 GiB pinned copy (the PCIe roofline)", h2d_ms, 1 << 30)
    del big, host_big
    generator = torch.Generator().manual_seed(3)
    for count in (5, TOP_K):
        picks = [torch.randperm(host_slots, generator=generator)[:count] for _ in range(16)]
        offsets = [torch.full((TOP_K,), -1, dtype=torch.int64) for _ in picks]
        for offset, pick in zip(offsets, picks):
            offset[:count] = pick * words
        offsets = [offset.to(device) for offset in offsets]
        moved, case = count * geometry.stride, f"stage {count} records"
        run = lambda i, **kw: stage_records_triton(host, offsets[i % 16], target, **kw)  # noqa: E731
        report.timing(case, "triton stage_records (SM reads over PCIe)", graph_ms(run, 16), moved,
                      eager_us=eager_ms(run, 10) * 1e3)
        expected = stage_records_reference(host, offsets[0].cpu(), target.cpu().clone())
        report.check(case, float(not torch.equal(run(0).cpu(), expected)), 0.0, "reference (exact)")
        sources = [[host[p * words:(p + 1) * words] for p in pick.tolist()] for pick in picks]

        def copy_engine(i):
            for row, record in enumerate(sources[i % 16]):
                target[row].copy_(record, non_blocking=True)

        report.timing(case, "copy engine (copy_ per record)", graph_ms(copy_engine, 16), moved)
        if sweep:
            report.start_sweep()
            for cfg in [dict(programs=p, block=b, num_warps=w) for p in (16, 32, 66, 132, 0)
                        for b in (2048, 4096, 8192) for w in (2, 4, 8)]:
                if not report.sweeping():
                    break
                report.timing("sweep " + case, " ".join(f"{k}={v}" for k, v in cfg.items()),
                              graph_ms(lambda i: run(i, **cfg), 16), moved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of block sizes")
    parser.add_argument("--sweep-seconds", type=float, default=45.0, help="time limit of each section's sweep")
    parser.add_argument("--only",
                        default="decode,fp8,fp8-few,prefill,crossover,staging,router,hc-mix,dense,dense-few,attention,"
                                "delta-steps,eager-pieces")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU")
    flashpack = import_flashpack()
    import triton

    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 references must be IEEE fp32
    torch.set_float32_matmul_precision("highest")
    device = torch.device("cuda")
    started = time.time()
    report = Report(*measure_rooflines(device), sweep_seconds=args.sweep_seconds)
    print(f"copy {report.copy_gbs:.0f} GB/s, bf16 matmul {report.bf16_tflops:.0f} TFLOP/s", flush=True)
    bank, geometry = random_bank(device)
    failures = []
    for name in args.only.split(","):
        try:
            if name == "decode":
                bench_decode(report, bank, geometry, device, args.sweep)
            elif name == "crossover":
                bench_crossover(report, bank, geometry, device)
            elif name == "prefill":
                bench_prefill(report, bank, geometry, device, args.sweep)
            elif name == "fp8":
                bench_fp8(report, device, args.sweep)
            elif name == "fp8-few":
                bench_fp8_few(report, device, args.sweep)
            elif name == "staging":
                bench_staging(report, geometry, device, args.sweep)
            elif name == "router":
                bench_router(report, device)
            elif name == "hc-mix":
                bench_hc_mix(report, device, args.sweep)
            elif name == "dense":
                bench_dense(report, device, args.sweep)
            elif name == "dense-few":
                bench_dense_few(report, device, args.sweep)
            elif name == "attention":
                bench_attention(report, device, args.sweep)
            elif name == "delta-steps":
                bench_delta_steps(report, device)
            elif name == "eager-pieces":
                bench_eager_pieces(report, device)
        except Exception:
            failures.append({"case": name, "error": traceback.format_exc()})
            print(failures[-1]["error"], file=sys.stderr)
        write_json(args.json, report, failures, flashpack, triton, started)
    report.print()
    document = write_json(args.json, report, failures, flashpack, triton, started)
    print(f"\nwrote {args.json} in {document['seconds']} s")
    if failures or not all(c["ok"] for c in report.checks):
        sys.exit(1)


def write_json(path: Path, report: Report, failures: list, flashpack, triton, started: float) -> dict:
    document = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "flashpack": str(Path(flashpack.__file__).parent),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "copy_gb_s": round(report.copy_gbs, 1), "hbm_peak_gb_s": HBM_PEAK_GBS,
        "bf16_matmul_tflop_s": round(report.bf16_tflops, 1), "dims": {"H": H, "I": I, "experts": EXPERTS,
        "top_k": TOP_K, "fp8": [FP8_ROWS, FP8_COLS], "prefill_tokens": PREFILL_TOKENS},
        "rows": report.rows, "checks": report.checks, "failures": failures,
        "seconds": round(time.time() - started, 1),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1))
    return document


if __name__ == "__main__":
    main()
