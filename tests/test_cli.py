"""The thin CLI commands wire the keyword functions correctly: run (with and without the tiered
store), profile, trace record/replay, and one-line errors."""

from __future__ import annotations

import json
import shutil

from click.testing import CliRunner

from flashpack.cli import main
from flashpack.layout.manifest import Manifest


def _invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def test_run_streams_greedy_text_and_the_store_changes_nothing(tiny_pack):
    plain = _invoke("run", str(tiny_pack), "The cache", "--max-tokens", "12")
    assert plain.exit_code == 0, plain.output
    tiered = _invoke("run", str(tiny_pack), "The cache", "--max-tokens", "12",
                     "--vram-budget", "3MiB", "--ram-budget", "1MiB", "--store-stats")
    assert tiered.exit_code == 0, tiered.output
    assert plain.stdout.strip(), "greedy run printed no text"
    assert tiered.stdout == plain.stdout  # identical greedy text whatever serves the experts
    assert "tok/s decode" in plain.output and '"device_hit_rate"' in tiered.output


def test_run_refuses_a_budget_below_one_layers_top_k(tiny_pack):
    result = _invoke("run", str(tiny_pack), "hi", "--vram-budget", "1KiB", "--ram-budget", "1MiB")
    assert result.exit_code == 2
    assert result.output.startswith("error: --vram-budget") and "the minimum is" in result.output


def test_profile_then_prewarm_and_trace_replay(tiny_pack, tmp_path):
    pack = tmp_path / "profiled.pack"
    shutil.copytree(tiny_pack, pack)
    workload = tmp_path / "workload.jsonl"
    workload.write_text('{"prompt": "def add(a, b):"}\n{"messages": [{"role": "user", "content": "Hi"}]}\n')
    result = _invoke("profile", str(pack), "--workload", str(workload), "--name", "code", "--max-tokens", "4")
    assert result.exit_code == 0, result.output
    assert "code" in Manifest.load(pack).hot_sets
    warmed = _invoke("run", str(pack), "def", "--max-tokens", "2", "--vram-budget", "3MiB", "--ram-budget", "1MiB",
                     "--hot-set", "code", "--store-stats")
    assert warmed.exit_code == 0, warmed.output
    stats = json.loads(warmed.stderr[warmed.stderr.index("{"):])
    assert stats["tiers"]["device"]["prewarmed"] > 0 and stats["tokens"] > 0
    trace = tmp_path / "trace.json"
    assert _invoke("trace", "record", str(pack), "--workload", str(workload), "--out", str(trace),
                   "--max-tokens", "4").exit_code == 0
    replay = _invoke("trace", "replay", str(trace), "--capacity", "4", "--capacity", "8")
    assert replay.exit_code == 0 and "belady" in replay.output
    # through the store (as on a GPU, where the kernels read records in place) the routing is the same
    through_store = tmp_path / "trace-store.json"
    assert _invoke("trace", "record", str(pack), "--workload", str(workload), "--out", str(through_store),
                   "--max-tokens", "4", "--vram-budget", "3MiB", "--ram-budget", "1MiB").exit_code == 0
    steps = json.loads(trace.read_text())["steps"]
    assert json.loads(through_store.read_text())["steps"] == steps
    layers = Manifest.load(pack).config.num_hidden_layers
    assert len(steps) >= 4 and all([layer for layer, _ in step["fetches"]] == list(range(layers)) for step in steps)
    missing = _invoke("run", str(pack), "x", "--vram-budget", "3MiB", "--ram-budget", "1MiB", "--hot-set", "nope")
    assert missing.exit_code == 2 and "nope" in missing.output
