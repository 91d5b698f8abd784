"""Reading many expert records at start, at disk speed: `read_records_in_batches`.

Loading every record once (the resident store) is a sequential read of the expert files. Through
the memory map it would be one 4 KiB page fault at a time (the map is MADV_RANDOM, so the kernel
reads nothing ahead) on one thread, which is how a cold page cache delivered 95 MB/s on the H200
machine's NVMe, where O_DIRECT reads of the same files run at 1-1.8 GB/s. So the records are read
here through the store's O_DIRECT `RecordReader`, in batches of records that lie back to back in a
file (one read a batch), on several threads at once; each thread hashes the records it read (xxhash
releases the GIL, so hashing runs beside the other threads' reads) and hands the batch on. The
consumer gets batches in file order, copies them where they go, and hands the buffer back for the
next read: at most `buffers` batches are in memory at once.

    batches of records --reader threads: O_DIRECT read + xxh64--> consume(first_row, rows, batch)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from flashpack.errors import PackDamageError
from flashpack.layout.manifest import ExpertRecordEntry
from flashpack.layout.records import record_hash
from flashpack.runtime.store.reader import RecordReader, aligned_empty

BATCH_BYTES = 64 << 20  # one read: large enough for the disk's full rate, small enough to double-buffer
READ_THREADS = 4  # batches read at once; each read is split into the reader's parts too


@dataclass(frozen=True)
class RecordBatch:
    """Records `first_row ..` in load order, lying back to back in one file."""

    first_row: int
    records: list[ExpertRecordEntry]


def plan_batches(records: list[ExpertRecordEntry], stride: int, batch_bytes: int = BATCH_BYTES) -> list[RecordBatch]:
    """Cut records (sorted by file and offset) into runs one read can fetch: same file, each record
    `stride` after the one before, at most `batch_bytes` together. Plain Python."""
    per_batch = max(1, batch_bytes // stride)
    batches: list[RecordBatch] = []
    run: list[ExpertRecordEntry] = []
    first = 0
    for row, record in enumerate(records):
        if run and (record.file != run[-1].file or record.offset != run[-1].offset + stride or len(run) == per_batch):
            batches.append(RecordBatch(first, run))
            run, first = [], row
        run.append(record)
    if run:
        batches.append(RecordBatch(first, run))
    return batches


def read_records_in_batches(
    reader: RecordReader,
    records: list[ExpertRecordEntry],
    stride: int,
    consume: Callable[[RecordBatch, torch.Tensor], None],
    *,
    verify: bool = True,
    pin: bool = False,
    threads: int = READ_THREADS,
    batch_bytes: int = BATCH_BYTES,
) -> None:
    """Read `records` (sorted by file and offset) and call `consume(batch, rows)` for each batch in
    order, `rows` a uint8 [len(batch.records), stride] view of a page-aligned buffer (pinned with
    `pin`) that is reused once `consume` returns; bytes past a record's length are zero. With
    `verify`, a record whose bytes fail its xxh64 raises PackDamageError naming it."""
    batches = plan_batches(records, stride, batch_bytes)
    if not batches:
        return
    per_batch = max(len(batch.records) for batch in batches)
    buffers = [aligned_empty(per_batch * stride, pin=pin).view(per_batch, stride)
               for _ in range(min(threads + 1, len(batches)))]
    with ThreadPoolExecutor(min(threads, len(batches)), thread_name_prefix="flashpack-bulk-read") as pool:
        pending: list[Future] = []
        queue = iter(zip(batches, _cycle(buffers)))
        for _ in range(len(buffers)):
            _submit_next(pool, queue, pending, reader, stride, verify)
        try:
            while pending:
                batch, rows = pending.pop(0).result()
                consume(batch, rows)
                _submit_next(pool, queue, pending, reader, stride, verify)
        finally:
            for future in pending:  # a failure: let the reads in flight end before their buffers go
                future.cancel()
            for future in pending:
                if not future.cancelled():
                    future.exception()


def _cycle(buffers: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    while True:
        yield from buffers


def _submit_next(pool: ThreadPoolExecutor, queue, pending: list[Future], reader: RecordReader, stride: int,
                 verify: bool) -> None:
    item = next(queue, None)
    if item is not None:
        pending.append(pool.submit(_read_batch, reader, *item, stride, verify))


def _read_batch(reader: RecordReader, batch: RecordBatch, buffer: torch.Tensor, stride: int,
                verify: bool) -> tuple[RecordBatch, torch.Tensor]:
    count = len(batch.records)
    rows = buffer[:count]
    first, last = batch.records[0], batch.records[-1]
    reader.read(first.file, first.offset, [rows.view(-1)], need=(count - 1) * stride + last.length)
    for row, record in zip(rows, batch.records):
        row[record.length:].zero_()  # the file's padding, or a short last read's stale bytes
        if verify and record_hash(memoryview(row.numpy())[:record.length]) != record.xxh64:
            raise PackDamageError(f"corrupt expert record: layer {record.layer} expert {record.expert} "
                                  f"fails its xxh64 check ({record.file} @ {record.offset})")
    return batch, rows
