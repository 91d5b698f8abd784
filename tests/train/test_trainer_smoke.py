"""The trainer end to end on the CPU: a few steps on a few files of the real corpus.

The loss goes down, the snapshot it writes is one `flashpack convert` accepts (so its names,
shapes, configs and tokenizer are the real checkpoint's layout), the record holds the numbers the
later parts read, the same seed replays the same losses, and nothing the user owns is replaced.
"""

from __future__ import annotations

import json

import pytest
import torch

from flashpack.convert.pipeline import convert
from flashpack.convert.train.train import RECORD_NAME, SNAPSHOT_NAME, TrainSettings, train
from flashpack.errors import FlashpackError

SETTINGS = TrainSettings(
    size="smoke", steps=24, sequence_length=64, batch_size=8, warmup_steps=4, log_every=4, eval_every=12,
    eval_windows=4, max_train_files=24, max_held_out_files=2, device="cpu",
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    return out, train(out, SETTINGS, log=lambda _line: None)


def test_loss_goes_down_and_beats_nothing_learned(trained):
    _, record = trained
    curve = [point["main"] for point in record["loss_curve"]]
    assert len(curve) == SETTINGS.steps // SETTINGS.log_every
    assert curve[-1] < curve[0] - 0.3
    assert record["final"]["loss"] < torch.log(torch.tensor(1024.0)).item()  # below a uniform guess
    assert record["steps"] == SETTINGS.steps and record["tokens_seen"] == 24 * 8 * 64


def test_snapshot_is_converted_like_a_real_checkpoint(trained, tmp_path):
    out, _ = trained
    snapshot = out / SNAPSHOT_NAME
    config = json.loads((snapshot / "config.json").read_text())
    assert config["model_type"] == "qwen4_exp" and config["text_config"]["num_experts"] == 32
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    assert any(key.startswith("mtp.layers.0.mlp.experts.") for key in index["weight_map"])
    pack = convert(str(snapshot), tmp_path / "demo.pack", progress=False)
    manifest = json.loads((pack / "manifest.json").read_text())
    assert manifest["model"]["text_config"]["hidden_size"] == 64


def test_record_names_corpus_model_and_machine(trained):
    out, record = trained
    assert json.loads((out / RECORD_NAME).read_text()) == record
    assert record["corpus"]["version"] == "5.23.0" and record["corpus"]["held_out_files"] == 2
    assert all(path.endswith(".py") for path in record["corpus"]["held_out_paths"])
    assert record["model"]["snapshot_bytes_by_part"]["total"] > 0
    for key in ("loss", "unigram_loss", "mtp_agreement_with_greedy", "mtp_accuracy"):
        assert 0 <= record["final"][key] < 20
    assert record["machine"]["torch"] == torch.__version__


def test_same_seed_same_losses(tmp_path):
    settings = TrainSettings(**{**SETTINGS.__dict__, "steps": 4, "log_every": 2, "eval_every": 100})
    first = train(tmp_path / "a", settings, log=lambda _line: None)["loss_curve"]
    second = train(tmp_path / "b", settings, log=lambda _line: None)["loss_curve"]
    assert [p["total"] for p in first] == [p["total"] for p in second]


def test_diverged_run_stops_and_keeps_its_last_finite_weights(tmp_path):
    settings = TrainSettings(**{**SETTINGS.__dict__, "steps": 12, "log_every": 2, "warmup_steps": 1, "peak_lr": 1e3})
    record = train(tmp_path, settings, log=lambda _line: None)
    assert record["stopped_early"].startswith("non-finite loss by step 2")
    assert record["steps"] == 2 and record["final"]["loss"] == pytest.approx(6.93, abs=0.1)  # the initial weights


def test_refuses_to_replace_without_force_or_over_foreign_files(trained, tmp_path):
    out, _ = trained
    with pytest.raises(FlashpackError, match="already exists"):
        train(out, SETTINGS, log=lambda _line: None)
    (tmp_path / SNAPSHOT_NAME).mkdir()
    (tmp_path / SNAPSHOT_NAME / "notes.txt").write_text("mine")
    with pytest.raises(FlashpackError, match="refusing to overwrite"):
        train(tmp_path, SETTINGS, force=True, log=lambda _line: None)
    assert (tmp_path / SNAPSHOT_NAME / "notes.txt").read_text() == "mine"
    assert not (tmp_path / RECORD_NAME).exists()
