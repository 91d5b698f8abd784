"""How every byte of a pack is hashed: whole files, fixed-size blocks, and the manifest itself.

All hashes are xxHash64 with seed 0 (FORMAT.md section 2). Every file has a whole-file digest in
the manifest. The files a reader touches piecemeal (dense and vision tensors, PLE rows) also have
one digest per block, kept in a digest file beside them (`<file>.xxh64`, little-endian uint64s, a
file of the pack like any other), so that a check can say where the damage is and a reader can
check just the blocks it reads (`BlockChecker`). PLE blocks are one page: a row lookup reads that
page anyway, so checking it costs a hash of 4 KiB and no extra read. The manifest hashes its own
canonical JSON (`manifest_digest`), so a changed digit anywhere in it, even one no other check
could catch (`rms_norm_eps`), is found at load.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from flashpack.errors import PackDamageError

# Block size by role: dense and vision files are read whole at load, PLE files a row (a page) at a time.
BLOCK_BYTES = {"dense": 1 << 20, "vision": 1 << 20, "ple": 4096}
DIGESTS_ROLE = "digests"
DIGESTS_SUFFIX = ".xxh64"
DIGEST = np.dtype("<u8")
MANIFEST_HASH_KEY = "manifest_xxh64"
_READ_CHUNK = 16 << 20  # a multiple of every block size


def xxh64_hex(data: bytes | memoryview) -> str:
    return xxhash.xxh64(data).hexdigest()


@dataclass(frozen=True)
class FileDigest:
    xxh64: str
    blocks: np.ndarray | None  # uint64 [blocks], None when the file is not hashed in blocks


def hash_file(path: Path, block_bytes: int | None = None, progress: Callable[[int], object] | None = None) -> FileDigest:
    """The whole-file digest and, with `block_bytes`, every block's, in one sequential read."""
    whole = xxhash.xxh64()
    blocks: list[np.ndarray] = []  # per chunk: 12.8M Python ints for a real PLE file would take 0.5 GB
    with open(path, "rb") as handle:
        while chunk := handle.read(_READ_CHUNK):
            whole.update(chunk)
            if block_bytes is not None:
                view = memoryview(chunk)
                starts = range(0, len(view), block_bytes)
                blocks.append(np.fromiter((xxhash.xxh64_intdigest(view[start:start + block_bytes]) for start in starts),
                                          dtype=DIGEST, count=len(starts)))
            if progress is not None:
                progress(len(chunk))
    if block_bytes is None:
        return FileDigest(whole.hexdigest(), None)
    return FileDigest(whole.hexdigest(), np.concatenate(blocks) if blocks else np.zeros(0, dtype=DIGEST))


def digests_path(relative: str) -> str:
    return relative + DIGESTS_SUFFIX


def file_entries(root: Path, relative: str, role: str, block_bytes: int | None = None) -> list[dict[str, Any]]:
    """The manifest's `files` entries of one pack file: {path, bytes, role, xxh64}; a file of a
    block-hashed role also gets block_bytes and block_digests, and its digest file (written here,
    atomically) gets an entry of its own."""
    path = root / relative
    blocked = role in BLOCK_BYTES
    block_bytes = (block_bytes or BLOCK_BYTES[role]) if blocked else None
    digest = hash_file(path, block_bytes)
    entry: dict[str, Any] = {"path": relative, "bytes": path.stat().st_size, "role": role, "xxh64": digest.xxh64}
    if not blocked:
        return [entry]
    sidecar = digests_path(relative)
    temporary = root / (sidecar + ".tmp")
    temporary.write_bytes(digest.blocks.tobytes())
    temporary.replace(root / sidecar)
    entry.update(block_bytes=block_bytes, block_digests=sidecar)
    return [entry, {"path": sidecar, "bytes": digest.blocks.nbytes, "role": DIGESTS_ROLE,
                    "xxh64": xxh64_hex(digest.blocks.tobytes())}]


def canonical_json(document: dict[str, Any]) -> bytes:
    """The manifest without its own hash, as sorted compact UTF-8 JSON: the bytes it hashes."""
    body = {key: value for key, value in document.items() if key != MANIFEST_HASH_KEY}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def manifest_digest(document: dict[str, Any]) -> str:
    return xxh64_hex(canonical_json(document))


def stamp_manifest(document: dict[str, Any]) -> None:
    """Set `manifest_xxh64` to the digest of the document as it is now."""
    document[MANIFEST_HASH_KEY] = manifest_digest(document)


READ_AHEAD_BLOCKS = 16  # blocks of a large-block file asked for ahead of the one being hashed


class BlockChecker:
    """Checks the blocks of one mapped file against their digests, each at most once.

    `check_range` and `check_blocks` hash only the blocks not verified yet (a bitmap per file), so
    a reader pays for a block the first time it touches it and never again. Concurrent callers may
    both hash a block once; the bitmap only ever turns true, so that is harmless.
    """

    def __init__(self, name: str, mapping: mmap.mmap, block_bytes: int, digests: np.ndarray,
                 describe: Callable[[int], str] | None = None):
        self.name, self.mapping, self.block_bytes, self.digests = name, mapping, block_bytes, digests
        self.data = memoryview(mapping)  # released by `release` before the map may close
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

    def _verify(self, blocks, reading: str | None) -> None:
        for block in blocks:
            if self.verified[block]:
                continue
            start = block * self.block_bytes
            length = min(self.block_bytes, len(self.data) - start)
            if self.block_bytes > mmap.PAGESIZE:
                # Ask for this block and the next few at once, so the disk reads ahead while this
                # one is hashed: on a map advised MADV_RANDOM, faulting 1 MiB in page by page took
                # 23 ms cold on this VM's disk; hinting the block alone read 0.57-0.71 GB/s, and
                # READ_AHEAD_BLOCKS blocks ahead 1.3-1.5 GB/s.
                ahead = min(len(self.data), start + READ_AHEAD_BLOCKS * self.block_bytes) - start
                self.mapping.madvise(mmap.MADV_WILLNEED, start, ahead)
            if xxhash.xxh64_intdigest(self.data[start:start + length]) != self.digests[block]:
                raise PackDamageError(self.failure(block, reading))
            self.verified[block] = True

    def release(self) -> None:
        self.data.release()

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
