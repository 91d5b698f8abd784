"""The speculation policy simulated at measured step times (bench/policy_simulation.py): where
checking drafts pays, the policy keeps most of what checking every draft gains; where it does not,
the policy stays within 3 % of plain decoding. The control judges yields by their median, which the
simulation must catch costing a paying drafter much of its gain."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

from flashpack.runtime.engine import speculative

H200 = ["--plain-ms", "2.5", "--checked-ms", "2:3.6,3:4.3,4:5.0,5:5.6"]  # 16 layers resident
TIERED = ["--plain-ms", "6.3", "--checked-ms", "2:20,3:28,4:35,5:42"]  # 24/64: a step's union over PCIe


def _simulation():
    path = Path(__file__).resolve().parents[2] / "bench" / "policy_simulation.py"
    spec = importlib.util.spec_from_file_location("policy_simulation", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(tmp_path, times: list[str], alphas: str) -> dict[float, dict]:
    out = tmp_path / "sim.json"
    _simulation().main([*times, "--alphas", alphas, "--seeds", "40", "--json", str(out)])
    return {row["alpha"]: row for row in json.loads(out.read_text())["rows"]}


def test_where_checking_pays_the_policy_keeps_its_gain(tmp_path):
    row = _rows(tmp_path, H200, "0.9")[0.9]
    assert row["every_draft_checked"]["median"] > 1.7
    assert row["policy"]["median"] > 0.97 * row["every_draft_checked"]["median"]
    assert row["policy"]["p10"] > 0.9 * row["every_draft_checked"]["p10"]


@pytest.mark.parametrize("times, alpha", [(H200, 0.5), (TIERED, 0.9), (TIERED, 0.5)])
def test_where_checking_does_not_pay_the_policy_stays_near_plain(tmp_path, times, alpha):
    row = _rows(tmp_path, times, str(alpha))[alpha]
    assert row["every_draft_checked"]["median"] < 0.9
    assert row["policy"]["p10"] >= 0.97


def test_control_judging_yields_by_their_median_loses_a_paying_drafters_gain(tmp_path, monkeypatch):
    monkeypatch.setattr(speculative._Pace, "tokens", property(
        lambda pace: statistics.median(pace.recent_tokens) if pace.recent_tokens else None))
    monkeypatch.setattr(speculative, "YIELD_WINDOW", 5)
    row = _rows(tmp_path, H200, "0.9")[0.9]
    assert row["policy"]["p10"] < 0.9 * row["every_draft_checked"]["p10"]
