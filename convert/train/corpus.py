"""The demo model's corpus: the Python sources of the installed transformers distribution.

Every machine that runs flashpack has transformers at the version pyproject pins, so the corpus is
the same bytes everywhere without downloading anything: the distribution's `.py` files, sorted by
their path inside the distribution (e.g. `transformers/models/bert/modeling_bert.py`). A fixed
slice is held out for evaluation: the files whose path's xxh64 is 0 modulo HELD_OUT_MODULUS (66
files, 1.0 MB of 52.8 MB at 5.23.0). The slice depends only on the path, so it does not move when
a smoke test reads fewer files.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

import xxhash

from flashpack.errors import FlashpackError

DISTRIBUTION = "transformers"
PINNED_VERSION = "5.23.0"  # pyproject.toml's pin: another version is another corpus
HELD_OUT_MODULUS = 50


@dataclass(frozen=True)
class SourceFile:
    path: str  # inside the distribution, '/'-separated
    text: str

    @property
    def held_out(self) -> bool:
        return is_held_out(self.path)


@dataclass(frozen=True)
class Corpus:
    version: str
    train: tuple[SourceFile, ...]
    held_out: tuple[SourceFile, ...]

    def fingerprint(self) -> str:
        """sha256 over every file's path and bytes, in order: two machines agree iff it matches."""
        digest = hashlib.sha256()
        for source in self.train + self.held_out:
            digest.update(source.path.encode() + b"\0" + source.text.encode() + b"\0")
        return digest.hexdigest()

    def summary(self) -> dict:
        return {
            "distribution": DISTRIBUTION,
            "version": self.version,
            "train_files": len(self.train),
            "held_out_files": len(self.held_out),
            "train_bytes": sum(len(s.text.encode()) for s in self.train),
            "held_out_bytes": sum(len(s.text.encode()) for s in self.held_out),
            "held_out_rule": f"xxh64(path) % {HELD_OUT_MODULUS} == 0",
            "held_out_paths": [s.path for s in self.held_out],
            "sha256": self.fingerprint(),
        }


def is_held_out(path: str) -> bool:
    return xxhash.xxh64(path.encode()).intdigest() % HELD_OUT_MODULUS == 0


def load_corpus(max_train_files: int | None = None, max_held_out_files: int | None = None) -> Corpus:
    """The corpus, optionally cut to its first files of each slice (a smoke test's few files)."""
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FlashpackError(f"{DISTRIBUTION} is not installed: the demo corpus is its sources") from None
    if distribution.version != PINNED_VERSION:
        raise FlashpackError(
            f"the demo corpus is {DISTRIBUTION} {PINNED_VERSION}'s sources, but {distribution.version} is installed"
        )
    paths = sorted(str(f).replace("\\", "/") for f in distribution.files or () if str(f).endswith(".py"))
    if not paths:
        raise FlashpackError(f"{DISTRIBUTION} {distribution.version} lists no .py files (installed without RECORD?)")
    train: list[SourceFile] = []
    held_out: list[SourceFile] = []
    for path in paths:
        bucket = held_out if is_held_out(path) else train
        limit = max_held_out_files if bucket is held_out else max_train_files
        if limit is not None and len(bucket) >= limit:
            continue
        bucket.append(SourceFile(path, _read(Path(distribution.locate_file(path)))))
    return Corpus(distribution.version, tuple(train), tuple(held_out))


def _read(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise FlashpackError(f"cannot read corpus file {path}: {error}") from None
