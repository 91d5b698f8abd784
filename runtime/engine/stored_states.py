"""Stored prompt states: a prefix cache's tier on disk, kept across restarts.

    StoredStates(folder, disk_budget, fingerprint)
      put(key, tokens, state)   encode, compress and write on the writer thread (`state` is an
                                entry's own copy, never changed after: it is read there)
      get(key, like)            the state, or None (missing, or damaged: then the file is removed)

One file an entry, `<key>.fpstate`:

    b"FPST" | format version (u32 LE) | header length (u32 LE) | header JSON | zstd payload

The header names the format, the pack's fingerprint (its manifest's xxh64), the entry's key and
token count, and the payload's length and xxh64; the payload is state_codec's bytes, compressed
with zstandard. A file is written under a temporary name and renamed, so a half-written entry never
looks like one. A read that finds anything wrong (truncated, a flipped bit, another pack's or an
older format's entry, a key that is not its name) removes the file and returns None: the caller
prefills instead, and no request fails because of a stored state. After each write the oldest
entries (by modification time, which a hit refreshes) are removed until the folder's entries fit
the disk budget. Only `*.fpstate` files and this tier's own temporary files are ever removed.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
import time
from pathlib import Path

import xxhash
import zstandard

from flashpack.errors import FlashpackError
from flashpack.runtime.engine.state_codec import StateFormatError, decode_state, encode_state
from flashpack.runtime.state import SequenceState

MAGIC = b"FPST"
FORMAT = 1
SUFFIX = ".fpstate"
_PREFIX = struct.Struct("<4sII")
# Encoded entries waiting for the writer, at most (one always may: a 32k state of the real model is
# ~1 GB); a put beyond them is dropped, not waited for.
PENDING_BYTES = 2 << 30
_LEVEL = 3


class StoredStates:
    def __init__(self, folder: Path, disk_budget: int, fingerprint: str):
        self.folder, self.disk_budget, self.fingerprint = Path(folder), disk_budget, fingerprint
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            raise FlashpackError(f"cannot keep prompt states in {self.folder}: {error.strerror or error}") from None
        self._counts = {"writes": 0, "hits": 0, "misses": 0, "dropped": 0, "skipped_writes": 0}
        self._write_seconds = 0.0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._pending_bytes = 0
        self._writer = threading.Thread(target=self._write_loop, name="flashpack-states", daemon=True)
        self._writer.start()

    def put(self, key: str, tokens: int, state: SequenceState) -> None:
        size = state.nbytes()
        with self._lock:
            if self._pending_bytes and self._pending_bytes + size > PENDING_BYTES:
                self._counts["skipped_writes"] += 1  # the disk is behind: this entry stays live only
                return
            self._pending_bytes += size
        self._queue.put((key, tokens, state, size))

    def get(self, key: str, like: SequenceState) -> SequenceState | None:
        path = self.folder / f"{key}{SUFFIX}"
        try:
            data = path.read_bytes()
        except OSError:
            self._count("misses")
            return None
        try:
            state = self._decoded(data, key, like)
        except (StateFormatError, zstandard.ZstdError, ValueError, KeyError, struct.error):
            path.unlink(missing_ok=True)
            self._count("dropped")
            return None
        os.utime(path)  # least recently used goes first
        self._count("hits")
        return state

    def keys(self) -> list[str]:
        return [path.name[:-len(SUFFIX)] for path in self.folder.glob(f"*{SUFFIX}")]

    def stats(self) -> dict:
        entries = list(self.folder.glob(f"*{SUFFIX}"))
        with self._lock:
            return {**self._counts, "entries": len(entries), "bytes": sum(_size(path) for path in entries),
                    "write_seconds": self._write_seconds}

    def flush(self) -> None:
        """Wait until every entry put so far is on disk."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join()

    def _decoded(self, data: bytes, key: str, like: SequenceState) -> SequenceState:
        magic, version, length = _PREFIX.unpack_from(data)
        if magic != MAGIC or version != FORMAT:
            raise StateFormatError(f"format {version}, not {FORMAT}")
        header = json.loads(data[_PREFIX.size:_PREFIX.size + length])
        payload = data[_PREFIX.size + length:]
        if header["fingerprint"] != self.fingerprint or header["key"] != key:
            raise StateFormatError("an entry of another pack or key")
        if len(payload) != header["payload_bytes"] or xxhash.xxh64(payload).hexdigest() != header["payload_xxh64"]:
            raise StateFormatError("the payload fails its checksum")
        state = decode_state(zstandard.ZstdDecompressor().decompress(payload), like)
        if state.position != header["tokens"]:
            raise StateFormatError("the state's position is not its token count")
        return state

    def _write_loop(self) -> None:
        compressor = zstandard.ZstdCompressor(level=_LEVEL)
        while (item := self._queue.get()) is not None:
            try:
                start = time.perf_counter()
                self._write(compressor, *item[:3])
                self._evict()
                with self._lock:
                    self._counts["writes"] += 1
                    self._write_seconds += time.perf_counter() - start
            except OSError:  # a full or failing disk: the entry stays live only
                self._count("skipped_writes")
            finally:
                with self._lock:
                    self._pending_bytes -= item[3]
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, compressor, key: str, tokens: int, state: SequenceState) -> None:
        payload = compressor.compress(encode_state(state))
        header = json.dumps({"format": FORMAT, "fingerprint": self.fingerprint, "key": key, "tokens": tokens,
                             "payload_bytes": len(payload), "payload_xxh64": xxhash.xxh64(payload).hexdigest()}).encode()
        final = self.folder / f"{key}{SUFFIX}"
        partial = self.folder / f".{key}{SUFFIX}.partial-{os.getpid()}"
        try:
            with open(partial, "wb") as handle:
                handle.write(_PREFIX.pack(MAGIC, FORMAT, len(header)) + header + payload)
            os.replace(partial, final)
        finally:
            partial.unlink(missing_ok=True)

    def _evict(self) -> None:
        entries = sorted(self.folder.glob(f"*{SUFFIX}"), key=_mtime)
        total = sum(_size(path) for path in entries)
        while entries and total > self.disk_budget:
            oldest = entries.pop(0)
            total -= _size(oldest)
            oldest.unlink(missing_ok=True)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
