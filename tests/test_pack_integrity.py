"""Every byte of a pack is covered by a checksum: one flipped byte in each kind of file, or one
changed number in the manifest, is named by `inspect --check` and refused by `load_engine` with one
PackDamageError line (a PLE block: by the first read that touches it). The control, an untouched
copy, passes every check."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from flashpack.cli import main
from flashpack.errors import FlashpackError, PackDamageError
from flashpack.layout.checksums import BLOCK_BYTES, stamp_manifest
from flashpack.layout.integrity import check_pack
from flashpack.layout.manifest import Manifest, write_manifest
from flashpack.layout.pack import Pack
from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.pack_source import PackExperts
from flashpack.runtime.sampling import SamplingParams
from flashpack.runtime.store.hotset import reorder_pack, save_hot_set

SMALL_BLOCKS = 4096  # dense re-hashed in pages: a failing block names one tensor or a few


@pytest.fixture
def copy(tiny_pack, tmp_path):
    return shutil.copytree(tiny_pack, tmp_path / "copy.pack")


def flip(path, offset: int) -> None:
    """XOR one byte with 0xFF: it really changes."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 0xFF]))


def rehash_blocks(root, role: str, block_bytes: int) -> None:
    """Re-hash the files of `role` in blocks of another size, through the manifest's one writer."""
    document = Manifest.load(root).document
    blocked = [entry for entry in document["files"] if entry["role"] == role]
    for entry in blocked:
        entry["block_bytes"] = block_bytes
    write_manifest(root, document, rewritten=[entry["path"] for entry in blocked])


def inspect_check(root):
    return CliRunner().invoke(main, ["inspect", str(root), "--check"])


def refused_at_load(root) -> str:
    with pytest.raises(PackDamageError) as refused:
        load_engine(root)
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_control_an_untouched_copy_passes_every_check(copy):
    result = inspect_check(copy)
    assert result.exit_code == 0, result.output
    for kind in ("manifest ", "files ", "expert records "):
        assert any(line.startswith(kind) for line in result.output.splitlines()), result.output
    engine = load_engine(copy)
    ids = engine.tokenizer.encode("the cat sat on the mat")
    assert engine.generator.generate(ids, SamplingParams(max_tokens=3)).completion_tokens == 3
    assert engine.pack.block_checker("ple/layer-000.bin").verified.all()  # the PLE block was read and checked


@pytest.mark.parametrize("block_bytes", [BLOCK_BYTES["dense"], SMALL_BLOCKS])
@pytest.mark.parametrize("tensor", ["lm_head.weight", "hyper_connection_mixer.hc_norm.weight"])
def test_a_flipped_dense_byte_is_named_and_refused_at_load(copy, tensor, block_bytes):
    if block_bytes != BLOCK_BYTES["dense"]:
        rehash_blocks(copy, "dense", block_bytes)
    entry = Manifest.load(copy).dense_tensors()[tensor]
    flip(copy / "dense.safetensors", entry.offset + entry.length // 2)
    block = (entry.offset + entry.length // 2) // block_bytes
    result = inspect_check(copy)
    assert result.exit_code == 2 and "1 problem(s)" in result.output
    assert f"dense.safetensors block {block} " in result.output
    if block_bytes == SMALL_BLOCKS and tensor == "lm_head.weight":  # its blocks hold nothing else
        assert f"tensor {tensor})" in result.output
    message = refused_at_load(copy)
    assert f"dense.safetensors block {block} " in message
    if block_bytes == SMALL_BLOCKS and tensor == "lm_head.weight":
        assert message.endswith(f"(found reading {tensor})")  # a block's first reader is the one that finds it


def test_ple_blocks_are_checked_on_first_touch(copy):
    table = Manifest.load(copy).ple_tables()[0]
    rows_per_block = BLOCK_BYTES["ple"] // table.row_stride
    value_row, scale_row = 3 * rows_per_block + 7, 9 * rows_per_block + 1
    flip(copy / table.file, value_row * table.row_stride + 1)  # one FP8 value
    flip(copy / table.file, scale_row * table.row_stride + table.dim + 3)  # the float32 scale's top byte
    result = inspect_check(copy)
    assert result.exit_code == 2 and "2 problem(s)" in result.output
    for block in (3, 9):
        assert f"{table.file} block {block} " in result.output and f"PLE layer {table.layer}" in result.output
    pack = Pack.open(copy)  # PLE blocks are not read at open
    checker = pack.block_checker(table.file)
    pack.ple_rows(table, torch.tensor([5, 4 * rows_per_block]))  # blocks 0 and 4 are intact
    assert checker.verified[[0, 4]].all() and checker.verified.sum() == 2
    for row, block in ((value_row, 3), (scale_row, 9)):
        with pytest.raises(PackDamageError, match=rf"{table.file} block {block} \(.*PLE layer {table.layer}, rows"):
            pack.ple_rows(table, torch.tensor([0, row]))
    assert not checker.verified[[3, 9]].any()
    pack.close()


def test_a_damaged_ple_block_fails_the_first_generation_that_reads_it(copy):
    rehash_blocks(copy, "ple", 1 << 20)  # the tiny table in one block: every lookup touches it
    table = Manifest.load(copy).ple_tables()[0]
    flip(copy / table.file, 11)
    engine = load_engine(copy)  # loads: PLE blocks wait for their first read
    with pytest.raises(PackDamageError, match=rf"{table.file} block 0 .*PLE layer {table.layer}"):
        engine.generator.generate(engine.tokenizer.encode("the cat sat on the mat"), SamplingParams(max_tokens=2))


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_tokenizer_files_and_chat_template_are_checked_at_load(copy, name):
    path = copy / "tokenizer" / name
    text = path.read_bytes()
    # tokenizer_config.json: a byte inside the chat template; tokenizer.json: one in the middle
    offset = text.index(b"<|im_start|>", text.index(b'"chat_template"')) + 2 if name == "tokenizer_config.json" else len(text) // 2
    flip(path, offset)
    result = inspect_check(copy)
    assert result.exit_code == 2 and f"tokenizer/{name} fails its whole-file xxh64 check" in result.output
    assert f"tokenizer/{name} fails its xxh64 check" in refused_at_load(copy)


def test_a_flipped_record_byte_is_named_and_fails_its_first_read(copy):
    victim = Manifest.load(copy).expert_records()[100]
    flip(copy / victim.file, victim.offset + 17)
    result = inspect_check(copy)
    assert result.exit_code == 2
    assert f"corrupt expert record: layer {victim.layer} expert {victim.expert}" in result.output
    engine = load_engine(copy)  # records are checked on first read, not at load
    with pytest.raises(PackDamageError, match=f"layer {victim.layer} expert {victim.expert} fails its xxh64"):
        PackExperts(engine.pack).fetch(victim.layer, [victim.expert])
    PackExperts(engine.pack, verify_records=False).fetch(victim.layer, [victim.expert])  # --no-verify-records


def test_a_flipped_byte_between_records_fails_the_whole_file_hash(copy):
    manifest = Manifest.load(copy)
    victim = manifest.expert_records()[0]
    flip(copy / victim.file, victim.offset + victim.length + 5)  # the record's page padding
    result = inspect_check(copy)
    assert result.exit_code == 2 and "1 problem(s)" in result.output
    assert f"{victim.file} fails its whole-file xxh64 check" in result.output


@pytest.mark.parametrize("path", ["dense.safetensors.xxh64", "ple/layer-000.bin.xxh64"])
def test_a_flipped_byte_in_a_digest_file_is_named_and_refused_at_load(copy, path):
    flip(copy / path, 3)
    result = inspect_check(copy)
    assert result.exit_code == 2 and f"{path} fails its whole-file xxh64 check" in result.output
    assert f"{path} fails its xxh64 check" in refused_at_load(copy)


def _edit(root, change) -> None:
    """Change the manifest on disk as a hand edit would, leaving its stale manifest_xxh64."""
    document = json.loads((root / "manifest.json").read_text())
    change(document)
    (root / "manifest.json").write_text(json.dumps(document, indent=1))


def _set_tensor_offset(document):
    entry = document["dense"]["tensors"][5]
    entry["offset"] += 1 if entry["offset"] % 10 < 9 else -1  # one digit


def _set(key, value):
    return lambda document: document["model"]["text_config"].__setitem__(key, value)


@pytest.mark.parametrize("change", [
    _set_tensor_offset, _set("rms_norm_eps", 2e-06), _set("num_experts_per_tok", 5), _set("eos_token_id", 993),
], ids=["tensor offset", "rms_norm_eps", "num_experts_per_tok", "eos_token_id"])
def test_a_changed_manifest_number_fails_the_manifest_hash(copy, change):
    _edit(copy, change)
    result = inspect_check(copy)
    assert result.exit_code == 2 and "manifest.json fails its xxh64 check" in result.output
    assert "manifest.json fails its xxh64 check" in refused_at_load(copy)


def test_rms_norm_eps_is_caught_by_the_manifest_hash_alone(copy):
    """Any float is a valid epsilon: once the hash is re-stamped the pack opens (nothing else can
    tell), so the self-hash above is what catches a changed one."""
    def change(document):
        _set("rms_norm_eps", 2e-06)(document)
        stamp_manifest(document)
    _edit(copy, change)
    assert Pack.open(copy).manifest.config.rms_norm_eps == 2e-06


def test_every_writer_restamps_and_rehashes_what_it_rewrote(copy):
    profile = {"version": 1, "created_by": "test", "unit": "fetches", "workload": {}, "reordered": False,
               "layers": [{"layer": 0, "requests": 3, "experts": [9, 4], "counts": [3, 2]}]}
    save_hot_set(copy, "hot", profile)
    assert Manifest.load(copy).hot_sets["hot"]["layers"][0]["experts"] == [9, 4]
    before = Manifest.load(copy).file_entry("experts/layer-000.bin")["xxh64"]
    reorder_pack(copy, "hot")
    after = Manifest.load(copy).file_entry("experts/layer-000.bin")["xxh64"]
    assert after != before and check_pack(copy, progress=False).passed
    # Control: a writer that does not name the file it rewrote leaves a pack that fails its check.
    document = Manifest.load(copy).document
    document["files"] = [dict(entry, xxh64=before) if entry["path"] == "experts/layer-000.bin" else entry
                         for entry in document["files"]]
    write_manifest(copy, document)
    assert check_pack(copy, progress=False).problems == ["pack damaged: experts/layer-000.bin fails its whole-file xxh64 check"]


def test_a_version_1_pack_is_told_to_reconvert(copy):
    _edit(copy, lambda document: document.update(format_version=1))
    with pytest.raises(FlashpackError, match="version 1 is not supported.*re-run `flashpack convert`") as refused:
        Pack.open(copy)
    assert not isinstance(refused.value, PackDamageError)
