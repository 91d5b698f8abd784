"""bench/demo_model: the --quick run's JSON and tables, and the measurements' parts on cases whose
answer is known, each with a control that must come out wrong (shuffled weights, random routing,
fresh tokens, a real divergence)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from flashpack import demo_model
from flashpack.bench.demo_model import greedy, loss, sources
from flashpack.bench.demo_model.edit_tasks import edit_tasks, rename
from flashpack.bench.demo_model.held_out import TextModel, held_out_windows
from flashpack.bench.demo_model.locality import PromptLocality, decode_locality
from flashpack.bench.demo_model.lookup import LookupMeter
from flashpack.convert.source import SourceCheckpoint
from flashpack.convert.train.corpus import SourceFile, load_corpus
from flashpack.runtime.model import MTPHead, Qwen4ExpModel
from flashpack.runtime.store.trace import Step, Trace

PARTS = {"bench", "version", "machine", "settings", "held_out_windows", "unigram", "training_record",
         "held_out_loss", "greedy", "prompt_lookup", "routing", "seconds", "targets"}


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "demo.json"
    run = subprocess.run([sys.executable, "-m", "flashpack.bench.demo_model", "--quick", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Held-out loss" in out.with_suffix(".md").read_text()
    return json.loads(out.read_text())


def test_quick_run_losses_are_finite_and_the_nvfp4_gap_small(quick):
    assert set(quick) == PARTS and all(quick["targets"].values())
    losses = quick["held_out_loss"]
    for key in ("transformers_bf16_snapshot", "flashpack_nvfp4_pack", "flashpack_bf16_snapshot", "unigram"):
        assert math.isfinite(losses[key]["loss"]) and losses[key]["loss"] > 0
    assert losses["flashpack_nvfp4_pack"]["tokens"] == quick["held_out_windows"]["targets"]
    assert abs(losses["gap_nvfp4_pack_vs_transformers"]) < 0.05
    assert abs(losses["gap_engine_vs_transformers_same_weights"]) < 1e-4  # same weights: rounding only
    assert losses["flashpack_nvfp4_pack"]["loss"] < losses["unigram"]["loss"] / 2
    assert 0.4 <= losses["flashpack_nvfp4_pack"]["mtp_agreement_with_greedy"] <= 1


def test_quick_run_identical_weights_give_identical_greedy_tokens(quick):
    for key in ("pack_weights", "snapshot_weights"):
        comparison = quick["greedy"][key]
        assert comparison["equal"] == comparison["total"] == len(quick["greedy"]["prompts"]) * quick["greedy"]["tokens"]


def test_quick_run_lookup_locality_and_replay_are_in_range(quick):
    for task in ("edit", "plain"):
        rates = quick["prompt_lookup"][task]["accepted_at_least"]
        assert all(0 <= b <= a <= 1 for a, b in zip(rates, rates[1:]))
    routing = quick["routing"]
    assert routing["uniform"] == 4 / 32
    for model in ("demo", "synth"):
        for kind in ("prompt", "decode"):
            values = routing["locality"][model][kind]["per_layer"]
            assert len(values) == 8 and all(0 <= v <= 1 for v in values)
        for by_policy in routing["replay"][model]["misses_per_token"].values():
            assert by_policy["belady"] <= min(by_policy[p] for p in ("lru", "lfu", "lfu-decay"))


class _ShuffledWeights(sources.SnapshotWeights):
    """Control: every dense tensor's values permuted (same values, no structure)."""

    def dense(self, name):
        tensor = super().dense(name)
        if not tensor.is_floating_point():
            return tensor
        order = torch.randperm(tensor.numel(), generator=torch.Generator().manual_seed(len(name)))
        return tensor.flatten()[order].view(tensor.shape)


def test_control_a_shuffled_weights_models_held_out_loss_is_far_worse():
    snapshot = demo_model.snapshot_path()
    corpus = load_corpus(max_train_files=1)
    windows = held_out_windows(TextModel.load(snapshot), corpus, 1, 256).windows
    checkpoint = SourceCheckpoint.open(snapshot)
    shuffled, experts = _ShuffledWeights(checkpoint), sources.SnapshotExperts(checkpoint)
    model = Qwen4ExpModel(shuffled, experts, dtype=torch.float32)
    broken = sources.Engine(model, MTPHead(model, shuffled, experts))
    good = loss.engine_loss(sources.snapshot_engine(snapshot), windows, with_mtp=False)["loss"]
    bad = loss.engine_loss(broken, windows, with_mtp=False)["loss"]
    assert good < 2.5 and bad > 3 * good


def test_prompt_locality_is_k_over_e_for_random_routing_and_one_for_repeats():
    random_routes = torch.stack([torch.randperm(32, generator=torch.Generator().manual_seed(t))[:4] for t in range(3000)])
    observed = PromptLocality(top_k=4)
    observed(0, random_routes)
    observed(1, random_routes[:1].repeat(50, 1))
    per_layer = observed.result()["per_layer"]
    assert abs(per_layer[0] - 4 / 32) < 0.015 and per_layer[1] == 1.0


def test_decode_locality_pairs_only_consecutive_decode_steps():
    steps = [Step(5, [(0, (0, 1, 2, 3))]), Step(1, [(0, (0, 1, 2, 3))]), Step(1, [(0, (0, 1, 8, 9))]),
             Step(7, [(0, (4, 5, 6, 7))]), Step(1, [(0, (20, 21, 22, 23))]), Step(1, [(0, (20, 21, 22, 23))])]
    result = decode_locality(Trace(32, 4, [0], steps=steps))
    assert result["per_layer"] == [(2 + 4) / (2 * 4)] and result["pairs_per_layer"] == 2


def test_lookup_meter_accepts_a_copy_and_control_fresh_tokens_get_no_draft():
    copied = LookupMeter(n_max=3, k=4)
    accepted = copied.add(list(range(100)), list(range(20)))
    assert accepted[0] == 0 and accepted[1:] == [4] * (len(accepted) - 1)  # 99 then 0: the copy is found from 0
    fresh = LookupMeter(n_max=3, k=4)
    fresh.add(list(range(100)), list(range(100, 120)))
    assert fresh.result()["proposed"] == 0 and fresh.result()["speculative_tokens_per_step"] == 1.0
    assert copied.result()["speculative_tokens_per_step"] > 3


def test_rename_leaves_attributes_and_keyword_arguments_alone():
    source = "def f(x, y):\n    z = x + self.x\n    return g(x=x, y=z)\n"
    assert rename(source, "x", "new_x") == "def f(new_x, y):\n    z = new_x + self.x\n    return g(x=new_x, y=z)\n"
    method = "    def f(self, x):\n        s = \"\"\"\nx\"\"\"\n        return x\n"  # indented as in its class
    assert rename(method, "x", "new_x") == "    def f(self, new_x):\n        s = \"\"\"\nx\"\"\"\n        return new_x\n"


def test_edit_task_prompt_holds_the_function_and_the_renamed_first_line():
    body = "def scale(values, factor):\n    out = []\n    for value in values:\n        out.append(value * factor)\n" \
           "    total = len(values)\n    return out, total\n"
    [task] = edit_tasks((SourceFile("m.py", "import os\n\n\n" + body),), 1)
    assert (task.old, task.new) == ("values", "new_values")
    assert task.prompt == body + "\n# The same function with the variable values renamed to new_values:\n" \
                                 "def scale(new_values, factor):\n"
    assert task.expected == rename(body, "values", "new_values").partition("\n")[2]


def test_a_divergence_is_a_tie_only_when_the_logits_are_level():
    def generated(choice, margin):
        logits = torch.zeros(8)
        logits[choice] = margin
        return greedy.Generated([1, choice], [torch.zeros(8), logits])

    level = greedy.compare([generated(3, 1e-5)], [generated(5, 1e-5)], ["p"])
    assert level["equal"] == 1 and level["all_explained_by_ties"]
    apart = greedy.compare([generated(3, 0.5)], [generated(5, 0.5)], ["p"])  # control: a real disagreement
    assert apart["divergences"][0]["step"] == 1 and not apart["all_explained_by_ties"]


def test_bad_windows_is_one_line_and_exit_2(tmp_path, capsys):
    from flashpack.bench.demo_model.__main__ import main

    assert main(["--windows", "0", "--json", str(tmp_path / "r.json")]) == 2
    assert capsys.readouterr().err.strip() == "error: --windows takes a positive number or 'all', got '0'"
    assert not list(tmp_path.iterdir())
