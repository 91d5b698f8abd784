"""Fixtures for the store tests: a tiny pack (the shared synth preset when it is there, else one
built here from a transformers tiny model), private copies to damage, and a filesystem that
really does O_DIRECT."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _synth_available() -> bool:
    try:
        from flashpack.convert.synth import synthesize  # noqa: F401
    except ImportError:
        return False
    return True


def _build_fallback_pack(root: Path) -> Path:
    """tests/runtime's tiny qwen4_exp saved by transformers + a one-char-per-token tokenizer."""
    import sys

    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    sys.path.insert(0, str(REPO / "tests" / "runtime"))
    from reference_model import build_reference

    from flashpack.convert.pipeline import convert

    snapshot = root / "snapshot"
    build_reference(seed=0).save_pretrained(snapshot)
    tokenizer = Tokenizer(models.WordLevel(vocab={chr(i): i for i in range(256)}, unk_token=chr(0)))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.save(str(snapshot / "tokenizer.json"))
    return convert(str(snapshot), root / "tiny.pack", progress=False)



@pytest.fixture(scope="session")
def store_pack(request, tmp_path_factory) -> Path:
    """A tiny pack, never modified (copy it with `pack_copy` to damage or rewrite it)."""
    if _synth_available():
        return request.getfixturevalue("tiny_pack")
    return _build_fallback_pack(tmp_path_factory.mktemp("store-pack"))


def _copy_pack(pack: Path, where: Path) -> Path:
    target = where / pack.name
    shutil.copytree(pack, target)
    return target


@pytest.fixture
def copy_pack():
    """copy_pack(pack, directory) -> the copy's path."""
    return _copy_pack


@pytest.fixture
def pack_copy(store_pack, tmp_path) -> Path:
    return _copy_pack(store_pack, tmp_path)


def supports_direct_io(directory: Path) -> bool:
    probe = directory / ".direct-io-probe"
    probe.write_bytes(bytes(8192))
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return False
        raise
    try:
        import mmap

        buffer = mmap.mmap(-1, 4096)  # anonymous maps are page-aligned
        os.preadv(fd, [buffer], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


@pytest.fixture
def direct_io_dir(tmp_path):
    """A directory on a filesystem that honours O_DIRECT: pytest's tmp (ext4 here), else one
    inside the repository's tests folder (CI images often mount /tmp as tmpfs)."""
    if supports_direct_io(tmp_path):
        yield tmp_path
        return
    local = REPO / "tests" / "store" / f".direct-io-{os.getpid()}"
    local.mkdir(exist_ok=True)
    try:
        if not supports_direct_io(local):
            pytest.skip("no filesystem here supports O_DIRECT")
        yield local
    finally:
        shutil.rmtree(local, ignore_errors=True)


@pytest.fixture
def corrupt_record():
    """corrupt(pack_root, layer, expert): flip one bit inside that record's bytes on disk."""
    from flashpack.layout.pack import Pack

    def corrupt(pack_root: Path, layer: int, expert: int) -> None:
        entry = Pack.open(pack_root).record_entry(layer, expert)
        with open(pack_root / entry.file, "r+b") as handle:
            handle.seek(entry.offset + 100)
            byte = handle.read(1)
            handle.seek(entry.offset + 100)
            handle.write(bytes([byte[0] ^ 0x40]))

    return corrupt
