"""flashpack verify on the tiny preset: our engine from the pack against transformers' layers fed the
snapshot's weights as the pack should hold them.

Gates (verify/compare.py): FP32, every decoder layer and the logits at relative error <= 1e-5;
BF16, 3x the floor transformers itself shows in BF16. Every control (a broken but self-consistent
copy of the pack) must fail, and a reference that is not the pack's source is refused up front.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from flashpack.convert.pipeline import convert
from flashpack.convert.synth import synthesize
from flashpack.errors import FlashpackError
from flashpack.layout.manifest import Manifest
from flashpack.layout.pack import Pack
from flashpack.runtime.tokenizer import PackTokenizer
from flashpack.verify import verify_pack
from flashpack.verify.compare import BF16_FLOOR_FACTOR, FP32, Errors, errors, worst
from flashpack.verify.controls import CONTROLS
from flashpack.verify.expected import ExpectedWeights
from flashpack.verify.inputs import Sequence, prompt_sequences
from flashpack.verify.match import open_reference
from flashpack.verify.ours import run_engine
from flashpack.verify.reference import LayerwiseReference
from flashpack.verify.report import Row



@pytest.fixture(scope="module")
def fp32_report(tiny_pack, tiny_snapshot, tmp_path_factory):
    json_path = tmp_path_factory.mktemp("verify") / "report.json"
    return verify_pack(tiny_pack, tiny_snapshot, json_path=json_path), json_path


def _assert_fp32_bar(report):
    assert report.passed, report.table()
    for row in report.rows:
        assert row.errors.rel <= FP32.rel, f"{row.name}: {row.errors.rel:.2e}"
    assert report.logit_stats.top1 == 1.0


def test_fp32_bf16_source_passes_every_layer(fp32_report):
    report, _ = fp32_report
    _assert_fp32_bar(report)
    cfg = Manifest.load(Path(report.pack)).config
    assert [row.name for row in report.rows] == [f"layer {i}" for i in range(cfg.num_hidden_layers)] + ["logits"]
    # The default inputs run past the indexer budget and hold EOS tokens (PLE boundaries).
    names = {s.name: s for s in report.sequences}
    assert len(names["past-budget"].prefill) > cfg.indexer_budget + cfg.indexer_compress_ratio
    assert cfg.eos_token_id in names["past-budget"].prefill and names["eos-first"].prefill[0] == cfg.eos_token_id


def test_fp32_nvfp4_source_passes_every_layer(tiny_nvfp4_pack, tiny_nvfp4_snapshot):
    _assert_fp32_bar(verify_pack(tiny_nvfp4_pack, tiny_nvfp4_snapshot, decode_tokens=4))


def test_fp32_dense_fp8_pack_passes(tiny_snapshot, tmp_path):
    """--dense-fp8 packs: the reference applies the same FP8 row rounding to the eligible matrices."""
    pack = convert(str(tiny_snapshot), tmp_path / "fp8.pack", dense_fp8=True, progress=False)
    _assert_fp32_bar(verify_pack(pack, tiny_snapshot, decode_tokens=2))


def test_bf16_gates_scale_from_the_measured_floor(tiny_pack, tiny_snapshot):
    report = verify_pack(tiny_pack, tiny_snapshot, dtype="bfloat16", decode_tokens=2)
    assert report.passed, report.table()
    for row in report.rows:
        assert 1e-4 < row.floor < 0.1  # BF16 rounding, not a bug
        assert row.tolerance == pytest.approx(max(BF16_FLOOR_FACTOR * row.floor, FP32.rel))


@pytest.mark.parametrize("control", CONTROLS)
def test_every_control_fails(tiny_pack, tiny_snapshot, control):
    report = verify_pack(tiny_pack, tiny_snapshot, control=control, decode_tokens=0)
    assert not report.passed
    assert report.control == control and "as it must" in report.verdict
    assert not any(row.passed for row in report.rows)  # the damage shows from the first layer on
    assert not list(tiny_pack.parent.glob(f".{tiny_pack.name}.control-*"))  # the copy is gone


def test_json_report_structure(fp32_report):
    report, json_path = fp32_report
    document = json.loads(json_path.read_text())
    assert document == json.loads(json.dumps(report.to_json()))
    assert document["passed"] is report.passed and document["verdict"] == report.verdict
    assert document["dtype"] == "float32" and document["control"] is None
    assert {"kl_mean", "top1"} <= set(document["gates"])
    assert [i["name"] for i in document["inputs"]] == ["past-budget", "eos-first"]
    assert len(document["layers"]) == len(report.rows) - 1
    for row in document["layers"] + [document["logits"]]:
        assert {"name", "kind", "max_abs", "rel", "cos", "tolerance", "passed", "sequences"} <= set(row)
        assert set(row["sequences"]) == {"past-budget", "eos-first"}
        for phases in row["sequences"].values():
            assert set(phases) == {"prefill", "decode"}
            assert set(phases["decode"]) == {"max_abs", "rel", "cos"}
    assert {"kl_mean", "kl_max", "top1", "positions"} <= set(document["logits"])
    assert document["logits"]["positions"] == sum(i["prefill_tokens"] + i["decode_tokens"] for i in document["inputs"])
    assert "kind" in report.table() and f"verdict: {report.verdict}" in report.table()


def test_reference_from_another_seed_is_refused(tiny_pack, tmp_path):
    other = synthesize("tiny", tmp_path / "other-seed", format="bf16", seed=1)
    with pytest.raises(FlashpackError, match="not the snapshot the pack was converted from.*xxh64"):
        verify_pack(tiny_pack, other)


def test_reference_with_another_config_is_refused(tiny_pack, tiny_snapshot, tmp_path):
    config = json.loads((tiny_snapshot / "config.json").read_text())
    config["text_config"]["rms_norm_eps"] = 1e-5
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FlashpackError, match="another model than the pack.*rms_norm_eps"):
        verify_pack(tiny_pack, tmp_path)


def _pack_copy(pack, out, drop=None):
    out.mkdir()
    for item in pack.iterdir():
        if item.name != drop:
            (out / item.name).symlink_to(item)
    return out


def test_broken_pack_and_bad_inputs_are_refused(tiny_pack, tiny_snapshot, tmp_path):
    with pytest.raises(FlashpackError, match="dense.safetensors is missing"):
        verify_pack(_pack_copy(tiny_pack, tmp_path / "missing", drop="dense.safetensors"), tiny_snapshot)
    newer = _pack_copy(tiny_pack, tmp_path / "newer", drop="manifest.json")
    manifest = json.loads((tiny_pack / "manifest.json").read_text())
    (newer / "manifest.json").write_text(json.dumps({**manifest, "format_version": 3}))
    with pytest.raises(FlashpackError, match="format version 3 is not supported"):
        verify_pack(newer, tiny_snapshot)
    with pytest.raises(FlashpackError, match="longer than the model's context"):
        verify_pack(tiny_pack, tiny_snapshot, prompts=["the cat sat on the mat. " * 1500])
    with pytest.raises(FlashpackError, match="unknown control"):
        verify_pack(tiny_pack, tiny_snapshot, control="flip-signs")
    with pytest.raises(FlashpackError, match="unsupported dtype"):
        verify_pack(tiny_pack, tiny_snapshot, dtype="float16")


def test_prompts_are_split_into_prefill_and_teacher_forced_decode(tiny_pack):
    text = "The quick brown fox jumps over the lazy dog."
    (sequence,) = prompt_sequences(tiny_pack, [text], decode_tokens=3)
    assert list(sequence.prefill + sequence.decode) == PackTokenizer.load(tiny_pack).encode(text)
    assert len(sequence.decode) == 3 and sequence.steps[1:] == [[t] for t in sequence.decode]
    with pytest.raises(FlashpackError, match="needs more than --decode-tokens"):
        prompt_sequences(tiny_pack, ["fox"], decode_tokens=8)


def test_missing_snapshot_file_is_refused(tiny_pack, tiny_snapshot, tmp_path):
    copy = tmp_path / "partial"
    shutil.copytree(tiny_snapshot, copy)
    shard = sorted(copy.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FlashpackError, match="missing|lacks"):
        verify_pack(tiny_pack, copy)


def test_metrics_keep_nan_and_fail_on_it():
    good = errors(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    assert good == Errors(0.0, 0.0, 1.0)
    bad = errors(torch.tensor([float("nan"), 2.0]), torch.tensor([1.0, 2.0]))
    assert math.isnan(worst(good, bad).rel) and math.isnan(worst(bad, good).rel)
    assert not Row("layer 0", "linear_attention", {"s": {"prefill": good, "decode": bad}}, 1e-5).passed
    # chunked sums agree with the one-shot formula
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(1000, generator=gen).double(), torch.randn(1000, generator=gen).double()
    chunked = errors(a, b, chunk=7)
    assert chunked.rel == pytest.approx(((a - b).norm() / b.norm()).item(), rel=1e-12)
    assert chunked.cos == pytest.approx((a @ b / a.norm() / b.norm()).item(), rel=1e-12)


def test_fp32_verify_runs_without_tf32_anywhere(monkeypatch):
    """Inside verify, float32 is IEEE float32: cuBLAS, cuDNN and Triton's dots (whose default for
    float32 is TF32, which flash-linear-attention's kernels keep) are told so, and put back after."""
    import os

    from flashpack.verify.run import TRITON_F32_DEFAULT, ieee_fp32

    monkeypatch.setenv(TRITON_F32_DEFAULT, "tf32")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    with ieee_fp32():
        assert os.environ[TRITON_F32_DEFAULT] == "ieee"
        assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    assert os.environ[TRITON_F32_DEFAULT] == "tf32" and torch.backends.cudnn.allow_tf32
    monkeypatch.delenv(TRITON_F32_DEFAULT)
    with ieee_fp32():
        pass
    assert TRITON_F32_DEFAULT not in os.environ


def test_the_engine_and_reference_runs_show_their_progress(tiny_pack, tiny_snapshot, capsys):
    """A GPU verify spends minutes in its first engine calls (Triton builds kernels): bars say where it is."""
    pack = Pack.open(tiny_pack)
    try:
        sequences = [Sequence("short", (1, 2, 3), (4, 5))]
        traces = run_engine(pack, sequences, torch.float32, "cpu", progress=True)
        weights = ExpectedWeights(open_reference(pack.manifest, tiny_snapshot), dense_fp8_rows=False)
        logits = LayerwiseReference(weights).run(sequences, progress=True)
    finally:
        pack.close()
    bars = capsys.readouterr().err
    layers = pack.manifest.config.num_hidden_layers
    assert "engine: 100%" in bars and "3/3" in bars
    assert "reference (float32): 100%" in bars and f"{layers}/{layers}" in bars
    torch.testing.assert_close(traces[0].logits, logits[0], rtol=1e-4, atol=1e-4)
