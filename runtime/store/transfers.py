"""The byte-moving half of the TieredStore: reader-thread and copy jobs (a copy job runs on the copy
thread, or on the thread that asked for a decode layer's few records).

A read job fills host slots from disk (one `preadv` for a run of contiguous records), checks
each record's xxh64 the first time it is read, publishes the good ones and fails the bad ones
by name; a copy job moves a batch of host slots (what one request or prefetch found in the host
cache, or one record a read just brought in) to their device slots and publishes the device
entries together: one lock, one CUDA event and one hand-off a batch, not a record (a prompt moves
hundreds of records a layer, and per-record Python kept the copy thread busier than the copy
engine). Jobs
only move bytes; every change to residency happens under the store's lock, so residency is
published by the host side alone.

On CUDA a batch's copies are enqueued on the store's copy stream (each after the compute that last
read its device slot, by the event recorded when it was released) and the entries are published at
once with the batch's `landed` event: whoever uses a slot makes its own stream wait on that event
(ExpertHandle.wait), so no thread blocks per record and copies run back to back. The host slots
the copies read stay pinned until a "landing" thread has seen the event complete; only then may a
disk read overwrite them. On CPU the copies are done when the job returns and nothing waits.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from flashpack.errors import FlashpackError, PackDamageError
from flashpack.layout.records import record_hash
from flashpack.runtime.store.residency import Entry


@dataclass
class Copy:
    """One record a copy job moves: host slot of `host_entry` -> device slot `device_slot`."""

    key: tuple[int, int]
    host_entry: Entry
    device_slot: int
    future: Future  # the device load's: its result is the slot, once the copy is enqueued


class TransferJobs:
    """Mixed into TieredStore; uses its pools, residency tables, lock, reader and stats."""

    def _read_job(
        self, keys: list[tuple[int, int]], then: tuple[int, Future] | None = None, prewarm: bool = False,
    ) -> None:
        """Read the records of `keys` (contiguous on disk when several) into their host slots,
        check each, publish the good ones; then copy the first to device slot `then` if given."""
        with self._lock:
            host_entries = [self.host_slots.get(key) for key in keys]
        try:
            entries = [self.pack.record_entry(*key) for key in keys]
        except FlashpackError as error:  # no such record: fail the loads rather than leave them hanging
            self._fail_host(keys, error)
            if then is not None:
                self._fail_device(keys[0], error)
            return
        self._after_table_readers(host=True)  # the host slots may have been staged from until now
        start = time.perf_counter()
        try:
            self.reader.read(entries[0].file, entries[0].offset, [self.host_pool.slot(h.slot) for h in host_entries],
                             need=(len(keys) - 1) * self.stride + entries[-1].length)
        except OSError as error:
            more = f" (and {len(keys) - 1} more records)" if len(keys) > 1 else ""
            failure = FlashpackError(
                f"reading layer {keys[0][0]} expert {keys[0][1]}{more} from {entries[0].file} "
                f"at offset {entries[0].offset} failed: {error.strerror or error}"
            )
            self._fail_host(keys, failure)
            if then is not None:
                self._fail_device(keys[0], failure)
            return
        finally:
            self.stats.add_time("read_seconds", time.perf_counter() - start)
            self.stats.add_time("read_calls", 1)
        good = []
        for key, entry, host_entry in zip(keys, entries, host_entries):
            try:
                self._check(key, entry, self.host_pool.slot(host_entry.slot))
            except BaseException as error:
                self._fail_host([key], error)
                if then is not None:
                    self._fail_device(key, error)
                continue
            self.stats.bump(key[0], **{"prewarm_bytes_disk_to_host" if prewarm else "bytes_disk_to_host": self.stride})
            good.append(key)
        self._publish_host(good, unpin=good if then is None else good[1:])
        if then is not None and good and good[0] == keys[0]:
            self._copy_job([Copy(keys[0], host_entries[0], *then)], None, prewarm)

    def _check(self, key: tuple[int, int], entry, buffer: torch.Tensor) -> None:
        if not self.verify_records:
            return
        with self._lock:
            if key in self._verified:
                return
        if record_hash(memoryview(buffer.numpy())[:entry.length]) != entry.xxh64:
            raise PackDamageError(
                f"corrupt expert record: layer {key[0]} expert {key[1]} fails its xxh64 check "
                f"({entry.file} @ {entry.offset})"
            )
        with self._lock:
            self._verified.add(key)
            self.stats.verified_records += 1

    def _copy_job(self, copies: list[Copy], load: Future | None = None, prewarm: bool = False) -> None:
        """Host slots -> device slots; publish the device entries (their bytes are in place for work
        that waits on `entry.landed`). `load` is the host read these copies waited for, if any."""
        try:
            if load is not None and load.exception() is not None:
                raise load.exception()
            landed = self._copy_to_device([(copy.host_entry.slot, copy.device_slot) for copy in copies])
            counter = "prewarm_bytes_host_to_device" if prewarm else "bytes_host_to_device"
            for layer, count in Counter(copy.key[0] for copy in copies).items():
                self.stats.bump(layer, **{counter: count * self.stride})
        except BaseException as error:
            with self._changed:
                for copy in copies:
                    if self.host_slots.get(copy.key) is copy.host_entry:
                        self.host_slots.unpin(copy.key)
            for copy in copies:
                self._fail_device(copy.key, error)
            return
        entries = []
        with self._changed:
            for copy in copies:
                entry = self.device_slots.get(copy.key)  # still this load's entry: the load holds a pin on it
                entry.ready, entry.landed = True, landed
                entries.append(entry)
                self._refresh_table(copy.key)
                self.device_slots.unpin(copy.key)  # the load's pin; requests hold their own
                self._inflight.pop(copy.key, None)
                if landed is None and self.host_slots.get(copy.key) is copy.host_entry:
                    self.host_slots.unpin(copy.key)
            if landed is not None:
                self._landing += len(copies)
            self._changed.notify_all()
        for copy in copies:
            copy.future.set_result(copy.device_slot)
        if landed is not None:
            self._lander.submit(self._copy_landed, copies, entries, landed)

    def _copy_to_device(self, slots: list[tuple[int, int]]):
        """Copy (host slot, device slot) pairs. CPU: done on return, returns None. CUDA: enqueued
        on the copy stream, each behind the last release of its device slot; returns the event
        that completes when every copy has landed."""
        table_read = self._after_table_readers(host=False)
        if self._copy_stream is None:
            for host_slot, device_slot in slots:
                self.device_pool.slot(device_slot).copy_(self.host_pool.slot(host_slot))
            return None
        with torch.cuda.stream(self._copy_stream):
            if table_read is not None:  # the last step that looked slots up must finish first
                self._copy_stream.wait_event(table_read)
            waited: dict[int, torch.cuda.Event] = {}  # a release's one event frees many slots
            for host_slot, device_slot in slots:
                freed = self._slot_free_events.pop(device_slot, None)
                if freed is not None and id(freed) not in waited:  # the compute that last read the slot
                    self._copy_stream.wait_event(freed)
                    waited[id(freed)] = freed
                self.device_pool.slot(device_slot).copy_(self.host_pool.slot(host_slot), non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self._copy_stream)
        return landed

    def _after_table_readers(self, host: bool):
        """Before a slot is written: wait while a step reading the slot table is being enqueued.
        Returns the event that completes when the last such step has run; a host slot waits for
        it here (the writer is this thread), a device slot's copy waits for it on its stream."""
        with self._changed:
            while self._table_held:
                self._changed.wait()
            table_read = self._table_read
        if host and table_read is not None:
            table_read.synchronize()
        return table_read

    def _copy_landed(self, copies: list[Copy], entries: list[Entry], landed) -> None:
        """(landing thread, CUDA) Once the copies have read their host slots, free those for reuse."""
        try:
            landed.synchronize()
        finally:
            with self._changed:
                for copy, entry in zip(copies, entries):
                    if self.host_slots.get(copy.key) is copy.host_entry:
                        self.host_slots.unpin(copy.key)
                    if entry.landed is landed:
                        entry.landed = None  # users of the slot need not wait on it any more
                        self._refresh_table(copy.key)  # decode steps may read the slot from now on
                self._landing -= len(copies)
                self._changed.notify_all()

    def _publish_host(self, keys: list[tuple[int, int]], unpin: list[tuple[int, int]]) -> None:
        """Mark `keys` ready in the host cache; unpin those no copy waits for."""
        with self._changed:
            for key in unpin:
                self.host_slots.unpin(key)
            for key in keys:
                entry = self.host_slots.get(key)
                entry.ready = True
                self._refresh_table(key)
                load = self._host_loads.pop(key, None)
                if load is not None:
                    load.set_result(None)
            self._changed.notify_all()

    def _fail_host(self, keys: list[tuple[int, int]], error: BaseException) -> None:
        with self._changed:
            for key in keys:
                self._read_ahead.discard(key)
                if self.host_slots.get(key) is not None:
                    self.host_slots.drop(key)
                    self._refresh_table(key)
                load = self._host_loads.pop(key, None)
                if load is not None:
                    load.set_exception(_as_flashpack(error))
                self.stats.bump(key[0], failed=1)
            self._changed.notify_all()

    def _fail_device(self, key: tuple[int, int], error: BaseException) -> None:
        with self._changed:
            if self.device_slots.get(key) is not None:
                self.device_slots.drop(key)
                self._refresh_table(key)
            self._prefetched.discard(key)
            future = self._inflight.pop(key, None)
            self._changed.notify_all()
        if future is not None and not future.done():
            future.set_exception(_as_flashpack(error))


def _as_flashpack(error: BaseException) -> FlashpackError:
    return error if isinstance(error, FlashpackError) else FlashpackError(f"expert load failed: {error}")
