"""Placement: which record is where in both tiers, the loads filling them, under one lock.

Two `Residency` tables (the device pool, a partition a layer; the host cache, one partition), the
futures of loads in flight, the guesses (prefetches, read-aheads) no load has used yet, the
rebalancer that moves device capacity between layers, and the slot table's codes. Everything here
changes under `changed`, the store's one lock, a condition notified whenever a slot is released
or a load finishes: requests are placed under it (admission.py), and the reader and copy jobs,
which only move bytes, publish here, under it, that a slot is ready or that its load failed
(transfers.py). A slot being loaded is pinned by its load, so it cannot be evicted before it lands.
Plain Python: the slot table is handed in.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

from flashpack.errors import FlashpackError
from flashpack.runtime.store.budget import StorePlan
from flashpack.runtime.store.capacity import GHOST_SIZE, REBALANCE_WINDOW, Rebalancer, even_split
from flashpack.runtime.store.policy import make_policy
from flashpack.runtime.store.residency import Entry, Residency
from flashpack.runtime.store.stats import StoreStats

HOST = 0  # the host cache's single partition
Key = tuple[int, int]  # (layer, expert)


@dataclass
class Copy:
    """One record a copy job moves: host slot of `host_entry` -> device slot `device_slot`."""

    key: Key
    host_entry: Entry
    device_slot: int
    future: Future  # the device load's: its result is the slot, once the copy is enqueued


class Placement:
    def __init__(self, plan: StorePlan, layers: list[int], top_k: int, policy: str, rebalance: bool,
                 table, stats: StoreStats):
        """`table`: the SlotTable whose codes follow every change (slot_table.py)."""
        self.device_slots = Residency(plan.device_slots, even_split(layers, plan.device_slots),
                                      lambda: make_policy(policy), ghost_size=GHOST_SIZE if rebalance else 0)
        self.host_slots = Residency(plan.host_slots, {HOST: plan.host_slots}, lambda: make_policy(policy))
        floor = min(top_k, plan.device_slots // len(layers))
        self._rebalancer = Rebalancer(floor=floor, window=REBALANCE_WINDOW * len(layers)) if rebalance else None
        self.changed = threading.Condition(threading.Lock())  # a slot was released or a load finished
        self.inflight: dict[Key, Future] = {}  # device loads not yet ready
        self.host_loads: dict[Key, Future] = {}  # host loads not yet ready
        self.closed = False  # no new load is placed
        self._table, self._stats = table, stats
        self._prefetched: set[Key] = set()  # placed by prefetch, no request used them yet
        self._read_ahead: set[Key] = set()  # host entries read ahead, no load took them yet
        self._landing = 0  # CUDA copies published whose host slot is not free yet
        self._table_held = False  # a step reading the published table is being enqueued
        self._table_read = None  # its CUDA event: completes when the last such step has run

    def close(self) -> None:
        self.closed = True

    def busy(self) -> bool:
        """(under the lock) A load is in flight, or a copy's host slot still waits for it to land."""
        return bool(self.inflight or self.host_loads or self._landing)

    # ---- placing (under the lock) -------------------------------------------------------------

    def refresh(self, key: Key) -> None:
        """`key`'s slot-table code from its entries as they are now."""
        self._table.refresh(key, self.device_slots.get(key), self.host_slots.get(key))

    def place_host(self, key: Key, seed: float | None = None) -> Future:
        """Give `key` a pinned host slot for a disk read; returns the read's future, done once it lands."""
        _, evicted = self.host_slots.place(key, HOST, pin=True, seed=seed)
        if evicted is not None:
            self.refresh(evicted)
            self._stats.bump(evicted[0], evictions_host=1)
            if evicted in self._read_ahead:
                self._read_ahead.discard(evicted)
                self._stats.bump(evicted[0], read_ahead_wasted=1)
        read = self.host_loads[key] = Future()
        return read

    def evicted_device(self, key: Key | None) -> None:
        """Count a device eviction (a prefetch that no request used is wasted)."""
        if key is None:
            return
        self.refresh(key)
        self._stats.bump(key[0], evictions_device=1)
        if key in self._prefetched:
            self._prefetched.discard(key)
            self._stats.bump(key[0], prefetch_wasted=1)

    def mark_prefetched(self, key: Key) -> None:
        self._prefetched.add(key)

    def use_prefetch(self, key: Key) -> bool:
        """A request found `key` where a prefetch placed it: True the first time."""
        if key in self._prefetched:
            self._prefetched.discard(key)
            return True
        return False

    def mark_read_ahead(self, key: Key) -> None:
        self._read_ahead.add(key)

    def use_read_ahead(self, key: Key) -> bool:
        """A load took `key` from the host cache where a read-ahead put it: True the first time."""
        if key in self._read_ahead:
            self._read_ahead.discard(key)
            return True
        return False

    def rebalance(self, layer: int, hits: int, requests: int) -> None:
        """Feed a decode-sized request's hits to the rebalancer; move capacity when it decides to."""
        if self._rebalancer is None:
            return
        ghosts, self.device_slots.ghost_hits[layer] = self.device_slots.ghost_hits[layer], 0
        self._rebalancer.record(layer, hits, requests, ghosts)
        if not self._rebalancer.due():
            return
        move = self._rebalancer.decide(self.device_slots.capacity)
        if move is not None:
            for key in self.device_slots.move_capacity(*move):
                self.evicted_device(key)

    def streamed(self, layer: int, hits_before: int, requests: int, prefill: bool) -> None:
        """(takes the lock) A stream of `layer` ended; `hits_before`: the layer's device hits when it
        began. Decode-sized requests feed the rebalancer; a prefill streams every expert through the
        layer's slots, and its misses and ghost hits say nothing about the room decoding needs."""
        if self._rebalancer is None:
            return
        if prefill:
            with self.changed:
                self.device_slots.ghost_hits[layer] = 0
        else:
            hits = self._stats.layer(layer).device_hits - hits_before
            with self.changed:
                self.rebalance(layer, hits, requests)

    # ---- what the reader and copy jobs publish (each takes the lock) ---------------------------

    def host_entries(self, keys: list[Key]) -> list[Entry]:
        with self.changed:
            return [self.host_slots.get(key) for key in keys]

    def publish_host(self, keys: list[Key], unpin: list[Key]) -> None:
        """Mark `keys` ready in the host cache; unpin those no copy waits for."""
        with self.changed:
            for key in unpin:
                self.host_slots.unpin(key)
            for key in keys:
                entry = self.host_slots.get(key)
                entry.ready = True
                self.refresh(key)
                load = self.host_loads.pop(key, None)
                if load is not None:
                    load.set_result(None)
            self.changed.notify_all()

    def fail_host(self, keys: list[Key], error: BaseException) -> None:
        with self.changed:
            for key in keys:
                self._read_ahead.discard(key)
                if self.host_slots.get(key) is not None:
                    self.host_slots.drop(key)
                    self.refresh(key)
                load = self.host_loads.pop(key, None)
                if load is not None:
                    load.set_exception(as_flashpack(error))
                self._stats.bump(key[0], failed=1)
            self.changed.notify_all()

    def fail_device(self, key: Key, error: BaseException) -> None:
        with self.changed:
            if self.device_slots.get(key) is not None:
                self.device_slots.drop(key)
                self.refresh(key)
            self._prefetched.discard(key)
            future = self.inflight.pop(key, None)
            self.changed.notify_all()
        if future is not None and not future.done():
            future.set_exception(as_flashpack(error))

    def publish_copies(self, copies: list[Copy], landed) -> list[Entry]:
        """The copies' device entries are ready (for work that waits on `landed`, their CUDA event,
        if any); their loads' pins go. Without an event their host slots are free at once; with one
        they stay pinned until `copies_landed`. Returns the device entries."""
        entries = []
        with self.changed:
            for copy in copies:
                entry = self.device_slots.get(copy.key)  # still this load's entry: the load holds a pin on it
                entry.ready, entry.landed = True, landed
                entries.append(entry)
                self.refresh(copy.key)
                self.device_slots.unpin(copy.key)  # the load's pin; requests hold their own
                self.inflight.pop(copy.key, None)
                if landed is None and self.host_slots.get(copy.key) is copy.host_entry:
                    self.host_slots.unpin(copy.key)
            if landed is not None:
                self._landing += len(copies)
            self.changed.notify_all()
        return entries

    def copies_landed(self, copies: list[Copy], entries: list[Entry], landed) -> None:
        """The copies have read their host slots: free those; decode steps may read the device slots."""
        with self.changed:
            for copy, entry in zip(copies, entries):
                if self.host_slots.get(copy.key) is copy.host_entry:
                    self.host_slots.unpin(copy.key)
                if entry.landed is landed:
                    entry.landed = None  # users of the slot need not wait on it any more
                    self.refresh(copy.key)
            self._landing -= len(copies)
            self.changed.notify_all()

    def copies_failed(self, copies: list[Copy]) -> None:
        """Free the host slots of copies that never ran (their device loads fail apart)."""
        with self.changed:
            for copy in copies:
                if self.host_slots.get(copy.key) is copy.host_entry:
                    self.host_slots.unpin(copy.key)

    # ---- the slot table's hold (slot_table.py) ------------------------------------------------

    def hold_table(self):
        """Publish the slot table and hold it: no slot it names is written until `release_table`."""
        with self.changed:
            if self.closed:
                raise FlashpackError("the expert store is closed")
            self._table_held = True
            return self._table.publish()

    @property
    def table_held(self) -> bool:
        """A step reading the published table is being enqueued."""
        return self._table_held

    def release_table(self, read) -> None:
        """The steps reading the held table are enqueued; `read`: their CUDA event, None on CPU."""
        with self.changed:
            self._table_held, self._table_read = False, read
            self.changed.notify_all()

    def table_read(self):
        """Before a slot is written: wait while a step reading the slot table is being enqueued.
        Returns the CUDA event that completes when the last such step has run (None on CPU)."""
        with self.changed:
            while self._table_held:
                self.changed.wait()
            return self._table_read

    def check(self) -> None:
        with self.changed:
            self.device_slots.check()
            self.host_slots.check()


def as_flashpack(error: BaseException) -> FlashpackError:
    return error if isinstance(error, FlashpackError) else FlashpackError(f"expert load failed: {error}")
