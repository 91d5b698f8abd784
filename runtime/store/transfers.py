"""The byte-moving half of the TieredStore: reader-thread and copy-thread jobs.

A read job fills host slots from disk (one `preadv` for a run of contiguous records), checks
each record's xxh64 the first time it is read, publishes the good ones and fails the bad ones
by name; a copy job moves one host slot to its device slot on the copy stream and publishes the
device entry once the copy has landed. Jobs only move bytes; every change to residency happens
under the store's lock, so residency is published by the host side alone.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from flashpack.errors import FlashpackError
from flashpack.layout.records import record_hash
from flashpack.runtime.store.residency import Entry


class TransferJobs:
    """Mixed into TieredStore; uses its pools, residency tables, lock, reader and stats."""

    def _read_job(
        self, keys: list[tuple[int, int]], then: tuple[int, Future] | None = None, prewarm: bool = False,
    ) -> None:
        """Read the records of `keys` (contiguous on disk when several) into their host slots,
        check each, publish the good ones; then copy the first to device slot `then` if given."""
        with self._lock:
            host_entries = [self.host_slots.get(key) for key in keys]
        entries = [self.pack.record_entry(*key) for key in keys]
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
            self._copy_job(keys[0], host_entries[0], *then, None, prewarm)

    def _check(self, key: tuple[int, int], entry, buffer: torch.Tensor) -> None:
        if not self.verify_records:
            return
        with self._lock:
            if key in self._verified:
                return
        if record_hash(memoryview(buffer.numpy())[:entry.length]) != entry.xxh64:
            raise FlashpackError(
                f"corrupt expert record: layer {key[0]} expert {key[1]} fails its xxh64 check "
                f"({entry.file} @ {entry.offset})"
            )
        with self._lock:
            self._verified.add(key)
            self.stats.verified_records += 1

    def _copy_job(
        self, key: tuple[int, int], host_entry: Entry, device_slot: int, future: Future, load: Future | None = None,
        prewarm: bool = False,
    ) -> None:
        """Host slot -> device slot on the copy stream; publish the device entry once it landed.
        `load` is the host read this copy waited for, when there was one."""
        try:
            if load is not None and load.exception() is not None:
                raise load.exception()
            source, target = self.host_pool.slot(host_entry.slot), self.device_pool.slot(device_slot)
            if self._copy_stream is None:
                target.copy_(source)
            else:
                with torch.cuda.stream(self._copy_stream):
                    freed = self._slot_free_events.pop(device_slot, None)
                    if freed is not None:  # the compute that last read this slot must finish first
                        self._copy_stream.wait_event(freed)
                    target.copy_(source, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(self._copy_stream)
                done.synchronize()
            counter = "prewarm_bytes_host_to_device" if prewarm else "bytes_host_to_device"
            self.stats.bump(key[0], **{counter: self.stride})
        except BaseException as error:
            with self._changed:
                if self.host_slots.get(key) is host_entry:
                    self.host_slots.unpin(key)
            self._fail_device(key, error)
            return
        with self._changed:
            if self.host_slots.get(key) is host_entry:
                self.host_slots.unpin(key)
            self.device_slots.get(key).ready = True
            self._inflight.pop(key, None)
            self._changed.notify_all()
        future.set_result(device_slot)

    def _publish_host(self, keys: list[tuple[int, int]], unpin: list[tuple[int, int]]) -> None:
        """Mark `keys` ready in the host cache; unpin those no copy waits for."""
        with self._changed:
            for key in unpin:
                self.host_slots.unpin(key)
            for key in keys:
                self.host_slots.get(key).ready = True
                load = self._host_loads.pop(key, None)
                if load is not None:
                    load.set_result(None)
            self._changed.notify_all()

    def _fail_host(self, keys: list[tuple[int, int]], error: BaseException) -> None:
        with self._changed:
            for key in keys:
                if self.host_slots.get(key) is not None:
                    self.host_slots.drop(key)
                load = self._host_loads.pop(key, None)
                if load is not None:
                    load.set_exception(_as_flashpack(error))
                self.stats.bump(key[0], failed=1)
            self._changed.notify_all()

    def _fail_device(self, key: tuple[int, int], error: BaseException) -> None:
        with self._changed:
            if self.device_slots.get(key) is not None:
                self.device_slots.drop(key)
            future = self._inflight.pop(key, None)
            self._changed.notify_all()
        if future is not None and not future.done():
            future.set_exception(_as_flashpack(error))


def _as_flashpack(error: BaseException) -> FlashpackError:
    return error if isinstance(error, FlashpackError) else FlashpackError(f"expert load failed: {error}")
