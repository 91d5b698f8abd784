"""The committed demo model: where the package says it is, the trainer's demo dimensions, within its
size, its recorded numbers at the issue's targets, and a snapshot `flashpack convert` takes."""

from __future__ import annotations

import json

from flashpack import demo_model
from flashpack.convert.pipeline import convert
from flashpack.convert.train.model_config import text_config_dict

MAX_SNAPSHOT_BYTES = 32_000_000


def test_snapshot_has_the_trainers_demo_dims_and_fits():
    snapshot = demo_model.snapshot_path()
    config = json.loads((snapshot / "config.json").read_text())
    assert config["text_config"] == text_config_dict("demo")
    assert sum(f.stat().st_size for f in snapshot.iterdir()) <= MAX_SNAPSHOT_BYTES


def test_recorded_numbers_meet_the_targets():
    record = demo_model.training_record()
    final = record["final"]
    assert final["loss"] < final["unigram_loss"] / 2  # clearly below the unigram baseline
    assert final["mtp_agreement_with_greedy"] >= 0.4
    assert record["corpus"]["version"] == "5.23.0" and record["stopped_early"] is None
    assert record["model"]["text_config"] == text_config_dict("demo")


def test_flashpack_convert_accepts_it(tmp_path):
    pack = convert(str(demo_model.snapshot_path()), tmp_path / "demo.pack", progress=False)
    assert json.loads((pack / "manifest.json").read_text())["model"]["text_config"]["num_experts"] == 32
