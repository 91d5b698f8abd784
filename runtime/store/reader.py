"""Reading records from the pack with O_DIRECT into page-aligned buffers.

One O_DIRECT `preadv` of a record's stride moves one whole expert from disk to a host buffer with
no page-cache copy and no read-ahead. The kernel demands 4 KiB-aligned offsets, lengths and
buffer addresses: records sit on 4 KiB boundaries (FORMAT.md section 3) and the buffers come from
`aligned_empty`. Contiguous records are read with one `preadv` of several buffers (pre-warming a
reordered hot set is then a sequential read). Where a filesystem refuses O_DIRECT (tmpfs, some
network filesystems) the reader falls back to ordinary reads and says why in `fallback_reason`.
The reader threads are the store's; `preadv` releases the GIL, so they overlap.

A single record may be read as `pieces` page-aligned parts at once (the caller's thread takes one,
helper threads the rest; the store passes StoreConfig.read_pieces): a decode step that misses
waits for its record's read, so the read's latency, not only the disk's throughput, sets the pace.
On the H200 machine's NVMe one thread read a 2.7 MB record in 5.42 ms whole and 2.26 ms in four
parts (bench/results/store-reads-h200.json).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from flashpack.layout.records import PAGE

O_DIRECT = getattr(os, "O_DIRECT", 0)
MIN_PIECE = 256 * 1024  # no part smaller: below this a part's fixed cost outweighs the overlap


def aligned_empty(nbytes: int, pin: bool = False, alignment: int = PAGE) -> torch.Tensor:
    """uint8 [nbytes] CPU tensor whose data starts on an `alignment` boundary (pinned if `pin`)."""
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin)
    shift = (-raw.data_ptr()) % alignment
    return raw[shift:shift + nbytes]


def writable_view(buffer: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU uint8 tensor (for preadv)."""
    return memoryview(buffer.numpy()).cast("B")


class RecordReader:
    """O_DIRECT file handles of a pack's record files, opened once, shared by reader threads."""

    def __init__(self, root: Path | str, files: list[str], direct: bool = True, pieces: int = 1, callers: int = 1):
        """`pieces`: parts a single record's read is split into (1: read whole); `callers`: threads
        that may read at once, each with helpers of its own for its parts, so a required read never
        queues behind another read's parts."""
        if pieces < 1:
            raise ValueError(f"pieces must be at least 1, got {pieces}")
        self.root = Path(root)
        self.pieces = pieces
        self._helpers = (ThreadPoolExecutor((pieces - 1) * callers, thread_name_prefix="flashpack-read-piece")
                         if pieces > 1 else None)
        self.direct = bool(direct and O_DIRECT)
        self.fallback_reason: str | None = None if direct else "O_DIRECT turned off"
        if direct and not O_DIRECT:
            self.fallback_reason = "this platform has no O_DIRECT"
        self._fds: dict[str, int] = {}
        self._retired: list[int] = []
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.read_seconds = 0.0
        for file in files:
            self._open(file)

    def _open(self, file: str) -> int:
        path = self.root / file
        if self.direct:
            try:
                self._fds[file] = os.open(path, os.O_RDONLY | O_DIRECT)
                return self._fds[file]
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                self._fall_back(f"{path.parent} does not support O_DIRECT ({error.strerror})")
        self._fds[file] = os.open(path, os.O_RDONLY)
        return self._fds[file]

    def _fall_back(self, reason: str) -> None:
        """Switch every handle to buffered reads (called once, under the lock when threads run)."""
        self.direct = False
        self.fallback_reason = reason
        for file, fd in list(self._fds.items()):
            self._retired.append(fd)  # another thread may still be in a read on it: close at the end
            self._fds[file] = os.open(self.root / file, os.O_RDONLY)

    def fd(self, file: str) -> int:
        return self._fds[file]

    def read(self, file: str, offset: int, buffers: list[torch.Tensor], need: int) -> None:
        """Fill `buffers` (aligned uint8 tensors, lengths multiples of 4 KiB) from `file` at
        `offset`; raises OSError unless at least `need` bytes arrive (the last record of a file
        may end before its stride)."""
        views = [writable_view(b) for b in buffers]
        start = time.perf_counter()
        parts = self._parts(views[0]) if len(views) == 1 else []
        if len(parts) > 1:
            got = self._read_parts(file, offset, parts)
        else:
            got = self._preadv(file, views, offset)
        elapsed = time.perf_counter() - start
        with self._lock:
            self.bytes_read += got
            self.read_seconds += elapsed
        if got < need:
            raise OSError(errno.EIO, f"short read: {got} of {need} bytes at offset {offset} of {file}")

    def _parts(self, view: memoryview) -> list[tuple[int, memoryview]]:
        """(start, view) parts of one buffer: up to `pieces`, page-aligned, none below MIN_PIECE."""
        count = max(1, min(self.pieces, len(view) // MIN_PIECE))
        size = -(-len(view) // count // PAGE) * PAGE
        return [(start, view[start:start + size]) for start in range(0, len(view), size)]

    def _read_parts(self, file: str, offset: int, parts: list[tuple[int, memoryview]]) -> int:
        """Read the parts at once; the bytes that arrived in one run from the first (a part that
        comes up short ends the record: the file ends there)."""
        futures = [self._helpers.submit(self._preadv, file, [view], offset + start) for start, view in parts[1:]]
        try:
            counts = [self._preadv(file, [parts[0][1]], offset)]
        finally:
            wait(futures)  # no part may still be writing into the buffer once this returns or raises
        counts += [future.result() for future in futures]
        got = 0
        for (_, view), count in zip(parts, counts):
            got += count
            if count < len(view):
                break
        return got

    def _preadv(self, file: str, views: list[memoryview], offset: int) -> int:
        fd = self._fds[file]
        try:
            return os.preadv(fd, views, offset)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            with self._lock:  # the filesystem took the open but refuses direct reads
                if self.direct:
                    self._fall_back(f"{self.root} refused an O_DIRECT read ({error.strerror})")
                elif self._fds[file] == fd:  # a buffered read refused: not an O_DIRECT matter
                    raise
        return os.preadv(self._fds[file], views, offset)

    def close(self) -> None:
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)
        for fd in [*self._fds.values(), *self._retired]:
            os.close(fd)
        self._fds.clear()
        self._retired.clear()
