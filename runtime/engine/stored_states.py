"""Stored prompt states: a prefix cache's tier on disk, kept across restarts.

    StoredStates(folder, disk_budget, fingerprint)
      put(key, tokens, state)   encode, compress and write on the writer thread (`state` is an
                                entry's own copy, never changed after: it is read there)
      get(key, like[, buffer])  the state, or None (missing, or damaged: then the file is removed);
                                with `buffer(nbytes)` giving a writable uint8 array, read into it
                                and left there, views all (the prefix cache's pinned arena)
      arriving(key, like, buffer)  the state as it is read into the buffer, its read and each
                                layer's end: the prefix cache restores each layer as its bytes land
                                (arriving_state.py); then found(key) once whole, or lost(key, error)

One file an entry, `<key>.fpstate`:

    b"FPST" | format version (u32 LE) | header length (u32 LE) | header JSON | zstd frames

The header names the format, the pack's fingerprint (its manifest's xxh64), the entry's key and
token count, and each frame's length, decompressed length and xxh64; the frames are state_codec's
bytes, its header and each tensor cut every `frame_bytes` (16 MiB), compressed with zstandard each
on its own. A read (StoredRead) reads the frames in order on a thread of its own and decompresses
each on a thread pool as soon as it is read and its checksum holds, so the decompression (a single
zstd stream decodes about 1 GB/s, slower than a fast disk reads a 1 GB state) runs beside the disk
and on several cores, and a layer's bytes are there to use before the file's last are read. A file is written under a temporary name and
renamed, so a half-written entry never looks like one. A read that finds anything wrong
(truncated, a flipped bit, another pack's or an older format's entry, a key that is not its name)
removes the file and returns None: the caller prefills instead, and no request fails because of a
stored state. After each write the oldest
entries (by modification time, which a hit refreshes) are removed until the folder's entries fit
the disk budget. Only `*.fpstate` files and this tier's own temporary files are ever removed.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import queue
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash
import zstandard

from flashpack.errors import FlashpackError
from flashpack.runtime.engine.state_codec import StateFormatError, decode_state, encode_state, header_end, layer_ends
from flashpack.runtime.state import SequenceState

MAGIC = b"FPST"
FORMAT = 2
SUFFIX = ".fpstate"
FRAME_BYTES = 16 << 20  # encoded bytes a frame: 64 frames for a 1 GB state, each decoded on its own
DECODE_THREADS = min(8, os.cpu_count() or 1)
_PREFIX = struct.Struct("<4sII")
# Encoded entries waiting for the writer, at most (one always may: a 32k state of the real model is
# ~1 GB); a put beyond them is dropped, not waited for.
PENDING_BYTES = 2 << 30
_LEVEL = 3


class StoredStates:
    def __init__(self, folder: Path, disk_budget: int, fingerprint: str, frame_bytes: int = FRAME_BYTES):
        self.folder, self.disk_budget, self.fingerprint = Path(folder), disk_budget, fingerprint
        self.frame_bytes = frame_bytes
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
        self._decoders = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="flashpack-state-frames")

    def put(self, key: str, tokens: int, state: SequenceState) -> None:
        size = state.nbytes()
        with self._lock:
            if self._pending_bytes and self._pending_bytes + size > PENDING_BYTES:
                self._counts["skipped_writes"] += 1  # the disk is behind: this entry is not stored (live only, if live)
                return
            self._pending_bytes += size
        self._queue.put((key, tokens, state, size))

    def get(self, key: str, like: SequenceState, buffer=None) -> SequenceState | None:
        """The stored state of `key` on `like`'s devices, or None. `buffer(nbytes)`: a numpy uint8
        array of that size to decompress into (None: it has no room), the state then left in it on
        the host, its tensors views of it."""
        handle = self._open(key)
        if handle is None:
            return None
        try:
            with handle:
                state = self._read(handle, key, like, buffer)
        except (OSError, *_FAULTS) as error:  # a fault: dropped; gone or unreadable mid-read: a miss
            self.lost(key, error)
            return None
        self.found(key)
        return state

    def keys(self) -> list[str]:
        return [path.name[:-len(SUFFIX)] for path in self.folder.glob(f"*{SUFFIX}")]

    def stats(self) -> dict:
        entries = list(self.folder.glob(f"*{SUFFIX}"))
        with self._lock:
            return {**self._counts, "entries": len(entries), "bytes": sum(_size(path) for path in entries),
                    "write_seconds": self._write_seconds}

    def flush(self) -> None:
        """Wait until every entry put so far is on disk (and let go of: a host state in a pinned
        arena's block gives the block back then)."""
        self._queue.join()

    def pending_bytes(self) -> int:
        """The state bytes put and not yet written."""
        with self._lock:
            return self._pending_bytes

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join()
        self._decoders.shutdown()

    def arriving(self, key: str, like: SequenceState, buffer) -> "tuple[SequenceState, StoredRead, dict] | None":
        """The stored state of `key` as it arrives: read into `buffer(nbytes)` (a writable uint8
        array; None: no room) on a thread, its frames decompressed as they land. Returns the state
        (views of the buffer, their bytes not yet all there: `StoredRead.wait` before reading one),
        its read and each layer's end in the buffer (state_codec.layer_ends), or None (missing, no
        room, or found wrong before any tensor's bytes: then dropped as `get` drops it). A fault
        found later is raised by the read's `wait`: the caller then calls `lost`, or `found` once
        the read is whole."""
        handle = self._open(key)
        if handle is None:
            return None
        read = None
        try:
            header = self._header(handle, key)
            data = buffer(sum(raw_size for _, raw_size, _ in header["frames"]))
            if data is None:  # the caller reads it otherwise
                handle.close()
                return None
            read = StoredRead(self._decoders, handle, header["frames"], data)
            read.wait(8)
            read.wait(header_end(data))
            state = decode_state(data, like, on_host=True)
            if state.position != header["tokens"]:
                raise StateFormatError("the state's position is not its token count")
            ends = layer_ends(data)
        except BaseException as error:
            if read is not None:
                read.cancel()
            else:
                handle.close()
            self.lost(key, error)
            if isinstance(error, (OSError, *_FAULTS)):
                return None
            raise
        return state, read, ends

    def lost(self, key: str, error: BaseException) -> None:
        """An entry whose read failed with `error`: a fault in it removes the file (`dropped`), an
        unreadable disk leaves it to the disk budget (`misses`). A hit completed is counted by `found`."""
        if isinstance(error, _FAULTS):
            (self.folder / f"{key}{SUFFIX}").unlink(missing_ok=True)
            self._count("dropped")
        else:
            self._count("misses")

    def found(self, key: str) -> None:
        """An entry read whole and checked: a hit, and the most recently used."""
        try:
            os.utime(self.folder / f"{key}{SUFFIX}")  # least recently used goes first
        except OSError:
            pass
        self._count("hits")

    def _open(self, key: str):
        """The entry's file open for reading, or None (counted a miss)."""
        try:
            return open(self.folder / f"{key}{SUFFIX}", "rb")
        except OSError:
            self._count("misses")
            return None

    def _header(self, handle, key: str) -> dict:
        """The entry's header (its frames: length, decompressed length, xxh64; its tokens), the
        prefix and header checked."""
        magic, version, length = _PREFIX.unpack(_exactly(handle, _PREFIX.size))
        if magic != MAGIC or version != FORMAT:
            raise StateFormatError(f"format {version}, not {FORMAT}")
        header = json.loads(_exactly(handle, length))
        if header["fingerprint"] != self.fingerprint or header["key"] != key:
            raise StateFormatError("an entry of another pack or key")
        return header

    def _read(self, handle, key: str, like: SequenceState, buffer) -> SequenceState:
        header = self._header(handle, key)
        frames = header["frames"]
        total = sum(raw_size for _, raw_size, _ in frames)
        data = None if buffer is None else buffer(total)
        on_host = data is not None
        if data is None:
            data = bytearray(total)
        read = StoredRead(self._decoders, handle, frames, data)
        try:
            read.wait_all()
        finally:
            read.cancel()
        state = decode_state(data, like, on_host=on_host)
        if state.position != header["tokens"]:
            raise StateFormatError("the state's position is not its token count")
        return state

    def _write_loop(self) -> None:
        compressor = zstandard.ZstdCompressor(level=_LEVEL)
        while (item := self._queue.get()) is not None:
            key, tokens, state, size = item
            item = None  # the state is let go of before the write counts as done (flush)
            try:
                start = time.perf_counter()
                self._write(compressor, key, tokens, state)
                self._evict()
                with self._lock:
                    self._counts["writes"] += 1
                    self._write_seconds += time.perf_counter() - start
            except OSError:  # a full or failing disk: the entry is not stored (live only, if live)
                self._count("skipped_writes")
            finally:
                state = None
                with self._lock:
                    self._pending_bytes -= size
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, compressor, key: str, tokens: int, state: SequenceState) -> None:
        # frames within each piece (the header, a tensor): a frame across pieces would need them
        # joined, a copy made holding the GIL; zstandard releases it while it compresses
        chunks = [piece[start:start + self.frame_bytes] for piece in encode_state(state)
                  for start in range(0, len(piece), self.frame_bytes)]
        frames = [compressor.compress(chunk) for chunk in chunks]
        header = json.dumps({"format": FORMAT, "fingerprint": self.fingerprint, "key": key, "tokens": tokens,
                             "frames": [[len(frame), len(chunk), xxhash.xxh64(frame).hexdigest()]
                                        for frame, chunk in zip(frames, chunks)]}).encode()
        final = self.folder / f"{key}{SUFFIX}"
        partial = self.folder / f".{key}{SUFFIX}.partial-{os.getpid()}"
        try:
            with open(partial, "wb") as handle:
                handle.write(_PREFIX.pack(MAGIC, FORMAT, len(header)) + header)
                for frame in frames:
                    handle.write(frame)
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


# What a damaged, foreign or old-format entry raises as it is read and decoded (an OSError is the
# disk's, not the entry's).
_FAULTS = (StateFormatError, zstandard.ZstdError, ValueError, KeyError, TypeError, struct.error)


class StoredRead:
    """An entry's frames read in order on a thread of their own, each checked against its xxh64
    before it is decompressed, on the decoder pool, into its place in `data`: `wait(end)` blocks
    until the decoded bytes before `end` are in place, and raises what went wrong with them."""

    def __init__(self, decoders: ThreadPoolExecutor, handle, frames: list, data):
        self._ends = list(itertools.accumulate(raw_size for _, raw_size, _ in frames))
        self._parts: list = []  # each frame's decompression, in order, as the reader submits them
        self._checked = 0  # frames whose decompression is known to have succeeded
        self._error: BaseException | None = None
        self._reading, self._stop = True, False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, args=(decoders, handle, frames, memoryview(data)),
                                        name="flashpack-state-read", daemon=True)
        self._reader.start()

    def wait(self, end: int) -> None:
        needed = bisect.bisect_left(self._ends, end) + 1 if end > 0 else 0
        with self._changed:
            while len(self._parts) < needed and self._error is None and self._reading:
                self._changed.wait()
            if len(self._parts) < needed:
                raise self._error or StateFormatError("the entry is truncated")
        for part in self._parts[self._checked:needed]:
            part.result()
        self._checked = max(self._checked, needed)

    def wait_all(self) -> None:
        """Every byte in place, and nothing after the last frame."""
        self.wait(self._ends[-1] if self._ends else 0)
        self._reader.join()
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        """Stop reading and wait until nothing writes into `data` any more (it may then be reused)."""
        self._stop = True
        self._reader.join()
        for part in self._parts:
            if not part.cancel():
                part.exception()  # running or done: waited for, whatever it raised

    def _read(self, decoders, handle, frames, view) -> None:
        offset = 0
        try:
            with handle:
                for size, raw_size, digest in frames:
                    if self._stop:
                        return
                    frame = _exactly(handle, size)
                    if xxhash.xxh64(frame).hexdigest() != digest:  # checked before a byte is decompressed
                        raise StateFormatError("a frame fails its checksum")
                    part = decoders.submit(_decompress_into, frame, view[offset:offset + raw_size])
                    with self._changed:
                        self._parts.append(part)
                        self._changed.notify_all()
                    offset += raw_size
                if handle.read(1):
                    raise StateFormatError("bytes after the last frame")
        except BaseException as error:  # handed to whoever waits
            with self._changed:
                self._error = error
        finally:
            with self._changed:
                self._reading = False
                self._changed.notify_all()


def _exactly(handle, size: int) -> bytes:
    data = handle.read(size)
    if len(data) != size:
        raise StateFormatError("the entry is truncated")
    return data


def _decompress_into(frame: bytes, out: memoryview) -> None:
    """One frame into `out`, which it must fill exactly (zstandard releases the GIL meanwhile)."""
    reader, filled = zstandard.ZstdDecompressor().stream_reader(frame), 0
    while filled < len(out):
        count = reader.readinto(out[filled:])
        if not count:
            raise StateFormatError("a frame decompresses to fewer bytes than its header says")
        filled += count
    if reader.read(1):
        raise StateFormatError("a frame decompresses to more bytes than its header says")


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
