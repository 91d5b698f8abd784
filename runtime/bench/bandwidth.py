"""The machine's ceilings, measured once per bench run.

    device          a large device-to-device copy (on a CPU: a large RAM copy); bytes read +
                    written per second, median of several copies timed with CUDA events (a GPU)
                    or the wall clock (a CPU)
    host_to_device  a copy from pinned host memory to the device, bytes per second; None on a
                    CPU, where the store's "copies" are plain RAM copies
    disk            the pack's own expert files read with the store's RecordReader: O_DIRECT
                    (no page cache) into page-aligned buffers, big chunks, several threads, at
                    most `disk_bytes`; where the filesystem refuses O_DIRECT the reader falls back
                    to buffered reads, the JSON says so, and the number is then an upper bound
                    (the page cache may serve it)
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from flashpack.layout.records import PAGE, align_up
from flashpack.runtime.store.reader import RecordReader, aligned_empty

GiB, MiB = 1 << 30, 1 << 20
DEFAULT_COPY_BYTES = {"cuda": 1 * GiB, "cpu": 256 * MiB}
DEFAULT_DISK_BYTES = 2 * GiB
DISK_CHUNK = 8 * MiB
DISK_THREADS = 8


def _median_rate(samples: list[float]) -> float:
    return statistics.median(samples)


def device_copy(device: torch.device, nbytes: int, repeats: int = 5) -> dict:
    """Bytes read + written per second by `dst.copy_(src)` of `nbytes` on `device`."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)  # touched: no first-use page faults timed
    dst = torch.zeros_like(src)
    rates = []
    for index in range(repeats + 1):
        seconds = _time_copy(lambda: dst.copy_(src), device)
        if index:  # the first copy warms up
            rates.append(2 * nbytes / seconds)
    return {
        "bytes_per_s": _median_rate(rates),
        "method": ("device-to-device copy (CUDA events)" if device.type == "cuda" else "RAM copy (wall clock)")
        + ", bytes read + written, median",
        "bytes": nbytes,
        "samples": rates,
    }


def host_to_device(device: torch.device, nbytes: int, repeats: int = 5) -> dict:
    """Pinned host -> device bytes per second; None on a CPU."""
    if device.type != "cuda":
        return {"bytes_per_s": None, "method": "n/a on a CPU (no host-to-device link)", "bytes": 0, "samples": []}
    src = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for index in range(repeats + 1):
        seconds = _time_copy(lambda: dst.copy_(src, non_blocking=True), device)
        if index:
            rates.append(nbytes / seconds)
    return {"bytes_per_s": _median_rate(rates), "method": "pinned host to device copy (CUDA events), median",
            "bytes": nbytes, "samples": rates}


def _time_copy(copy, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        copy()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    begin = time.perf_counter()
    copy()
    return time.perf_counter() - begin


def disk_read(root: Path, files: list[str], limit: int = DEFAULT_DISK_BYTES, chunk: int = DISK_CHUNK,
              threads: int = DISK_THREADS, direct: bool = True) -> dict:
    """Read up to `limit` bytes of `files` (under `root`) in `chunk`-sized aligned reads on `threads`
    threads; bytes per second over the wall time of the whole read."""
    chunk = align_up(chunk, PAGE)
    sizes = {file: os.path.getsize(Path(root) / file) for file in files}
    jobs, planned = [], 0
    offsets = {file: 0 for file in files}
    while planned < limit and any(offsets[f] < sizes[f] for f in files):
        for file in files:  # round robin: the reads spread over the pack's files
            offset = offsets[file]
            if offset >= sizes[file] or planned >= limit:
                continue
            length = min(chunk, sizes[file] - offset, limit - planned)
            jobs.append((file, offset, length))
            offsets[file] += length
            planned += length
    reader = RecordReader(root, files, direct=direct, pieces=1)  # the disk at `threads` reads in flight, unsplit
    threads = max(1, min(threads, len(jobs)))
    buffers = [aligned_empty(chunk) for _ in range(threads)]

    def work(worker: int) -> int:
        done = 0
        for file, offset, length in jobs[worker::threads]:
            reader.read(file, offset, [buffers[worker][:align_up(length, PAGE)]], need=length)
            done += length
        return done

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads, thread_name_prefix="flashpack-bench-read") as pool:
            total = sum(pool.map(work, range(threads)))
        seconds = time.perf_counter() - start
    finally:
        reader.close()
    direct_used = reader.direct
    return {
        "bytes_per_s": total / seconds if seconds > 0 else None,
        "method": ("O_DIRECT" if direct_used else "buffered")
        + f" preadv of the pack's expert files, {chunk // MiB} MiB chunks, {threads} threads",
        "o_direct": direct_used,
        "fallback_reason": reader.fallback_reason,
        "note": None if direct_used else "buffered reads may be served by the page cache: an upper bound, not the disk",
        "bytes": total,
        "seconds": seconds,
        "files": len({job[0] for job in jobs}),
    }


def measure_ceilings(device: torch.device, pack_root: Path, expert_files: list[str], *,
                     copy_bytes: int | None = None, disk_bytes: int = DEFAULT_DISK_BYTES,
                     direct_io: bool = True) -> dict:
    """{"device": ..., "host_to_device": ..., "disk": ...}, each with its `bytes_per_s`."""
    copy_bytes = copy_bytes or DEFAULT_COPY_BYTES.get(device.type, DEFAULT_COPY_BYTES["cpu"])
    return {
        "device": device_copy(device, copy_bytes),
        "host_to_device": host_to_device(device, copy_bytes),
        "disk": disk_read(pack_root, expert_files, limit=disk_bytes, direct=direct_io),
    }


def tier_bandwidths(ceilings: dict) -> dict[str, float | None]:
    """The roofline's tiers -> bytes per second."""
    return {
        "device": ceilings["device"]["bytes_per_s"],
        "host_to_device": ceilings["host_to_device"]["bytes_per_s"],
        "disk_to_host": ceilings["disk"]["bytes_per_s"],
    }
