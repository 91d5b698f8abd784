"""Sharded safetensors written tensor by tensor, block by block, in bounded memory.

Every tensor's dtype and shape is known before its values exist, so each shard's header goes
first and the values stream after it in header order. Large tensors are written block by block
as they are produced; small ones (experts, norms) are produced a window ahead on worker threads,
since producing values (sampling, NVFP4 quantisation) costs far more than writing them. Memory is
bounded by the window (PREFETCH_BYTES) plus one block. Layout per file, as the safetensors library
reads it (written by convert/safetensors_writer.py). `model.safetensors.index.json` maps every key
to its shard, as transformers expects.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from flashpack.convert.safetensors_writer import StreamingSafetensorsWriter
from flashpack.layout.dtypes import SAFETENSORS_NAMES

INDEX_NAME = "model.safetensors.index.json"
PREFETCH_BYTES = 64 << 20  # values produced ahead of the writer, at most
_PREFETCH_MAX_TENSOR = 16 << 20  # larger tensors stream inline (their blocks are sampled in parallel)
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
_MMAP_THRESHOLD = 1 << 20


@dataclass(frozen=True)
class DiskTensor:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], Iterator[torch.Tensor]]  # blocks whose concatenation along dim 0 is the tensor
    # False: produced on the writer's thread when it reaches the tensor. NVFP4 experts are: their
    # producer runs its own look-ahead, one task per expert rather than per on-disk tensor.
    prefetch: bool = True

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(tensors: list[DiskTensor], shard_bytes: int) -> list[list[DiskTensor]]:
    """Greedy split in order; a tensor larger than a shard gets a shard of its own."""
    shards: list[list[DiskTensor]] = [[]]
    filled = 0
    for tensor in tensors:
        if shards[-1] and filled + tensor.nbytes > shard_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(tensor)
        filled += tensor.nbytes
    return shards


def write_sharded(folder: Path, tensors: list[DiskTensor], shard_bytes: int) -> dict:
    """Write every tensor into `folder`; returns (and writes) the index."""
    keys = [tensor.key for tensor in tensors]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate tensor keys in the synthetic checkpoint")
    shards = plan_shards(tensors, shard_bytes)
    pin_mmap_threshold()
    weight_map: dict[str, str] = {}
    with _one_thread_per_op(), ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        ahead = _Prefetcher(pool, tensors)
        for number, shard in enumerate(shards, start=1):
            name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            _write_shard(folder / name, shard, ahead)
            weight_map.update({tensor.key: name for tensor in shard})
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return index


class _Prefetcher:
    """Produces small tensors a bounded window ahead of the writer, in order."""

    def __init__(self, pool: ThreadPoolExecutor, tensors: list[DiskTensor]):
        self._pool = pool
        self._tensors = tensors
        self._position = {id(t): i for i, t in enumerate(tensors)}
        self._pending: dict[int, Future[list]] = {}
        self._next = 0  # first index not yet submitted or passed
        self._in_flight = 0

    def blocks(self, tensor: DiskTensor) -> Iterator:
        index = self._position[id(tensor)]
        self._next = max(self._next, index)
        self._top_up()
        future = self._pending.pop(index, None)
        if future is None:  # not prefetched: stream it while the window fills behind it
            self._next = max(self._next, index + 1)
            self._top_up()
            yield from tensor.produce()
            if tensor.nbytes > _PREFETCH_MAX_TENSOR:
                release_free_memory()
            return
        self._in_flight -= tensor.nbytes
        yield from future.result()
        self._top_up()

    def _top_up(self) -> None:
        while self._next < len(self._tensors):
            candidate = self._tensors[self._next]
            if not candidate.prefetch or candidate.nbytes > _PREFETCH_MAX_TENSOR:
                return  # streams inline when the writer reaches it
            if self._in_flight + candidate.nbytes > PREFETCH_BYTES:
                return
            self._pending[self._next] = self._pool.submit(lambda t=candidate: list(t.produce()))
            self._in_flight += candidate.nbytes
            self._next += 1


def _write_shard(path: Path, shard: list[DiskTensor], ahead: _Prefetcher) -> None:
    declared = [(t.key, SAFETENSORS_NAMES[t.dtype], t.shape) for t in shard]
    with StreamingSafetensorsWriter(path, declared, {"format": "pt"}) as writer:
        for tensor in shard:
            writer.write_blocks(tensor.key, ahead.blocks(tensor))


@contextmanager
def _one_thread_per_op() -> Iterator[None]:
    """Values are produced on worker threads (here, in sampling, in NVFP4 quantisation), which keep
    the cores busy; a torch op parallelised inside one of them starts another OpenMP team per
    thread, and the teams then fight for the cores (measured on 2 cores: 3.5 M context switches,
    twice the wall time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def pin_mmap_threshold() -> None:
    """Serve every allocation of 1 MB or more from its own mmap, unmapped when freed (glibc; a no-op
    elsewhere). Process-wide, and it stays.

    glibc starts at 128 KB but raises the threshold to the size of each larger mapped chunk freed
    (up to 32 MB), and its trim threshold to twice that; from then on value blocks and quantisation
    temporaries (4-16 MB) come from the heap arenas of whichever threads allocate them, each of
    which may keep 64 MB free. With the writer's and the samplers' threads the peak then depended on
    the run: 0.41-0.51 GB for the full-preset test, once 1.06 GB. Setting the threshold also stops
    the adjustment. A mapped allocation costs a page fault per 4 KB when first touched, so the hot
    paths reuse their buffers (sampling, expert inputs) or work in small chunks (NVFP4).
    """
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim; a no-op elsewhere).

    Large temporaries (value blocks, NVFP4 quantisation) are freed promptly, but glibc keeps the
    pages and fragments them across threads' arenas, so RSS would creep up by hundreds of MB over
    a run that never holds more than one block live.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_LIBC = _load_libc()
