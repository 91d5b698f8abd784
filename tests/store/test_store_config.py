"""StoreConfig: bad settings are refused when the config is made, and each store follows its own
config, down to the part that uses each setting, with another store of other settings alive in
the same process. Pre-warming goes through the store's public parts."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from store_waits import settle

from flashpack.errors import FlashpackError
from flashpack.layout.pack import Pack
from flashpack.runtime.store import build_store
from flashpack.runtime.store.config import StoreConfig
from flashpack.runtime.store.prewarm import plan_prewarm, prewarm_store


@pytest.mark.parametrize("settings, message", [
    ({"policy": "x"}, "unknown eviction policy 'x'"),
    ({"read_pieces": 0}, "read_pieces must be a whole number of at least 1, got 0"),
    ({"reader_threads": True}, "reader_threads must be a whole number"),
    ({"vram_budget": "lots"}, "cannot read vram_budget 'lots'"),
    ({"ram_budget": "12 parsecs"}, "cannot read ram_budget"),
    ({"vram_budget": -1}, "vram_budget must not be negative"),
])
def test_a_bad_setting_is_refused_by_name(settings, message):
    with pytest.raises(FlashpackError, match=message):
        StoreConfig(**settings)


def _layers(pack: Pack) -> list[int]:
    return sorted({r.layer for r in pack.manifest.expert_records()})


def _store(pack: Pack, host_slots: int = 64, **settings):
    stride = pack.manifest.document["experts"]["record_stride"]
    config = StoreConfig(vram_budget=8 * len(_layers(pack)) * stride, ram_budget=host_slots * stride, rebalance=False,
                         **settings)
    return build_store(pack, config, device_reserved=0, poison=True)


def _copying_threads(store, layer: int, experts: list[int]) -> set[str]:
    """The threads that ran the copy jobs of a request for `experts` (in the host cache only)."""
    threads, original = set(), store.transfers.copy
    store.transfers.copy = lambda copies, *args: (threads.add(threading.current_thread().name), original(copies, *args))
    try:
        store.wait(store.request(layer, experts))
        settle(store)
    finally:
        store.transfers.copy = original
    return threads


def _guess_runs_beside_a_required_read(store, pack: Pack) -> bool:
    """Whether a prefetch's read starts while a request's read is held on the disk."""
    layers = _layers(pack)
    asked, guessed = (layers[1], 5), (layers[2], 0)
    where = {(pack.record_entry(*key).file, pack.record_entry(*key).offset): key for key in (asked, guessed)}
    gate, order, original = threading.Event(), [], store.transfers.reader.read

    def read(file, offset, buffers, need):
        order.append(where.get((file, offset)))
        if where.get((file, offset)) == asked:
            assert gate.wait(20), "gate never opened"
        return original(file, offset, buffers, need)

    store.transfers.reader.read = read
    handles = store.request(*asked[:1], [asked[1]])
    deadline = time.monotonic() + 10
    while not order:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert store.prefetch(guessed[0], [guessed[1]]) == 1
    time.sleep(0.3)
    beside = guessed in order
    gate.set()
    store.wait(handles)
    settle(store)
    store.transfers.reader.read = original
    assert order == [asked, guessed]
    return beside


def test_two_stores_in_one_process_each_follow_their_own_config(store_pack):
    pack = Pack.open(store_pack)
    layer, experts = _layers(pack)[0], pack.manifest.config.num_experts
    top_k = pack.manifest.config.num_experts_per_tok
    caller = {threading.current_thread().name}
    with _store(pack, read_pieces=1, copy_on_requesting_thread=True, guesses_beside_required=True,
                reader_threads=2) as first, \
            _store(pack, read_pieces=4, copy_on_requesting_thread=False, guesses_beside_required=False,
                   reader_threads=2) as second:
        assert (first.transfers.reader.pieces, second.transfers.reader.pieces) == (1, 4)
        for store in (first, second):
            store.prewarm({layer: list(range(experts))})
            settle(store)
        host_only = [[e for e in range(experts) if (layer, e) in store.placement.host_slots
                      and (layer, e) not in store.placement.device_slots][:top_k] for store in (first, second)]
        assert _copying_threads(first, layer, host_only[0]) == caller  # a decode layer's copies, here
        assert _copying_threads(second, layer, host_only[1]) != caller  # handed to the copy thread
        assert _guess_runs_beside_a_required_read(first, pack)
        assert not _guess_runs_beside_a_required_read(second, pack)


def test_resident_experts_read_as_their_config_says(store_pack):
    from flashpack.runtime.store.resident import ResidentExperts

    pack = Pack.open(store_pack)
    checked = ResidentExperts(pack, "cpu", progress=False)
    unchecked = ResidentExperts(pack, "cpu", StoreConfig(verify_records=False, read_pieces=1), progress=False)
    assert checked.stats.verified_records == len(pack.manifest.expert_records())
    assert unchecked.stats.verified_records == 0


def test_prewarm_places_the_plan_through_the_public_parts(store_pack):
    """`prewarm_store` takes the store's admission, placement and stats: the hottest records of
    every layer in the host cache, read in runs of contiguous records, and each layer's share of
    them on the device, counted as pre-warming."""
    pack = Pack.open(store_pack)
    layers, experts = _layers(pack), pack.manifest.config.num_experts
    ranked = {layer: [(7 * rank + layer) % experts for rank in range(12)] for layer in layers}
    with _store(pack, host_slots=12 * len(layers)) as store:  # room for every ranked record
        placement = store.placement
        device, host = plan_prewarm(ranked, None, placement.device_slots.capacity, placement.host_slots.slots)
        placed = prewarm_store(store.admission, placement, store.stats, ranked)
        settle(store)
        assert placed == {"device": sum(len(e) for e in device.values()), "host": len(host)}
        assert set(placement.host_slots.entries) == set(host)
        assert set(placement.device_slots.entries) == {(layer, e) for layer, chosen in device.items() for e in chosen}
        total = store.stats.total()
        assert (total.prewarmed_host, total.prewarmed_device, total.requests) == (len(host), placed["device"], 0)
        store.check_budgets()


def test_prewarm_imports_no_store_module():
    """The store imports prewarm, not the other way round."""
    code = "import sys, flashpack.runtime.store.prewarm; assert 'flashpack.runtime.store.store' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
