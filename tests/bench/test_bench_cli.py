"""`flashpack bench` on the tiny pack: the JSON it writes, store traffic that follows the budgets,
the transformers baseline computing the same model, budget emulation, and one-line errors."""

from __future__ import annotations

import json
import math

import torch
from click.testing import CliRunner

from flashpack.cli import main
from flashpack.layout.manifest import Manifest
from flashpack.runtime.store.build import resident_device_bytes

PROBES = ("--copy-probe", "4MiB", "--disk-probe", "1MiB", "--quiet")
TOP_LEVEL = {"bench_version", "machine", "settings", "budgets", "sizes", "bandwidth", "results", "roofline",
             "comparison", "notes"}


def _bench(pack, tmp_path, *args: str, name: str = "bench.json") -> tuple[dict, object]:
    out = tmp_path / name
    result = CliRunner().invoke(main, ["bench", str(pack), "--json", str(out), *PROBES, *args])
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text()), result


def test_bench_writes_the_documented_report_and_disk_traffic_follows_the_budget(tiny_pack, tmp_path):
    cfg = Manifest.load(tiny_pack).config
    prompt, gen = 32, 4
    roomy, result = _bench(tiny_pack, tmp_path, "--vram-budget", "64MiB", "--ram-budget", "64MiB",
                           "--prompt-len", str(prompt), "--gen", str(gen), name="roomy.json")
    assert set(roomy) == TOP_LEVEL and roomy["bench_version"] == 1
    assert "decode tok/s" in result.stdout and "flashpack" in result.stdout
    machine = roomy["machine"]
    assert machine["cpu_count"] > 0 and machine["ram_bytes"] > 0 and machine["gpu"] is None
    assert {"torch", "triton", "transformers", "accelerate"} <= set(machine["versions"])
    bandwidth = roomy["bandwidth"]
    assert bandwidth["device"]["bytes_per_s"] > 0 and bandwidth["disk"]["bytes_per_s"] > 0
    assert bandwidth["host_to_device"]["bytes_per_s"] is None  # a CPU has no such link
    assert bandwidth["disk"]["bytes"] > 0 and isinstance(bandwidth["disk"]["o_direct"], bool)

    ours = roomy["results"]["flashpack"]
    assert roomy["results"]["transformers"] is None and roomy["comparison"] is None
    prefill, decode = ours["prefill"], ours["decode"]
    assert prefill["tokens"] == prompt and decode["tokens"] == gen and len(ours["generated"]) == gen + 1
    assert prefill["ttft_s"] > 0 and math.isclose(prefill["tokens_per_s"], prompt / prefill["ttft_s"])
    assert decode["seconds"] > 0 and math.isclose(decode["tokens_per_s"], gen / decode["seconds"])
    store = decode["store"]
    # batch 1: every decode step asks each layer for top_k experts, each a device, host or disk hit
    # (or joining a load in flight)
    assert store["requests"] == gen * cfg.num_hidden_layers * cfg.num_experts_per_tok
    assert store["device_hits"] + store["host_hits"] + store["disk_reads"] + store["joined"] == store["requests"]
    assert store["per_token"]["bytes_disk_to_host"] == 0  # the budget holds every record
    roof = roomy["roofline"]["decode"]
    assert roof["bytes_per_token"]["disk_to_host"] == 0
    assert roof["bound"] == "device" and roof["roofline_tokens_per_s"] > 0
    assert 0 < roof["achieved_over_roofline"] <= 1
    assert math.isclose(roof["achieved_tokens_per_s"], decode["tokens_per_s"])
    sizes = roomy["sizes"]
    experts = store["requests"] / gen * sizes["record_bytes"]
    assert math.isclose(roof["bytes_per_token"]["device"],
                        sizes["layer_dense"] + sizes["head_read"] + sizes["embed_row"] + experts)
    assert roomy["budgets"]["typed"] == roomy["budgets"]["engine"] == {"vram": 64 << 20, "ram": 64 << 20}

    # a few records of RAM and barely one layer's top_k of VRAM: decode has to read the disk
    reserved = resident_device_bytes(Manifest.load(tiny_pack), torch.float32)
    tight, _ = _bench(tiny_pack, tmp_path, "--vram-budget", str(reserved + 6 * 4096), "--ram-budget", "16KiB",
                      "--prompt-len", str(prompt), "--gen", str(gen), name="tight.json")
    tight_store = tight["results"]["flashpack"]["decode"]["store"]
    assert tight["budgets"]["store_plan"]["host_slots"] == 4
    assert tight_store["per_token"]["bytes_disk_to_host"] > 0 and tight_store["disk_reads"] > 0
    assert tight["roofline"]["decode"]["bytes_per_token"]["disk_to_host"] == \
        tight_store["per_token"]["bytes_disk_to_host"]
    assert tight_store["hit_rates"]["device"] < store["hit_rates"]["device"]
    assert tight["results"]["flashpack"]["generated"] == ours["generated"]  # same tokens whatever the budget


def test_transformers_baseline_computes_the_same_model(tiny_pack, tmp_path):
    report, result = _bench(tiny_pack, tmp_path, "--vram-budget", "8MiB", "--ram-budget", "1MiB",
                            "--prompt-len", "24", "--gen", "3", "--baseline", "transformers",
                            "--baseline-layers", "8", "--baseline-gen", "2")
    base = report["results"]["transformers"]
    assert "error" not in base, base.get("error")
    check = base["check"]
    assert check["tolerance"] == 1e-4 and check["rel"] <= 1e-4 and check["same_top1"] and check["passed"]
    # all 8 layers: transformers' greedy tokens are ours
    ours = report["results"]["flashpack"]["generated"]
    assert base["generated"] == ours[:3]
    assert base["layers"] == 8 and base["prefill"]["tokens"] == 24 and base["decode"]["tokens"] == 2
    assert base["prefill"]["ttft_s"] > 0 and base["decode"]["tokens_per_s"] > 0
    assert sum(base["placement"]["bytes"].values()) > 0
    assert report["comparison"]["decode_tokens_per_s"]["ratio"] > 0 and report["comparison"]["same_first_token"]
    assert "same model: logits rel. error" in result.stdout


def test_emulated_budgets_and_a_two_layer_baseline(tiny_nvfp4_pack, tmp_path):
    manifest = Manifest.load(tiny_nvfp4_pack)
    dense = manifest.dense_tensors()
    cfg = manifest.config
    typed_vram, typed_ram = 12 << 20, 4 << 20
    report, _ = _bench(tiny_nvfp4_pack, tmp_path, "--vram-budget", "12MiB", "--ram-budget", "4MiB",
                       "--prompt-len", "20", "--gen", "2", "--emulate-layers", "48", "--baseline", "transformers",
                       "--baseline-prompt-len", "16")
    # fixed: float32 dense outside layers.* (embedding, lm_head, mixer, mtp.*) + one fetch's experts
    fixed = 4 * sum(math.prod(t.shape) for name, t in dense.items() if not name.startswith("layers."))
    fixed += cfg.num_experts_per_tok * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    budgets = report["budgets"]
    assert budgets["fixed"] == {"vram": fixed, "ram": 0}
    assert budgets["engine"] == {"vram": fixed + (typed_vram - fixed) * 8 // 48, "ram": typed_ram * 8 // 48}
    no_mtp = 4 * sum(math.prod(t.shape) for name, t in dense.items() if not name.startswith(("layers.", "mtp.")))
    assert budgets["baseline"]["vram"] == no_mtp + (typed_vram - no_mtp) * 2 // 48
    ours = report["results"]["flashpack"]
    scaled = ours["scaled"]
    fixed_decode = ours["fixed_seconds"]["decode"]
    per_token = ours["decode"]["seconds"] / ours["decode"]["tokens"]
    assert scaled["layers"] == 48
    assert math.isclose(scaled["decode_ms_per_token"] / 1000, fixed_decode + (per_token - fixed_decode) * 6)
    assert ours["decode"]["layer_seconds"] is None  # eager decode on a CPU: scaled evenly
    assert "decode_at_48_layers" in report["roofline"]
    assert any("x(L_full)" in note for note in report["notes"])
    base = report["results"]["transformers"]
    assert "error" not in base, base.get("error")
    assert base["layers"] == 2 and base["prompt_truncated"] and base["prefill"]["tokens"] == 16
    assert base["check"]["passed"], base["check"]
    assert set(base["scaled"]) == {"8", "48"} and report["comparison"]["layers"] == 48


def test_a_budget_below_the_minimum_is_one_line_and_exit_2(tiny_pack):
    result = CliRunner().invoke(main, ["bench", str(tiny_pack), "--vram-budget", "1KiB", "--ram-budget", "1MiB",
                                       *PROBES])
    assert result.exit_code == 2
    assert result.output.startswith("error: --vram-budget") and "the minimum is" in result.output
    assert len(result.output.strip().splitlines()) == 1
    emulated = CliRunner().invoke(main, ["bench", str(tiny_pack), "--vram-budget", "100KiB", "--ram-budget", "1MiB",
                                         "--emulate-layers", "48", *PROBES])
    assert emulated.exit_code == 2 and len(emulated.output.strip().splitlines()) == 1
    assert "outside its layers" in emulated.output


def test_a_failing_baseline_keeps_our_numbers_and_exits_1(tiny_pack, tmp_path, monkeypatch):
    from flashpack.runtime.bench import bench as bench_module

    def broken(*_args, **_kwargs):
        raise RuntimeError("no room for the baseline")

    monkeypatch.setattr(bench_module, "_run_baseline", broken)
    out = tmp_path / "failed.json"
    result = CliRunner().invoke(main, ["bench", str(tiny_pack), "--json", str(out), *PROBES, "--prompt-len", "8",
                                       "--gen", "1", "--baseline", "transformers"])
    assert result.exit_code == 1
    assert "baseline FAILED: RuntimeError: no room for the baseline" in result.stdout
    assert result.stderr.strip().splitlines()[-1].startswith("error: the transformers baseline failed")
    report = json.loads(out.read_text())
    assert report["results"]["transformers"] == {"error": "RuntimeError: no room for the baseline"}
    assert report["results"]["flashpack"]["decode"]["tokens_per_s"] > 0 and report["comparison"] is None


def test_fused_mixes_are_a_gpu_setting(tiny_pack, tmp_path):
    """The fused mixes are the default on a GPU; a CPU run keeps the module's code and says so."""
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["bench", str(tiny_pack), "--device", "cpu", "--prompt-len", "8", "--gen", "2",
                                       "--json", str(out), *PROBES])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["settings"]["fused_mix"] is False


def test_bench_times_speculation_when_asked(tiny_pack, tmp_path):
    """`--speculate lookup`: decode also through the engine's drafters, beside plain decodes, the
    outputs compared; the report says so in its JSON and its table."""
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["bench", str(tiny_pack), "--prompt-len", "24", "--gen", "6", "--speculate",
                                       "lookup", "--quiet", "--json", str(out)])
    assert result.exit_code == 0, result.output
    speculated = json.loads(out.read_text())["results"]["flashpack"]["speculation"]
    assert speculated["drafters"] == ["lookup"] and speculated["lossless"] is True
    assert {"acceptance_at", "tokens_per_step", "draft_seconds", "verify_seconds", "rollback_seconds"} <= set(speculated["stats"])
    assert "speculation (lookup, the policy on)" in result.output
