"""flashpack convert on the tiny preset: byte-exact NVFP4 repacking, bounded BF16 quantisation,
FP8 PLE rows, a schema-valid manifest, and a clear error for every bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from flashpack.cli import main
from flashpack.layout.checkpoint_spec import checkpoint_key, iter_specs
from flashpack.convert.nvfp4 import fp8_rows_error_bound, nvfp4_error_bound
from flashpack.convert.pipeline import convert
from flashpack.convert.source import SourceCheckpoint
from flashpack.errors import FlashpackError
from flashpack.layout.manifest import Manifest, validate_manifest
from flashpack.layout.pack import Pack
from flashpack.layout.records import PROJECTIONS


def _expert_name(cfg, layer: int, expert: int, projection: str) -> str:
    prefix = f"layers.{layer}." if layer < cfg.num_hidden_layers else f"mtp.layers.{layer - cfg.num_hidden_layers}."
    return f"{prefix}mlp.experts.{expert}.{projection}_proj.weight"


def test_nvfp4_source_records_are_byte_identical(tiny_nvfp4_snapshot, tiny_nvfp4_pack):
    source = SourceCheckpoint.open(tiny_nvfp4_snapshot)
    pack = Pack.open(tiny_nvfp4_pack)
    cfg = pack.manifest.config
    records = pack.manifest.expert_records()
    assert {r.layer for r in records} == set(range(cfg.num_hidden_layers + cfg.mtp_num_hidden_layers))
    for entry in records:
        decoded = pack.expert(entry.layer, entry.expert)
        for projection in PROJECTIONS:
            base = _expert_name(cfg, entry.layer, entry.expert, projection).removesuffix(".weight")
            assert torch.equal(decoded.nibbles[projection], source.tensor(base + ".weight"))
            assert torch.equal(
                decoded.scales[projection].view(torch.uint8), source.tensor(base + ".weight_scale").view(torch.uint8)
            )
            assert decoded.global_scales[projection] == float(source.tensor(base + ".weight_scale_2"))


def test_bf16_source_records_dequantise_within_nvfp4_bound(tiny_snapshot, tiny_pack):
    """Bound (see nvfp4_error_bound): |w - deq(w)| <= block_amax / 6 * (1 + 2^-4) per element:
    half the widest E2M1 gap (4 -> 6) is one block scale, and the FP8 block scale is within 2^-4."""
    source = SourceCheckpoint.open(tiny_snapshot)
    pack = Pack.open(tiny_pack)
    cfg = pack.manifest.config
    worst = 0.0
    for entry in pack.manifest.expert_records():
        decoded = pack.expert(entry.layer, entry.expert)
        for projection in PROJECTIONS:
            weight = source.tensor(_expert_name(cfg, entry.layer, entry.expert, projection)).float()
            error = (decoded.dequantize(projection) - weight).abs()
            bound = nvfp4_error_bound(weight)
            assert torch.all(error <= bound), (entry.layer, entry.expert, projection)
            worst = max(worst, float((error / bound).max()))
    assert worst > 0.3  # the bound is tight enough to mean something


def test_ple_rows_dequantise_within_fp8_bound(tiny_snapshot, tiny_pack):
    source = SourceCheckpoint.open(tiny_snapshot)
    pack = Pack.open(tiny_pack)
    cfg = pack.manifest.config
    (table,) = pack.manifest.ple_tables()
    shards = [s for s in iter_specs(cfg, with_mtp=False) if s.role == "ple"]
    full = torch.cat([source.tensor(s.name).float() for s in shards])
    assert full.shape == (table.rows, table.dim)
    rows = torch.randperm(table.rows, generator=torch.Generator().manual_seed(0))[:300]
    restored = pack.ple_rows(table, rows)
    assert torch.all((restored - full[rows]).abs() <= fp8_rows_error_bound(full[rows]))
    assert table.multipliers == tuple(cfg.ple_multipliers(0))


def test_dense_tensors_are_the_source_in_bf16(tiny_snapshot, tiny_pack):
    source = SourceCheckpoint.open(tiny_snapshot)
    pack = Pack.open(tiny_pack)
    for name in ("embed_tokens.weight", "layers.0.linear_attn.A_log", "lm_head.weight", "mtp.fc_hidden.weight"):
        assert torch.equal(pack.dense_tensor(name), source.tensor(name).to(torch.bfloat16))


def test_dense_fp8_stores_large_matrices_with_row_scales(tiny_snapshot, tmp_path):
    pack = Pack.open(convert(str(tiny_snapshot), tmp_path / "fp8.pack", dense_fp8=True, progress=False))
    entries = pack.manifest.dense_tensors()
    entry = entries["layers.0.linear_attn.in_proj_qkv.weight"]
    assert entry.dtype == "F8_E4M3" and entries[entry.row_scale].dtype == "F32"
    assert entries["embed_tokens.weight"].dtype == "BF16"


def test_manifest_validates_and_schema_rejects_damage(tiny_pack):
    document = json.loads((tiny_pack / "manifest.json").read_text())
    validate_manifest(document)
    document["experts"]["records"][0]["offset"] = 100  # not page aligned
    with pytest.raises(FlashpackError, match="manifest invalid at experts/records/0/offset"):
        validate_manifest(document)
    document["format_version"] = 1
    with pytest.raises(FlashpackError, match="format version 1 is not supported"):
        validate_manifest(document)


def test_records_are_page_aligned_and_sized(tiny_pack):
    manifest = Manifest.load(tiny_pack)
    geometry = manifest.geometry
    cfg = manifest.config
    assert geometry.data_bytes == 3 * cfg.hidden_size * cfg.moe_intermediate_size * (1 / 2 + 1 / 16)
    assert all(r.offset % 4096 == 0 and r.length == geometry.length for r in manifest.expert_records())


def test_inspect_check_finds_a_flipped_byte(tiny_pack, tmp_path):
    damaged = tmp_path / "damaged.pack"
    shutil.copytree(tiny_pack, damaged)
    victim = Manifest.load(damaged).expert_records()[37]
    with open(damaged / victim.file, "r+b") as handle:
        handle.seek(victim.offset + 11)
        byte = handle.read(1)
        handle.seek(victim.offset + 11)
        handle.write(bytes([byte[0] ^ 0x40]))
    runner = CliRunner()
    clean = runner.invoke(main, ["inspect", str(tiny_pack), "--check"])
    assert clean.exit_code == 0, clean.output
    result = runner.invoke(main, ["inspect", str(damaged), "--check"])
    assert result.exit_code != 0
    assert f"layer {victim.layer} expert {victim.expert}" in result.output
    with pytest.raises(FlashpackError, match=f"layer {victim.layer} expert {victim.expert}"):
        Pack.open(damaged).expert(victim.layer, victim.expert)


def test_inspect_reports_sizes(tiny_pack):
    result = CliRunner().invoke(main, ["inspect", str(tiny_pack)])
    assert result.exit_code == 0
    assert "expert bytes/token" in result.output and "ple tables            1" in result.output


# --- bad input: one clear line, non-zero exit, nothing left that looks like a pack -------------


def _copy(snapshot, tmp_path):
    target = tmp_path / "snap"
    shutil.copytree(snapshot, target)
    return target


def _convert_fails(source, out, match):
    result = CliRunner().invoke(main, ["convert", str(source), str(out), "--quiet"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and len(result.output.strip().splitlines()) == 1, result.output
    assert match in result.output, result.output
    assert not out.exists()
    assert not any(p.name.startswith(f".{out.name}.partial") for p in out.parent.iterdir())


def _shards(snapshot):
    return sorted(snapshot.glob("*.safetensors"))


def test_missing_shard(tiny_snapshot, tmp_path):
    snap = _copy(tiny_snapshot, tmp_path)
    _shards(snap)[-1].unlink()
    _convert_fails(snap, tmp_path / "out", "is missing")


def test_truncated_shard(tiny_snapshot, tmp_path):
    snap = _copy(tiny_snapshot, tmp_path)
    shard = _shards(snap)[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    _convert_fails(snap, tmp_path / "out", "truncated")


def test_index_naming_a_missing_file(tiny_snapshot, tmp_path):
    snap = _copy(tiny_snapshot, tmp_path)
    index = json.loads((snap / "model.safetensors.index.json").read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = "model-99999-of-99999.safetensors"
    (snap / "model.safetensors.index.json").write_text(json.dumps(index))
    _convert_fails(snap, tmp_path / "out", "model-99999-of-99999.safetensors")


def test_unsupported_model_type(tiny_snapshot, tmp_path):
    snap = _copy(tiny_snapshot, tmp_path)
    config = json.loads((snap / "config.json").read_text())
    config["model_type"] = "llama"
    (snap / "config.json").write_text(json.dumps(config))
    _convert_fails(snap, tmp_path / "out", "unsupported model_type 'llama'")


def test_shapes_that_disagree_with_the_config(tiny_snapshot, tmp_path):
    snap = _copy(tiny_snapshot, tmp_path)
    config = json.loads((snap / "config.json").read_text())
    text = config.get("text_config", config)
    text["moe_intermediate_size"] *= 2
    (snap / "config.json").write_text(json.dumps(config))
    _convert_fails(snap, tmp_path / "out", "but the config implies")


def _rewrite_tensor(snapshot, key, tensor):
    from safetensors.torch import load_file, save_file

    for shard in _shards(snapshot):
        tensors = load_file(shard)
        if key in tensors:
            tensors[key] = tensor
            save_file(tensors, shard, metadata={"format": "pt"})
            return
    raise AssertionError(key)


def test_nvfp4_tensor_of_wrong_dtype(tiny_nvfp4_snapshot, tmp_path):
    snap = _copy(tiny_nvfp4_snapshot, tmp_path)
    cfg = SourceCheckpoint.open(snap).config
    form = json.loads((snap / "config.json").read_text())["model_type"]
    key = checkpoint_key("layers.1.mlp.experts.2.up_proj.weight_scale", form)
    shape = (cfg.moe_intermediate_size, cfg.hidden_size // 16)
    _rewrite_tensor(snap, key, torch.ones(shape, dtype=torch.bfloat16))
    _convert_fails(snap, tmp_path / "out", "expected float8_e4m3fn")


def test_nvfp4_tensor_of_wrong_shape(tiny_nvfp4_snapshot, tmp_path):
    snap = _copy(tiny_nvfp4_snapshot, tmp_path)
    cfg = SourceCheckpoint.open(snap).config
    form = json.loads((snap / "config.json").read_text())["model_type"]
    key = checkpoint_key("layers.2.mlp.experts.0.down_proj.weight", form)
    _rewrite_tensor(snap, key, torch.zeros((cfg.hidden_size, cfg.moe_intermediate_size), dtype=torch.uint8))
    _convert_fails(snap, tmp_path / "out", "but the config implies")


def test_existing_pack_needs_force(tiny_snapshot, tiny_pack, tmp_path):
    out = tmp_path / "again.pack"
    shutil.copytree(tiny_pack, out)
    result = CliRunner().invoke(main, ["convert", str(tiny_snapshot), str(out), "--quiet"])
    assert result.exit_code == 2 and "already exists (use --force" in result.output
    result = CliRunner().invoke(main, ["convert", str(tiny_snapshot), str(out), "--quiet", "--force"])
    assert result.exit_code == 0, result.output
    Pack.open(out)


def test_no_space_left_is_checked_up_front(tiny_snapshot, tmp_path, monkeypatch):
    import shutil as shutil_module
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    _convert_fails(tiny_snapshot, tmp_path / "out", "no space left")


def test_no_space_left_mid_write_cleans_up(tiny_snapshot, tmp_path, monkeypatch):
    import errno

    from flashpack.convert import pipeline

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pipeline, "write_dense", full_disk)
    _convert_fails(tiny_snapshot, tmp_path / "out", "no space left on the device")


def test_missing_source(tmp_path):
    _convert_fails(tmp_path / "nowhere", tmp_path / "out", "neither a directory nor a hub repo id")


def test_hub_repo_id_resolves_from_the_offline_cache(tiny_snapshot, tmp_path, monkeypatch):
    """A repo id goes through huggingface_hub, which with HF_HUB_OFFLINE serves the local cache."""
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--flashpack-tests--tiny"
    shutil.copytree(tiny_snapshot, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    pack = convert("flashpack-tests/tiny", tmp_path / "hub.pack", progress=False)
    assert Manifest.load(pack).document["source"]["repo_id"] == "flashpack-tests/tiny"
    _convert_fails("flashpack-tests/absent", tmp_path / "absent.pack", "not in the local Hugging Face cache")


def test_full_preset_layer_converts_in_bounded_memory(tmp_path):
    """Real dimensions, one layer (16 experts to keep CI fast): the convert's peak RSS must sit far
    below what it writes (2.6 GB of embeddings alone). VmHWM of the child's own address space is
    the measure: ru_maxrss would also count the pytest parent's pages copied at fork."""
    import subprocess
    import sys

    from flashpack.convert.synth import synthesize

    snapshot = synthesize("full", tmp_path / "full1", layers=1, experts=16, ple_rows_per_head=2000, seed=0)
    pack = tmp_path / "full1.pack"
    script = (
        "import sys; from flashpack.convert.pipeline import convert; convert(sys.argv[1], sys.argv[2], progress=False);"
        "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])"
    )
    result = subprocess.run([sys.executable, "-c", script, str(snapshot), str(pack)], check=True,
                            capture_output=True, text=True)
    peak_rss = int(result.stdout.split()[-1]) * 1024
    written = sum(p.stat().st_size for p in pack.rglob("*") if p.is_file())
    assert written > 2.5e9
    assert peak_rss < written / 4, (peak_rss, written)
