"""Transfers: the threads that move record bytes, disk -> host cache -> device pool.

A read job fills host slots from disk (one `preadv` for a run of contiguous records), checks
each record's xxh64 the first time it is read, publishes the good ones and fails the bad ones
by name; a copy job moves a batch of host slots (what one request or prefetch found in the host
cache, or one record a read just brought in) to their device slots and publishes the device
entries together: one lock, one CUDA event and one hand-off a batch, not a record (a prompt moves
hundreds of records a layer, and per-record Python kept the copy thread busier than the copy
engine). Read jobs run on the reader threads, in two lanes (lanes.py); copy jobs on the one copy
thread, or on the thread that asked for a decode layer's few records (admission.py). Jobs only
move bytes: every change to residency is published through `Placement`, under its lock.

On CUDA a batch's copies are enqueued on the copy stream (each after the compute that last read
its device slot, by the event recorded when it was released) and the entries are published at
once with the batch's `landed` event: whoever uses a slot makes its own stream wait on that event
(ExpertHandle.wait), so no thread blocks per record and copies run back to back. The host slots
the copies read stay pinned until a "landing" thread has seen the event complete; only then may a
disk read overwrite them. On CPU the copies are done when the job returns and nothing waits.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch

from flashpack.errors import FlashpackError, PackDamageError
from flashpack.layout.pack import Pack
from flashpack.layout.records import record_hash
from flashpack.runtime.store.config import StoreConfig
from flashpack.runtime.store.lanes import ReadLanes
from flashpack.runtime.store.placement import Copy, Key, Placement
from flashpack.runtime.store.reader import RecordReader
from flashpack.runtime.store.stats import StoreStats
from flashpack.runtime.store.tiers import SlotPool

MAX_RUN = 64  # records a pre-warming read takes at once (one preadv)


class Transfers:
    def __init__(self, pack: Pack, files: list[str], config: StoreConfig, placement: Placement,
                 device_pool: SlotPool, host_pool: SlotPool, stats: StoreStats):
        """`files`: the record files of the layers served. The reader and its lanes follow
        `config`'s direct_io, reader_threads, read_pieces and guesses_beside_required."""
        self.pack, self.stride = pack, pack.manifest.document["experts"]["record_stride"]
        self.verify_records = config.verify_records
        self._placement, self._stats = placement, stats
        self._device_pool, self._host_pool = device_pool, host_pool
        cuda = device_pool.device.type == "cuda"
        self.reader = RecordReader(pack.root, files, direct=config.direct_io, pieces=config.read_pieces,
                                   callers=config.reader_threads)
        self._reads = ReadLanes(config.reader_threads, guesses_beside_required=config.guesses_beside_required)
        # one copy thread, its own two lanes: a request's copies go ahead of prefetch copies queued
        # by the layer before (a through-store decode layer otherwise waits behind the guesses)
        self._copies = ReadLanes(1, name="flashpack-copy")
        self._lander = ThreadPoolExecutor(1, thread_name_prefix="flashpack-land") if cuda else None
        self._stream = torch.cuda.Stream(device_pool.device) if cuda else None
        self._slot_free_events: dict[int, torch.cuda.Event] = {}  # device slot -> its last readers' event
        self._verified: set[Key] = set()  # records whose xxh64 was checked (under the placement's lock)

    # ---- what admission and pre-warming call ---------------------------------------------------

    def read(self, keys: list[Key], then: tuple[int, Future] | None = None, prewarm: bool = False,
             guess: bool = False) -> None:
        """Queue a read of `keys` (contiguous on disk when several) into their host slots, placed
        and pinned already; `then` (device slot, load future): copy the first there once read.
        `guess`: in the prefetch lane, where `promote(keys[0])` finds it."""
        self._reads.submit(self._read_job, keys, then, prewarm, low=guess, key=keys[0])

    def read_runs(self, keys: list[Key]) -> None:
        """(pre-warming) Queue reads of `keys` in runs of records contiguous on disk, up to MAX_RUN."""
        entries = sorted(((self.pack.record_entry(*key), key) for key in keys), key=lambda p: (p[0].file, p[0].offset))
        runs: list[list[Key]] = []
        previous = None
        for entry, key in entries:
            if (previous is not None and entry.file == previous.file and entry.offset == previous.offset + self.stride
                    and len(runs[-1]) < MAX_RUN):
                runs[-1].append(key)
            else:
                runs.append([key])
            previous = entry
        for run in runs:
            self.read(run, prewarm=True)

    def promote(self, key: Key) -> None:
        """A request now waits for `key`'s queued guess: move its read to the required lane."""
        self._reads.promote(key)

    def submit_copies(self, copies: list[Copy], low: bool = False, prewarm: bool = False) -> None:
        """Hand `copies` to the copy thread as one job (`low`: a prefetch's), and empty the list."""
        if copies:
            self._copies.submit(self.copy, list(copies), None, prewarm, low=low)
            copies.clear()

    def copy_when_read(self, load: Future, copy: Copy, prewarm: bool = False, low: bool = False) -> None:
        """Copy once `load`, the host read `copy` comes from, is done (pre-warming, or read ahead)."""
        load.add_done_callback(lambda done: self._copies.submit(self.copy, [copy], done, prewarm, low=low))

    def slot_freed(self, slot: int, event: torch.cuda.Event) -> None:
        """(under the placement's lock) Device slot `slot` may be overwritten once `event` completes."""
        self._slot_free_events[slot] = event

    def pending_reads(self) -> tuple[int, int]:
        """(required, prefetch) reads queued and not yet started."""
        return self._reads.pending()

    def close(self) -> None:
        self._reads.shutdown(wait=True)
        self._copies.shutdown(wait=True)
        if self._lander is not None:
            self._lander.shutdown(wait=True)
        self.reader.close()

    # ---- the jobs ---------------------------------------------------------------------------------

    def _read_job(self, keys: list[Key], then: tuple[int, Future] | None = None, prewarm: bool = False) -> None:
        """Read the records of `keys` into their host slots, check each, publish the good ones; then
        copy the first to device slot `then` if given."""
        placement = self._placement
        host_entries = placement.host_entries(keys)
        try:
            entries = [self.pack.record_entry(*key) for key in keys]
        except FlashpackError as error:  # no such record: fail the loads rather than leave them hanging
            placement.fail_host(keys, error)
            if then is not None:
                placement.fail_device(keys[0], error)
            return
        table_read = placement.table_read()  # the host slots may have been staged from until now
        if table_read is not None:
            table_read.synchronize()
        start = time.perf_counter()
        try:
            self.reader.read(entries[0].file, entries[0].offset, [self._host_pool.slot(h.slot) for h in host_entries],
                             need=(len(keys) - 1) * self.stride + entries[-1].length)
        except OSError as error:
            more = f" (and {len(keys) - 1} more records)" if len(keys) > 1 else ""
            failure = FlashpackError(
                f"reading layer {keys[0][0]} expert {keys[0][1]}{more} from {entries[0].file} "
                f"at offset {entries[0].offset} failed: {error.strerror or error}"
            )
            placement.fail_host(keys, failure)
            if then is not None:
                placement.fail_device(keys[0], failure)
            return
        finally:
            self._stats.add_time("read_seconds", time.perf_counter() - start)
            self._stats.add_time("read_calls", 1)
        good = []
        for key, entry, host_entry in zip(keys, entries, host_entries):
            try:
                self._check(key, entry, self._host_pool.slot(host_entry.slot))
            except BaseException as error:
                placement.fail_host([key], error)
                if then is not None:
                    placement.fail_device(key, error)
                continue
            self._stats.bump(key[0], **{"prewarm_bytes_disk_to_host" if prewarm else "bytes_disk_to_host": self.stride})
            good.append(key)
        placement.publish_host(good, unpin=good if then is None else good[1:])
        if then is not None and good and good[0] == keys[0]:
            self.copy([Copy(keys[0], host_entries[0], *then)], None, prewarm)

    def _check(self, key: Key, entry, buffer: torch.Tensor) -> None:
        if not self.verify_records:
            return
        with self._placement.changed:
            if key in self._verified:
                return
        if record_hash(memoryview(buffer.numpy())[:entry.length]) != entry.xxh64:
            raise PackDamageError(
                f"corrupt expert record: layer {key[0]} expert {key[1]} fails its xxh64 check "
                f"({entry.file} @ {entry.offset})"
            )
        with self._placement.changed:
            self._verified.add(key)
            self._stats.verified_records += 1

    def copy(self, copies: list[Copy], load: Future | None = None, prewarm: bool = False) -> None:
        """The copy job: host slots -> device slots, then publish the device entries (their bytes are
        in place for work that waits on `entry.landed`). `load`: the host read these waited for."""
        try:
            if load is not None and load.exception() is not None:
                raise load.exception()
            landed = self._copy_to_device([(copy.host_entry.slot, copy.device_slot) for copy in copies])
            counter = "prewarm_bytes_host_to_device" if prewarm else "bytes_host_to_device"
            for layer, count in Counter(copy.key[0] for copy in copies).items():
                self._stats.bump(layer, **{counter: count * self.stride})
        except BaseException as error:
            self._placement.copies_failed(copies)
            for copy in copies:
                self._placement.fail_device(copy.key, error)
            return
        entries = self._placement.publish_copies(copies, landed)
        for copy in copies:
            copy.future.set_result(copy.device_slot)
        if landed is not None:
            self._lander.submit(self._copy_landed, copies, entries, landed)

    def _copy_to_device(self, slots: list[tuple[int, int]]):
        """Copy (host slot, device slot) pairs. CPU: done on return, returns None. CUDA: enqueued
        on the copy stream, each behind the last release of its device slot; returns the event
        that completes when every copy has landed. Each run of copies between two such waits is one
        call (`torch._foreach_copy_`, which gives up the GIL once for the run, where a call a copy
        gave it up and took it back each time: in run 99's trace such copies were enqueued 36-41 us
        apart while the requesting thread admitted a prompt's next chunk, 10-12 us apart otherwise)."""
        cuda = self._stream is not None
        table_read = self._placement.table_read() if cuda else None
        with torch.cuda.stream(self._stream) if cuda else nullcontext():
            if table_read is not None:  # the last step that looked slots up must finish first
                self._stream.wait_event(table_read)
            for freed, run in runs_after_releases(slots, self._slot_free_events):
                if freed is not None:  # the compute that last read one of the run's slots
                    self._stream.wait_event(freed)
                torch._foreach_copy_([self._device_pool.slot(device) for _, device in run],
                                     [self._host_pool.slot(host) for host, _ in run], non_blocking=cuda)
            if not cuda:
                return None
            landed = torch.cuda.Event()
            landed.record(self._stream)
        return landed

    def _copy_landed(self, copies: list[Copy], entries: list, landed) -> None:
        """(landing thread, CUDA) Once the copies have read their host slots, free those for reuse."""
        try:
            landed.synchronize()
        finally:
            self._placement.copies_landed(copies, entries, landed)


def runs_after_releases(
    slots: list[tuple[int, int]], free_events: dict[int, object],
) -> list[tuple[object | None, list[tuple[int, int]]]]:
    """(host slot, device slot) pairs in runs to copy in order, each after the event that opens it
    (None: none). A pair whose device slot was last read by compute with an event in `free_events`
    (popped) opens a run after that event, unless an earlier run waited for it already (a release's
    one event frees many slots)."""
    runs: list[tuple[object | None, list[tuple[int, int]]]] = [(None, [])]
    waited: set[int] = set()
    for host_slot, device_slot in slots:
        freed = free_events.pop(device_slot, None)
        if freed is not None and id(freed) not in waited:
            waited.add(id(freed))
            runs.append((freed, []))
        runs[-1][1].append((host_slot, device_slot))
    return [(event, run) for event, run in runs if run]
