"""The store's slot table (runtime/store/slot_table.py): it names exactly the experts whose bytes
are in a device slot, else in a host slot, loses an expert before its slot is reused, and while a
step holds it no copy or read overwrites a slot; what a step found through it counts as requests."""

from __future__ import annotations

import time

import pytest
import torch

from store_waits import settle

from flashpack.errors import FlashpackError
from flashpack.layout.pack import Pack
from flashpack.runtime.experts import ON_DISK, host_code
from flashpack.runtime.store import build_store
from flashpack.runtime.store.budget import STAGING_ROW_SETS
from flashpack.runtime.store.config import StoreConfig


def _store(pack: Pack, device_slots: int, host_slots: int, layers: list[int] | None = None, promote: bool = False):
    stride = pack.manifest.document["experts"]["record_stride"]
    staging = STAGING_ROW_SETS * pack.manifest.config.num_experts_per_tok
    config = StoreConfig(vram_budget=(device_slots + staging) * stride, ram_budget=host_slots * stride,
                         rebalance=False, promote=promote)
    return build_store(pack, config, device_reserved=0, poison=True, staging=True, layers=layers)


def _table(store) -> torch.Tensor:
    table = store.hold_slot_table().clone()
    store.release_slot_table()
    return table


def _expected_table(store, shape) -> torch.Tensor:
    expected = torch.full(shape, ON_DISK, dtype=torch.int32)
    for (layer, expert), entry in store.placement.host_slots.entries.items():
        if entry.ready:
            expected[layer, expert] = host_code(entry.slot)
    for (layer, expert), entry in store.placement.device_slots.entries.items():
        if entry.ready:
            expected[layer, expert] = entry.slot
    return expected


def test_publish_copies_only_after_a_refresh():
    """The device table is written by `publish` alone, and only when a refresh came since the last
    copy: a mark left on the device copy survives a publish with nothing new, and a refresh brings
    the host table over again."""
    from flashpack.runtime.store.slot_table import SlotTable

    table = SlotTable(2, 8, torch.device("cpu"))
    assert bool((table.publish() == ON_DISK).all())
    table.device[0, 0] = 99  # stands in for a stale copy: only a publish that copies overwrites it
    assert int(table.publish()[0, 0]) == 99
    table.refresh((1, 3), None, None)
    assert torch.equal(table.publish(), table.host)


def test_table_names_device_then_host_slots_and_drops_evicted_ones(store_pack):
    pack = Pack.open(store_pack)
    layer = sorted({r.layer for r in pack.manifest.expert_records()})[0]
    with _store(pack, device_slots=8, host_slots=10) as store:
        assert bool((_table(store) == ON_DISK).all())
        store.load(layer, [0, 1, 2, 3])
        settle(store)
        table = _table(store)
        assert table.shape[1] == pack.manifest.config.num_experts
        assert torch.equal(table, _expected_table(store, table.shape))
        assert sorted(int(e) for e in (table[layer] >= 0).nonzero()) == [0, 1, 2, 3]
        for batch in ([4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]):  # more than the pool holds
            store.load(layer, batch)
        settle(store)
        table = _table(store)
        assert torch.equal(table, _expected_table(store, table.shape))
        assert int((table >= 0).sum()) == len(store.placement.device_slots.entries) <= 8
        assert int((table <= host_code(0)).sum()) > 0  # evicted from the device, still in the host cache
        for codes in (table[table >= 0], table[table <= host_code(0)]):
            assert codes.unique().numel() == codes.numel()  # no slot named twice
        store.load(layer, [16, 17, 18, 19, 20, 21, 22, 23])  # evicts host entries too (10 host slots)
        settle(store)
        table = _table(store)
        assert torch.equal(table, _expected_table(store, table.shape))


def test_no_copy_or_read_lands_while_a_step_holds_the_table(store_pack):
    pack = Pack.open(store_pack)
    layer = sorted({r.layer for r in pack.manifest.expert_records()})[0]
    with _store(pack, device_slots=8, host_slots=64) as store:
        store.hold_slot_table()
        try:
            assert store.prefetch(layer, [5]) == 1
            time.sleep(0.3)  # the disk read into a host slot must wait for the release, and the copy
            with store.placement.changed:
                assert not store.placement.host_slots.get((layer, 5)).ready
                assert not store.placement.device_slots.get((layer, 5)).ready
        finally:
            store.release_slot_table()
        settle(store)
        assert store.placement.device_slots.get((layer, 5)).ready
        assert int(_table(store)[layer, 5]) == store.placement.device_slots.get((layer, 5)).slot


def test_record_step_counts_requests_and_uses_prefetches(store_pack):
    pack = Pack.open(store_pack)
    layer = sorted({r.layer for r in pack.manifest.expert_records()})[0]
    with _store(pack, device_slots=8, host_slots=64) as store:
        issued = store.prefetch(layer, [1, 2])
        settle(store)
        before = store.stats.layer(layer)
        requests, hits = before.requests, before.device_hits
        store.record_step([(layer, [1, 2, 3], [], 0)])
        after = store.stats.layer(layer)
        assert (after.requests - requests, after.device_hits - hits) == (3, 3)
        assert issued > 0 and after.prefetch_used == issued
        moved = after.bytes_host_to_device
        store.record_step([(layer, [1], [5], 2)])  # one staged and used, two staged for nothing
        assert store.stats.layer(layer).bytes_host_to_device - moved == 3 * store.stride


@pytest.mark.parametrize("promote", [True, False])
def test_a_staged_expert_is_promoted_once_it_outranks_what_it_would_evict(store_pack, promote):
    """With promotions on (off by default): a staged expert takes a device slot once it outranks
    its victim; off, it stays staged however often it is used."""
    pack = Pack.open(store_pack)
    layer = sorted({r.layer for r in pack.manifest.expert_records()})[0]
    with _store(pack, device_slots=4, host_slots=64, layers=[layer], promote=promote) as store:
        store.load(layer, [0, 1, 2, 3])  # the layer's whole share, each requested once
        settle(store)
        store.record_step([(layer, [], [9], 0)])  # one request: ties the victim's count, stays staged
        settle(store)
        assert (layer, 9) not in store.placement.device_slots
        store.record_step([(layer, [], [9], 0)])  # two: outranks it, loaded into a device slot
        settle(store)
        if not promote:
            assert (layer, 9) not in store.placement.device_slots and store.stats.layer(layer).prefetch_issued == 0
            return
        assert store.placement.device_slots.get((layer, 9)).ready
        assert int(_table(store)[layer, 9]) == store.placement.device_slots.get((layer, 9)).slot
        assert store.stats.layer(layer).prefetch_issued == 1 and len(store.placement.device_slots.entries) == 4


def test_a_closed_store_refuses_to_hold_its_table(store_pack):
    pack = Pack.open(store_pack)
    store = _store(pack, device_slots=8, host_slots=64)
    store.close()
    with pytest.raises(FlashpackError, match="closed"):
        store.hold_slot_table()
