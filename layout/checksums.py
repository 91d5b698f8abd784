"""How every byte of a pack is hashed: whole files, fixed-size blocks, and the manifest itself.

All hashes are xxHash64 with seed 0 as 16 lowercase hex digits (FORMAT.md section 2). The files a
reader touches piecemeal (dense and vision tensors, PLE rows) also carry one hash per block of
`BLOCK_BYTES`, so a check can say where the damage is and a reader can check only the blocks it
reads (`BlockChecker`). The manifest hashes its own canonical JSON (`manifest_digest`), so a changed
digit anywhere in it, even one no other check could catch (`rms_norm_eps`), is found at load.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from flashpack.errors import PackDamageError

BLOCK_BYTES = 1 << 20
BLOCKED_ROLES = ("dense", "vision", "ple")  # files read a tensor or a row at a time
MANIFEST_HASH_KEY = "manifest_xxh64"
_READ_CHUNK = 16 * BLOCK_BYTES


def xxh64_hex(data: bytes | memoryview) -> str:
    return xxhash.xxh64(data).hexdigest()


@dataclass(frozen=True)
class FileDigest:
    xxh64: str
    blocks: list[str] | None  # one digest per block, None when the file is not hashed in blocks


def hash_file(path: Path, block_bytes: int | None = None, progress: Callable[[int], object] | None = None) -> FileDigest:
    """The whole-file digest and, with `block_bytes`, every block's, in one sequential read."""
    whole = xxhash.xxh64()
    blocks: list[str] = []
    chunk_bytes = _READ_CHUNK if block_bytes is None else max(1, _READ_CHUNK // block_bytes) * block_bytes
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            whole.update(chunk)
            if block_bytes is not None:
                view = memoryview(chunk)
                blocks += [xxh64_hex(view[start:start + block_bytes]) for start in range(0, len(view), block_bytes)]
            if progress is not None:
                progress(len(chunk))
    return FileDigest(whole.hexdigest(), blocks if block_bytes is not None else None)


def file_entry(root: Path, relative: str, role: str, block_bytes: int = BLOCK_BYTES) -> dict[str, Any]:
    """The manifest's `files` entry of one pack file: path, bytes, role, xxh64 (and blocks)."""
    path = root / relative
    digest = hash_file(path, block_bytes if role in BLOCKED_ROLES else None)
    entry: dict[str, Any] = {"path": relative, "bytes": path.stat().st_size, "role": role, "xxh64": digest.xxh64}
    if digest.blocks is not None:
        entry["block_bytes"] = block_bytes
        entry["blocks"] = digest.blocks
    return entry


def canonical_json(document: dict[str, Any]) -> bytes:
    """The manifest without its own hash, as sorted compact UTF-8 JSON: the bytes it hashes."""
    body = {key: value for key, value in document.items() if key != MANIFEST_HASH_KEY}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def manifest_digest(document: dict[str, Any]) -> str:
    return xxh64_hex(canonical_json(document))


def stamp_manifest(document: dict[str, Any]) -> None:
    """Set `manifest_xxh64` to the digest of the document as it is now."""
    document[MANIFEST_HASH_KEY] = manifest_digest(document)


class BlockChecker:
    """Checks the blocks of one mapped file against their digests, each at most once.

    `check_range` and `check_blocks` hash only the blocks not verified yet (a bitmap per file), so
    a reader pays for a block the first time it touches it and never again. Concurrent callers may
    both hash a block once; the bitmap only ever turns true, so that is harmless.
    """

    def __init__(self, name: str, data: memoryview, block_bytes: int, digests: list[str],
                 describe: Callable[[int], str] | None = None):
        self.name, self.data, self.block_bytes, self.digests = name, data, block_bytes, digests
        self.verified = np.zeros(len(digests), dtype=bool)
        self.describe = describe

    def check_range(self, start: int, stop: int, reading: str | None = None) -> None:
        """Verify every block overlapping bytes [start, stop)."""
        if stop <= start:
            return
        first, last = start // self.block_bytes, (stop - 1) // self.block_bytes
        if not self.verified[first:last + 1].all():
            self._verify(range(first, last + 1), reading)

    def check_blocks(self, blocks: np.ndarray) -> None:
        """Verify the blocks of an int array of block indices (repeats allowed)."""
        pending = blocks[~self.verified[blocks]]
        if pending.size:
            self._verify(np.unique(pending).tolist(), None)

    def _verify(self, blocks: Iterable[int], reading: str | None) -> None:
        for block in blocks:
            if self.verified[block]:
                continue
            start = block * self.block_bytes
            if xxh64_hex(self.data[start:start + self.block_bytes]) != self.digests[block]:
                raise PackDamageError(self.failure(block, reading))
            self.verified[block] = True

    def failure(self, block: int, reading: str | None = None) -> str:
        return block_failure(self.name, block, self.block_bytes, len(self.data), self.describe, reading)


def block_failure(name: str, block: int, block_bytes: int, file_bytes: int,
                  describe: Callable[[int], str] | None = None, reading: str | None = None) -> str:
    """One line naming the file, the block, its bytes and what lies in it."""
    start = block * block_bytes
    stop = min(start + block_bytes, file_bytes)
    where = f"{name} block {block} (bytes {start}-{stop - 1}"
    if describe is not None:
        where += f"; {describe(block)}"
    where += ")"
    reading = f" (found reading {reading})" if reading else ""
    return f"pack damaged: {where} fails its xxh64 check{reading}"
