"""`flashpack convert` never destroys what it did not write (issue 22, section 1).

OUT may not be, contain or lie inside the source (symlinks resolved, a hub cache repo folder
included); --force replaces only an empty directory or a flashpack pack holding nothing its
manifest does not list; leftovers of dead converts are cleared by the next one, a live convert's
are kept, and a convert killed between its two renames leaves the old pack for the next to restore.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashpack.cli import main
from flashpack.convert import pipeline
from flashpack.convert.out_path import is_pack
from flashpack.convert.pack_swap import settle_leftovers
from flashpack.convert.pipeline import convert
from flashpack.errors import FlashpackError
from flashpack.layout.manifest import FORMAT_VERSION, MANIFEST_FILE, Manifest


def _tree(folder: Path) -> dict[str, str]:
    """Every file under `folder` (links not followed) and a digest of its bytes or link target."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink():
            found[str(path.relative_to(folder))] = "-> " + os.readlink(path)
        elif path.is_file():
            found[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def _cli_refuses(args: list[str], match: str) -> None:
    result = CliRunner().invoke(main, ["convert", *args, "--quiet"])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], result.output


def _copy(snapshot: Path, target: Path) -> Path:
    shutil.copytree(snapshot, target, symlinks=True)
    return target


def _hidden_leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


# --- OUT and the source ------------------------------------------------------------------------


def test_out_equal_to_the_source_is_refused_and_the_source_kept(tiny_snapshot, tmp_path):
    snap = _copy(tiny_snapshot, tmp_path / "snap")
    before = _tree(snap)
    _cli_refuses([str(snap), str(snap), "--force"], f"OUT {snap} is the source {snap}")
    with pytest.raises(FlashpackError, match="is the source"):
        convert(str(snap), snap, force=True, progress=False)
    real = subprocess.run([sys.executable, "-m", "flashpack.cli", "convert", str(snap), str(snap), "--force"],
                          capture_output=True, text=True, timeout=300)
    assert real.returncode == 2 and real.stderr.startswith("error: OUT ") and len(real.stderr.splitlines()) == 1, real.stderr
    assert _tree(snap) == before
    assert _hidden_leftovers(snap) == []


def test_out_containing_or_inside_the_source_is_refused(tiny_snapshot, tmp_path):
    parent = tmp_path / "models"
    snap = _copy(tiny_snapshot, parent / "snap")
    before = _tree(parent)
    _cli_refuses([str(snap), str(parent), "--force"], f"OUT {parent} contains the source {snap}")
    _cli_refuses([str(snap), str(snap / "inner.pack")], f"OUT {snap / 'inner.pack'} lies inside the source")
    _cli_refuses([str(snap), str(snap / "new" / "deeper.pack")], "lies inside the source")
    assert _tree(parent) == before and not (snap / "new").exists()


def test_symlinks_are_resolved_on_both_sides(tiny_snapshot, tmp_path):
    snap = _copy(tiny_snapshot, tmp_path / "snap")
    before = _tree(snap)
    (tmp_path / "link-to-snap").symlink_to(snap)
    (tmp_path / "link-to-parent").symlink_to(tmp_path)
    _cli_refuses([str(snap), str(tmp_path / "link-to-snap"), "--force"], "is the source")
    _cli_refuses([str(tmp_path / "link-to-snap"), str(snap), "--force"], "is the source")
    _cli_refuses([str(snap), str(tmp_path / "link-to-parent" / "snap" / "x.pack")], "lies inside the source")
    assert _tree(snap) == before


def test_out_in_or_around_the_hub_cache_repo_is_refused(tiny_snapshot, tmp_path, monkeypatch):
    """A hub snapshot's files are links into its repo folder's blobs: that folder is the source too."""
    import huggingface_hub.constants as hub_constants

    cache = tmp_path / "hub"
    repo = cache / "models--flashpack-tests--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for number, path in enumerate(sorted(tiny_snapshot.iterdir())):
        shutil.copy(path, repo / "blobs" / f"blob{number}")
        (snap / path.name).symlink_to(Path("../../blobs") / f"blob{number}")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    before = _tree(cache)
    for source in ("flashpack-tests/tiny", str(snap)):
        _cli_refuses([source, str(repo / "blobs"), "--force"], f"lies inside the source {repo}")
        _cli_refuses([source, str(repo / "tiny.pack")], f"lies inside the source {repo}")
        _cli_refuses([source, str(cache), "--force"], f"contains the source {snap}")
    assert _tree(cache) == before


# --- what --force may replace -----------------------------------------------------------------


def test_force_refuses_a_folder_of_someone_elses_files(tiny_snapshot, tmp_path):
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "thesis.tex").write_text("four years of work")
    for args in ([], ["--force"]):  # without --force too: suggesting it would be wrong
        _cli_refuses([str(tiny_snapshot), str(out), *args],
                     f"{out} is a directory but not a flashpack pack (no manifest.json): refusing to replace it; "
                     "remove it yourself or choose another OUT")
    assert (out / "thesis.tex").read_text() == "four years of work"
    assert _hidden_leftovers(out) == []


@pytest.mark.parametrize("content", ["my notes", ""])
def test_force_refuses_a_file(tiny_snapshot, tmp_path, content):
    out = tmp_path / "notes.txt"
    out.write_text(content)
    _cli_refuses([str(tiny_snapshot), str(out), "--force"], f"{out} is a file, not a pack: refusing to replace it")
    assert out.read_text() == content


def test_force_refuses_a_folder_whose_manifest_is_not_a_packs(tiny_snapshot, tmp_path):
    out = tmp_path / "lookalike"
    out.mkdir()
    (out / MANIFEST_FILE).write_text(json.dumps({"name": "my web app"}))
    _cli_refuses([str(tiny_snapshot), str(out), "--force"], "is a directory but not a flashpack pack")
    assert json.loads((out / MANIFEST_FILE).read_text()) == {"name": "my web app"}


def test_force_refuses_a_pack_holding_files_its_manifest_does_not_list(tiny_snapshot, tiny_pack, tmp_path):
    out = tmp_path / "used.pack"
    shutil.copytree(tiny_pack, out)
    (out / "experts" / "my-workload.jsonl").write_text('{"prompt": "hi"}\n')
    _cli_refuses([str(tiny_snapshot), str(out), "--force"],
                 "is a flashpack pack that also holds experts/my-workload.jsonl, which its manifest does not list")
    assert (out / "experts" / "my-workload.jsonl").exists() and is_pack(out)


def test_force_replaces_an_empty_folder_and_a_pack(tiny_snapshot, tiny_pack, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert convert(str(tiny_snapshot), empty, force=True, progress=False) == empty
    Manifest.load(empty)
    older = tmp_path / "older.pack"
    shutil.copytree(tiny_pack, older)
    document = json.loads((older / MANIFEST_FILE).read_text())
    document["format_version"] = FORMAT_VERSION - 1  # a pack of an older format is re-converted with --force
    (older / MANIFEST_FILE).write_text(json.dumps(document))
    result = CliRunner().invoke(main, ["convert", str(tiny_snapshot), str(older), "--quiet", "--force"])
    assert result.exit_code == 0, result.output
    assert Manifest.load(older).document["format_version"] == FORMAT_VERSION
    assert _hidden_leftovers(empty) == [] and _hidden_leftovers(older) == []


def test_something_appearing_at_out_during_the_convert_is_kept(tiny_snapshot, tmp_path, monkeypatch):
    out = tmp_path / "out.pack"
    real_write_dense = pipeline.write_dense
    seen = {}

    def write_dense_meanwhile(checkpoint, pack, *args):
        seen["staging_is_pack"] = is_pack(pack) or (pack / MANIFEST_FILE).exists()
        out.mkdir()
        (out / "report.pdf").write_text("written by someone else meanwhile")
        return real_write_dense(checkpoint, pack, *args)

    monkeypatch.setattr(pipeline, "write_dense", write_dense_meanwhile)
    with pytest.raises(FlashpackError, match="is a directory but not a flashpack pack"):
        convert(str(tiny_snapshot), out, force=True, progress=False)
    assert seen == {"staging_is_pack": False}
    assert (out / "report.pdf").read_text() == "written by someone else meanwhile"
    assert _hidden_leftovers(out) == []


def test_a_failed_second_rename_puts_the_old_pack_back(tiny_snapshot, tiny_pack, tmp_path, monkeypatch):
    out = tmp_path / "out.pack"
    shutil.copytree(tiny_pack, out)
    before = _tree(out)
    real_rename = Path.rename

    def rename(self, target):
        if ".partial-" in self.name:
            raise KeyboardInterrupt  # as if interrupted between the renames
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        convert(str(tiny_snapshot), out, force=True, progress=False)
    assert _tree(out) == before
    assert _hidden_leftovers(out) == []


# --- leftovers of killed converts --------------------------------------------------------------


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


_KILLED_CONVERT = """
import os, sys
from pathlib import Path
from flashpack.convert import pipeline
where = sys.argv[3]
if where == "mid-write":
    pipeline.write_ple = lambda *args: os._exit(137)
else:  # between moving the old pack aside and the new one in
    real_rename = Path.rename
    def rename(self, target):
        if ".partial-" in self.name:
            os._exit(137)
        return real_rename(self, target)
    Path.rename = rename
pipeline.convert(sys.argv[1], Path(sys.argv[2]), force=True, progress=False)
"""


def _killed_convert(snapshot: Path, out: Path, where: str) -> int:
    child = subprocess.run([sys.executable, "-c", _KILLED_CONVERT, str(snapshot), str(out), where], timeout=300)
    assert child.returncode == 137
    return _leftover_pid(out)


def _leftover_pid(out: Path) -> int:
    (name,) = {p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.partial-")}
    return int(name.rsplit("-", 1)[1])


def test_a_convert_killed_mid_write_leaves_no_pack_and_the_next_clears_it(tiny_snapshot, tmp_path):
    out = tmp_path / "out.pack"
    pid = _killed_convert(tiny_snapshot, out, "mid-write")
    partial = tmp_path / f".out.pack.partial-{pid}"
    assert not out.exists() and not is_pack(partial) and not (partial / MANIFEST_FILE).exists()
    assert any(partial.rglob("*.bin"))  # it had written experts
    convert(str(tiny_snapshot), out, progress=False)
    assert is_pack(out) and _hidden_leftovers(out) == []


def test_a_convert_killed_between_the_renames_leaves_the_old_pack_to_restore(tiny_snapshot, tiny_pack, tmp_path):
    out = tmp_path / "out.pack"
    shutil.copytree(tiny_pack, out)
    before = _tree(out)
    pid = _killed_convert(tiny_snapshot, out, "between-renames")
    old = tmp_path / f".out.pack.old-{pid}"
    assert not out.exists() and is_pack(old) and _tree(old) == before  # the user still has the old pack
    assert settle_leftovers(out) == old
    assert _tree(out) == before and _hidden_leftovers(out) == []
    _cli_refuses([str(tiny_snapshot), str(out)], "already exists (use --force")
    assert _tree(out) == before


def test_only_dead_converts_leftovers_of_this_out_are_removed(tiny_snapshot, tmp_path):
    out = tmp_path / "out.pack"
    dead, live = _dead_pid(), subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        names = {
            f".out.pack.partial-{dead}": "removed", f".out.pack.old-{dead}": "removed",
            f".out.pack.partial-{live.pid}": "kept", f".out.pack.old-{live.pid}": "kept",
            f".other.pack.partial-{dead}": "kept", f".out.pack.partial-{dead}x": "kept",
            f"out.pack.partial-{dead}": "kept", f".out.pack.partial-{dead}.bak": "kept",
        }
        for name in names:
            (tmp_path / name).mkdir()
            (tmp_path / name / "data.bin").write_bytes(b"x" * 1000)
        convert(str(tiny_snapshot), out, progress=False)
        for name, fate in names.items():
            assert (tmp_path / name).exists() == (fate == "kept"), name
    finally:
        live.kill()
        live.wait()
