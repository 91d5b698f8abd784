"""The controlled-acceptance bench (runtime/bench/speculation.py) on the tiny pack, on a CPU: its
report, and the replayed truth decoded again where an output leaves it."""

from __future__ import annotations

import json

import torch

from flashpack.layout.pack import Pack
from flashpack.runtime.bench import speculation
from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.speculative import SpeculativeDecoder


def test_the_bench_reports_each_setting_lossless(tiny_pack, tmp_path):
    out = tmp_path / "spec.json"
    layers = Pack.open(tiny_pack).manifest.config.num_hidden_layers
    speculation.main([str(tiny_pack), "--prompt-len", "30", "--gen", "10", "--alphas", "0.9", "--draft-tokens", "2",
                      "--repeats", "2", "--emulate-layers", str(2 * layers), "--set", "compile_checked=false",
                      "--json", str(out)])
    report = json.loads(out.read_text())
    assert [(run["alpha"], run["k"], run["policy"]) for run in report["runs"]] == [(0.9, 2, False), (0.9, 2, True)]
    assert all(run["lossless"] and run["divergences"] == 0 for run in report["runs"])
    assert report["runs"][0]["tokens_per_step"] > 1
    for run in report["runs"]:
        # the steps scaled with a decode's seconds are one decode's (the policy's decoder serves
        # three decodes: its running totals are not), so they cover its 9 tokens after the first
        assert run["checked_steps"] + run["plain_steps"] <= 9 <= 3 * run["checked_steps"] + run["plain_steps"]
        # and so are its seconds: within one decode's (the policy's running totals, over three
        # decodes, would not be)
        assert 0 < run["rollback_seconds"] < run["verify_seconds"] < run["seconds"]
    assert "| 0.9 | 2 | off |" in out.with_suffix(".md").read_text()
    # the policy's row traces its three decodes (the first, then two repeats) step by step
    policy = report["runs"][1]
    assert len(policy["steps"]) == len(policy["rests"]) == 3
    for steps in policy["steps"]:
        assert 9 <= sum(step["tokens"] for step in steps) <= 10  # a last checked step may choose one past
        assert all(step["ms"] > 0 for step in steps)
        assert {"checked", "resting", "checked_median_ms", "plain_median_ms"} <= set(steps[-1])


def test_rests_are_where_a_rest_begins():
    trace = [{"resting": 0}, {"resting": 32}, {"resting": 31}, {"resting": 0}, {"resting": 64}]
    assert [r["step"] for r in speculation.rests(trace)] == [1, 4]


def test_a_truth_the_output_leaves_is_decoded_again(tiny_pack):
    """A replayed truth wrong from its fourth token (as a BF16 near-tie would leave it): the decode
    follows the model, not the truth, and counts where it took the truth up again."""
    engine = load_engine(tiny_pack, EngineConfig(dtype="float32", prompt_cache_ram=0, speculate="off"))
    state = engine.step.new_state()
    prompt = torch.randint(5, 1000, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    plain, _ = speculation.decode(engine, state, prompt, 16, None)
    wrong = plain[:3] + [(token + 1) % 997 for token in plain[3:]]
    drafter = speculation.ReplayDrafter(wrong, len(prompt), alpha=1.0, vocab=997)
    decoder = SpeculativeDecoder(engine.step, [drafter], 3, policy=False)
    tokens, seconds = speculation.decode(engine, state, prompt, 16, decoder, replay=drafter)
    assert tokens == plain and drafter.divergences == 1 and seconds > 0
    assert decoder.stats.to_dict()["tokens_per_step"] > 2  # right drafts from the truth decoded again
    engine.close()


def test_through_a_tiered_store_each_timed_decode_follows_the_same_plain_one(tiny_pack, tmp_path, monkeypatch):
    """What the tiers hold depends on what ran before: each timed decode (plain or speculative) comes
    right after an untimed plain decode of the same tokens, so neither is timed on a store the other
    left otherwise (at 24/64 a policy decode that checked nothing once ran 1.5x the plain one)."""
    calls = []
    decode = speculation.decode

    def recorded(engine, state, prompt, gen, decoder, replay=None, trace=None):
        calls.append("plain" if decoder is None else "speculative")
        return decode(engine, state, prompt, gen, decoder, replay=replay, trace=trace)

    monkeypatch.setattr(speculation, "decode", recorded)
    monkeypatch.setattr(speculation, "union_experts", lambda *args: None)
    out = tmp_path / "spec.json"
    speculation.main([str(tiny_pack), "--prompt-len", "30", "--gen", "8", "--alphas", "0.9", "--draft-tokens", "2",
                      "--repeats", "1", "--vram-budget", "1GiB", "--set", "compile_checked=false", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["settings"]["expert_source"] == "TieredStore" and report["settings"]["settled"]
    # the truth and the warm-up (k 1 and 2), then for each setting and repeat (every draft checked once,
    # the policy twice) an untimed plain decode before the timed plain one and before the speculative one
    assert calls == ["plain", "speculative", "speculative"] + ["plain", "plain", "plain", "speculative"] * 3
    assert all(report["runs"][i]["lossless"] for i in range(2))
