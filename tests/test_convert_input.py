"""`flashpack convert` validates its input (issue 22, section 3): every damaged shard header, index,
config, tokenizer, OUT parent or disk error below is one line and exit 2 from the CLI, a
FlashpackError from the keyword function, and leaves nothing behind (no OUT, no staging directory,
no parent folder it created). Files named by the index or copied as tokenizer files stay inside the
snapshot, a hub cache snapshot's links into its own blobs folder excepted."""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashpack.cli import main
from flashpack.convert import pipeline
from flashpack.convert.pipeline import convert
from flashpack.errors import FlashpackError
from flashpack.layout.manifest import Manifest

EMBED = "model.language_model.embed_tokens.weight"  # the first tensor of the tiny snapshot's first shard
INDEX = "model.safetensors.index.json"


def _copy(snapshot: Path, tmp_path: Path) -> Path:
    target = tmp_path / "snap"
    shutil.copytree(snapshot, target, symlinks=True)
    return target


def _nothing_left(out: Path, fresh_parent: Path | None) -> None:
    assert not out.exists() and not out.is_symlink()
    if fresh_parent is not None:
        assert not fresh_parent.exists(), "a parent folder convert created was left behind"
    elif out.parent.is_dir():
        leftovers = [p.name for p in out.parent.iterdir() if re.fullmatch(rf"\.{re.escape(out.name)}\.\w+-\d+", p.name)]
        assert not leftovers, leftovers


def _refused(source, tmp_path: Path, match: str, out: Path | None = None) -> None:
    """The keyword function raises FlashpackError and the CLI prints one `error:` line, exit 2."""
    fresh_parent = None
    if out is None:
        fresh_parent = tmp_path / "fresh"
        out = fresh_parent / "out.pack"
    with pytest.raises(FlashpackError, match=re.escape(match)):
        convert(str(source), out, progress=False)
    _nothing_left(out, fresh_parent)
    result = CliRunner().invoke(main, ["convert", str(source), str(out), "--quiet"])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], result.output
    _nothing_left(out, fresh_parent)


def _shards(snapshot: Path) -> list[Path]:
    return sorted(snapshot.glob("model-*.safetensors"))


def _edit_header(shard: Path, edit) -> None:
    data = shard.read_bytes()
    length = struct.unpack("<Q", data[:8])[0]
    header = edit(json.loads(data[8:8 + length]))
    encoded = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length:])


def _edit_entry(key: str, change):
    def edit(header):
        change(header[key])
        return header
    return edit


def _second_key(header) -> str:
    return [k for k in header if k != "__metadata__"][1]


def _overlap(header):
    second = header[_second_key(header)]
    length = second["data_offsets"][1] - second["data_offsets"][0]
    second["data_offsets"] = [0, length]  # inside the embedding's bytes
    return header


def _unknown_dtype(header):
    key = next(k for k in header if k.startswith("model.visual."))
    begin, end = header[key]["data_offsets"]
    header[key].update(dtype="F64", shape=[(end - begin) // 8])
    return header


HEADER_DAMAGE = {
    "header a list": (0, lambda h: list(h), "its header is not a JSON object"),
    "no data_offsets": (0, _edit_entry(EMBED, lambda e: e.pop("data_offsets")), "has data_offsets None"),
    "entry a list": (0, lambda h: {**h, EMBED: list(h[EMBED].values())}, "its header entry is list, not an object"),
    "offsets short of the shape": (
        0, _edit_entry(EMBED, lambda e: e.update(data_offsets=[0, 131070])), "spans 131070 bytes, but BF16 [1024, 64] needs 131072"),
    "begin after end": (0, _edit_entry(EMBED, lambda e: e.update(data_offsets=[10, 5])), "0 <= begin <= end"),
    "offsets as strings": (0, _edit_entry(EMBED, lambda e: e.update(data_offsets=["0", "131072"])), "expected [begin, end]"),
    "negative dimension": (0, _edit_entry(EMBED, lambda e: e.update(shape=[-1024, -64])), "non-negative integers"),
    "overlapping tensors": (0, _overlap, "overlap"),
    "metadata a string": (0, lambda h: {**h, "__metadata__": "pt"}, "__metadata__ is not an object"),
    "unknown dtype": (-1, _unknown_dtype, "has dtype 'F64', which flashpack does not read"),
}


@pytest.mark.parametrize("case", HEADER_DAMAGE, ids=list(HEADER_DAMAGE))
def test_shard_header_damage(tiny_snapshot, tmp_path, case):
    shard_index, edit, match = HEADER_DAMAGE[case]
    snap = _copy(tiny_snapshot, tmp_path)
    _edit_header(_shards(snap)[shard_index], edit)
    _refused(snap, tmp_path, match)


def _map_first(value):
    def edit(index, snap, outside):
        index["weight_map"][EMBED] = value
        return index
    return edit


def _first_shard_moved_out(name_for):
    """Every key of the first shard mapped to a copy outside the snapshot, the shard itself gone:
    without the containment check that copy is read and recorded in the manifest."""
    def edit(index, snap, outside):
        shard = _shards(snap)[0]
        target = name_for(outside / shard.name, snap)
        for key, file in index["weight_map"].items():
            if file == shard.name:
                index["weight_map"][key] = target
        shard.unlink()
        return index
    return edit


INDEX_DAMAGE = {
    "index a list": (lambda index, snap, outside: [index], "must be a JSON object, got list"),
    "weight_map a list": (lambda index, snap, outside: {**index, "weight_map": list(index["weight_map"])},
                          "has no weight_map object"),
    "shard name a number": (_map_first(7), "not a shard file name"),
    "absolute shard path": (_first_shard_moved_out(lambda path, snap: str(path)), "is an absolute path"),
    "shard path climbing out": (_first_shard_moved_out(lambda path, snap: f"../{path.parent.name}/{path.name}"),
                                "climbs out with '..'"),
}


@pytest.mark.parametrize("case", INDEX_DAMAGE, ids=list(INDEX_DAMAGE))
def test_index_damage(tiny_snapshot, tmp_path, case):
    edit, match = INDEX_DAMAGE[case]
    snap = _copy(tiny_snapshot, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(_shards(snap)[0], outside)
    (snap / INDEX).write_text(json.dumps(edit(json.loads((snap / INDEX).read_text()), snap, outside)))
    _refused(snap, tmp_path, match)


def test_shard_linked_outside_the_snapshot_is_refused(tiny_snapshot, tmp_path):
    snap = _copy(tiny_snapshot, tmp_path)
    shard = _shards(snap)[0]
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move(shard, elsewhere)
    shard.symlink_to(elsewhere)
    _refused(snap, tmp_path, f"shard {shard.name} is a link to {elsewhere}, outside the snapshot")


def _hub_cache(snapshot: Path, cache: Path, repo: str) -> Path:
    """A Hugging Face cache layout: snapshots/<commit>/<file> -> ../../blobs/<hash>."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "blobs").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    for number, path in enumerate(sorted(snapshot.iterdir())):
        blob = f"blob{number:04d}"
        shutil.copy(path, folder / "blobs" / blob)
        (snap / path.name).symlink_to(Path("..") / ".." / "blobs" / blob)
    return snap


def _offline_cache(monkeypatch, cache: Path) -> None:
    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)


def test_hub_snapshot_links_into_its_own_blobs_are_allowed(tiny_snapshot, tmp_path, monkeypatch):
    snap = _hub_cache(tiny_snapshot, tmp_path / "hub", "flashpack-tests/tiny")
    _offline_cache(monkeypatch, tmp_path / "hub")
    by_id = convert("flashpack-tests/tiny", tmp_path / "by-id.pack", progress=False)
    by_path = convert(str(snap), tmp_path / "by-path.pack", progress=False)
    assert Manifest.load(by_id).document["source"]["repo_id"] == "flashpack-tests/tiny"
    assert Manifest.load(by_path).document["tokenizer"]["files"]


def test_hub_snapshot_link_into_another_repos_blobs_is_refused(tiny_snapshot, tmp_path):
    snap = _hub_cache(tiny_snapshot, tmp_path / "hub", "flashpack-tests/tiny")
    other = _hub_cache(tiny_snapshot, tmp_path / "hub", "someone/else")
    shard = _shards(snap)[0]
    shard.unlink()
    shard.symlink_to((other / shard.name).resolve())
    _refused(snap, tmp_path, "outside the snapshot")


def _edit_config(edit):
    def apply(snap: Path) -> None:
        config = json.loads((snap / "config.json").read_text())
        edit(config)
        (snap / "config.json").write_text(json.dumps(config))
    return apply


def _text_field(name, value):
    return _edit_config(lambda config: config["text_config"].__setitem__(name, value))


CONFIG_DAMAGE = {
    "config a list": (lambda snap: (snap / "config.json").write_text("[1, 2]"), "config.json must be a JSON object"),
    "no text_config": (_edit_config(lambda c: c.pop("text_config")), "needs a text_config object"),
    "text_config a string": (_edit_config(lambda c: c.__setitem__("text_config", "x")), "needs a text_config object"),
    "hidden_size a string": (_text_field("hidden_size", "abc"), "hidden_size must be an integer, got 'abc'"),
    "num_experts a bool": (_text_field("num_experts", True), "num_experts must be an integer, got True"),
    "rope_parameters a string": (_text_field("rope_parameters", "yarn"), "rope_parameters must be an object"),
    "eos_token_id empty": (_text_field("eos_token_id", []), "eos_token_id must not be an empty list"),
    "layer_types a string": (_text_field("layer_types", "linear"), "layer_types must be a list of strings"),
    "norm_topk_prob a string": (_text_field("norm_topk_prob", "yes"), "norm_topk_prob must be true or false"),
    "rms_norm_eps a string": (_text_field("rms_norm_eps", "1e-6"), "rms_norm_eps must be a number"),
    "vocab_size zero": (_text_field("vocab_size", 0), "vocab_size must be between 1 and"),
    "ngram_vocab_size_base 1e15": (_text_field("ngram_vocab_size_base", 1e15), "ngram_vocab_size_base must be an integer"),
    "ngram_vocab_size_base 10**15": (_text_field("ngram_vocab_size_base", 10**15), "ngram_vocab_size_base must be between"),
    "num_experts huge": (_text_field("num_experts", 10**9), "num_experts must be between 1 and 16384"),
    "quantization_config a string": (_edit_config(lambda c: c.__setitem__("quantization_config", "nvfp4")),
                                     "quantization_config must be an object"),
}


@pytest.mark.parametrize("case", CONFIG_DAMAGE, ids=list(CONFIG_DAMAGE))
def test_config_damage(tiny_snapshot, tmp_path, case):
    damage, match = CONFIG_DAMAGE[case]
    snap = _copy(tiny_snapshot, tmp_path)
    damage(snap)
    started = time.perf_counter()
    _refused(snap, tmp_path, match)
    assert time.perf_counter() - started < 30  # an absurd size fails fast, not after a minutes-long prime search


def _write(name: str, text: str):
    def apply(snap: Path) -> None:
        (snap / name).unlink(missing_ok=True)
        (snap / name).write_text(text)
    return apply


def _template(template: str):
    def apply(snap: Path) -> None:
        config = json.loads((snap / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (snap / "tokenizer_config.json").write_text(json.dumps(config))
    return apply


TOKENIZER_DAMAGE = {
    "tokenizer.json not JSON": (_write("tokenizer.json", "{not json"), "tokenizer.json is not valid JSON"),
    "tokenizer_config.json a list": (_write("tokenizer_config.json", "[]"), "tokenizer_config.json must be a JSON object"),
    "tokenizer.json no tokenizer": (_write("tokenizer.json", '{"version": "1.0"}'), "does not load (tokenizer.json)"),
    "chat template syntax": (_template("{% if %}"), "tokenizer_config.json does not render"),
    "chat template raising": (_template("{{ raise_exception('no chat here') }}"), "does not render: no chat here"),
    "chat_template.jinja broken": (_write("chat_template.jinja", "{% for %}"), "chat_template.jinja does not render"),
}


@pytest.mark.parametrize("case", TOKENIZER_DAMAGE, ids=list(TOKENIZER_DAMAGE))
def test_tokenizer_damage_is_refused_at_convert_time(tiny_snapshot, tmp_path, case):
    damage, match = TOKENIZER_DAMAGE[case]
    snap = _copy(tiny_snapshot, tmp_path)
    damage(snap)
    _refused(snap, tmp_path, match)


def test_tokenizer_file_linked_outside_is_refused_not_copied(tiny_snapshot, tmp_path):
    snap = _copy(tiny_snapshot, tmp_path)
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"password": "hunter2"}))
    (snap / "special_tokens_map.json").symlink_to(secret)
    _refused(snap, tmp_path, "tokenizer file special_tokens_map.json is a link to")
    (snap / "tokenizer_config.json").unlink()
    (snap / "tokenizer_config.json").symlink_to("/etc/passwd")
    _refused(snap, tmp_path, "tokenizer file tokenizer_config.json is a link to /etc/passwd")


def test_out_parent_a_file(tiny_snapshot, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    _refused(tiny_snapshot, tmp_path, f"{blocker} is a file, not a directory", out=blocker / "sub" / "out.pack")
    assert blocker.read_text() == "mine"


@pytest.mark.parametrize("code, match", [
    (errno.EFBIG, "outgrew the file-size limit (`ulimit -f`) or the file system's largest file"),
    (errno.EDQUOT, "disk quota exceeded"),
    (errno.ENOSPC, "no space left on the device"),
])
def test_disk_errors_mid_write_are_one_line(tiny_snapshot, tmp_path, monkeypatch, code, match):
    def fails(checkpoint, pack, *args):
        (pack / "dense.safetensors").write_bytes(b"half")
        raise OSError(code, os.strerror(code), str(pack / "dense.safetensors"))

    monkeypatch.setattr(pipeline, "write_dense", fails)
    _refused(tiny_snapshot, tmp_path, f"{match} while writing {tmp_path / 'fresh' / 'out.pack'} (dense.safetensors)")


def test_a_real_file_size_limit_is_one_line(tiny_snapshot, tmp_path):
    """RLIMIT_FSIZE below one layer's expert file: the kernel's EFBIG, not a stand-in."""
    out = tmp_path / "limited" / "out.pack"

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    result = subprocess.run(
        [sys.executable, "-m", "flashpack.cli", "convert", str(tiny_snapshot), str(out), "--quiet"],
        capture_output=True, text=True, preexec_fn=limit, timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: a file outgrew the file-size limit") and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    _nothing_left(out, tmp_path / "limited")
