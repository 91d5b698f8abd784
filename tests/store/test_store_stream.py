"""The store as the MoE kernels' source: `stream` (ready handles chunk by chunk, the next chunk's
loads started before a chunk is handed out, every slot released however the consumer stops),
`bank` (the device pool viewed whole, rows dequantising like the pack) and `prefetch` (low
priority: no requests counted, no pinned entry evicted, reads behind required reads)."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from store_waits import settle

from flashpack.errors import FlashpackError
from flashpack.layout.pack import Pack
from flashpack.layout.records import PROJECTIONS
from flashpack.runtime.kernels.bank import ExpertBank
from flashpack.runtime.kernels.reference import dequantize_expert
from flashpack.runtime.pack_source import PackExperts
from flashpack.runtime.store import build_store
from flashpack.runtime.store.config import StoreConfig
from flashpack.runtime.store.lanes import ReadLanes
from flashpack.runtime.store.tiers import SlotPool


def _info(pack: Pack) -> SimpleNamespace:
    cfg = pack.manifest.config
    return SimpleNamespace(stride=pack.manifest.document["experts"]["record_stride"], experts=cfg.num_experts,
                           layers=sorted({r.layer for r in pack.manifest.expert_records()}),
                           top_k=cfg.num_experts_per_tok)


def _store(pack: Pack, device_slots: int, host_slots: int, **settings):
    """A store of `device_slots` and `host_slots` slots; `settings`: more of its StoreConfig."""
    stride = pack.manifest.document["experts"]["record_stride"]
    config = StoreConfig(vram_budget=device_slots * stride, ram_budget=host_slots * stride, **settings)
    return build_store(pack, config, device_reserved=0, poison=True)


def _nothing_pinned(store) -> bool:
    settle(store)
    return all(e.pins == 0 for e in store.placement.device_slots.entries.values()) and \
        all(e.pins == 0 for e in store.placement.host_slots.entries.values())


def _slot_bytes(store, slot: int, length: int) -> bytes:
    return bytes(store.device_pool.slot(slot)[:length].cpu().numpy())


def _gate_reads(store, pack: Pack, keys: set[tuple[int, int]], gate: threading.Event):
    """Make reads of `keys` block until `gate` is set; returns the list of keys read, in order."""
    where = {(pack.record_entry(*key).file, pack.record_entry(*key).offset): key for key in
             ((r.layer, r.expert) for r in pack.manifest.expert_records())}
    original, order = store.transfers.reader.read, []

    def read(file, offset, buffers, need):
        key = where[(file, offset)]
        order.append(key)
        if key in keys:
            assert gate.wait(20), "gate never opened"
        return original(file, offset, buffers, need)

    store.transfers.reader.read = read
    return order


# ---- stream ----------------------------------------------------------------------------------

def test_stream_covers_every_expert_once_with_the_records_bytes(store_pack):
    pack = Pack.open(store_pack)
    info = _info(pack)
    experts, layers = info.experts, info.layers
    with _store(pack, 8 * len(layers), 16) as store:
        layer = layers[2]
        store.fetch(layer, [3, 9])  # two hits for the prefill to take first
        chunks = []
        for chunk in store.stream(layer, list(range(experts))):
            assert all(h.ready() for h in chunk)
            for handle in chunk:  # the slot holds the record exactly as the pack stores it
                length = pack.record_entry(layer, handle.expert).length
                assert _slot_bytes(store, handle.slot, length) == bytes(pack.record_bytes(layer, handle.expert))
            assert len({h.slot for h in chunk}) == len(chunk)
            chunks.append([h.expert for h in chunk])
        assert sorted(e for chunk in chunks for e in chunk) == list(range(experts))
        assert len(chunks) > 2 and set(chunks[0]) >= {3, 9}  # streamed, hits first
        assert _nothing_pinned(store)
        decode = list(store.stream(layer, [1, 2, 5, 30]))  # decode-sized: one chunk
        assert len(decode) == 1 and sorted(h.expert for h in decode[0]) == [1, 2, 5, 30]
        total = store.stats.layer(layer)
        assert total.requests == 2 + experts + 4
        assert total.requests == total.device_hits + total.host_hits + total.disk_reads + total.joined
        assert _nothing_pinned(store)
        store.check_budgets()


def test_stream_starts_the_next_chunk_before_yielding(store_pack):
    pack = Pack.open(store_pack)
    info = _info(pack)
    experts, layers = info.experts, info.layers
    with _store(pack, 8 * len(layers), 32, rebalance=False) as store:
        layer = layers[1]
        wanted = list(range(experts))
        counters = store.stats.layer(layer)
        gate = threading.Event()
        second = {(layer, e) for e in range(4, 8)}  # cold store, 4 misses a chunk: the second chunk
        _gate_reads(store, pack, second, gate)
        stream = store.stream(layer, wanted)
        first = next(stream)
        assert sorted(h.expert for h in first) == [0, 1, 2, 3]
        assert counters.requests == 8  # the second chunk was requested ...
        with store.placement.changed:
            assert second <= set(store.placement.inflight)  # ... and its reads are under way
            assert all(store.placement.device_slots.get(key).pins for key in second)
        gate.set()
        seen = len(first)
        for chunk in stream:
            seen += len(chunk)
            if seen < experts:  # every chunk but the last: the next one is already requested
                assert counters.requests > seen
        assert seen == experts and counters.requests == experts
        assert _nothing_pinned(store)


def test_a_prefills_hits_come_alone_first_while_its_first_misses_load(store_pack):
    """The hits are handed out at once, as a chunk of their own, with the first misses' loads
    started into the share's other slots: a consumer works on the hits while those land (with hits
    and misses in one chunk, it would wait for the misses' loads: the control holds the reads)."""
    pack = Pack.open(store_pack)
    info = _info(pack)
    experts, layers = info.experts, info.layers
    with _store(pack, 8 * len(layers), 32, rebalance=False) as store:
        layer = layers[1]
        store.fetch(layer, [3, 9])
        gate = threading.Event()
        _gate_reads(store, pack, {(layer, e) for e in range(experts) if e not in (3, 9)}, gate)
        stream = store.stream(layer, list(range(experts)))
        handed = []
        consumer = threading.Thread(target=lambda: handed.append(next(stream)), daemon=True)
        consumer.start()
        consumer.join(5)
        try:
            assert handed, "the hits waited for the misses' loads"
            assert sorted(h.expert for h in handed[0]) == [3, 9]
            with store.placement.changed:  # half the share's misses, loading behind the gate
                loading = {key for key in store.placement.inflight if key[0] == layer}
            assert len(loading) == 4 and (layer, 3) not in loading and (layer, 9) not in loading
        finally:
            gate.set()
            consumer.join(20)
        rest = [h.expert for chunk in stream for h in chunk]
        assert sorted(rest) == [e for e in range(experts) if e not in (3, 9)]
        assert _nothing_pinned(store)


def test_a_chunk_makes_its_stream_wait_once_for_each_copy_event(store_pack, monkeypatch):
    """Handles whose copies crossed as one batch share its event: awaiting a chunk has the stream
    wait for each distinct event once, not once a handle (a prompt's chunk is tens of handles, and
    each wait is a Python call and a CUDA call; the control, a wait a handle, waits four times)."""
    pack = Pack.open(store_pack)
    info = _info(pack)
    with _store(pack, 8 * len(info.layers), 32) as store:
        handles = store.request(info.layers[0], [0, 1, 2, 3])
        entries = [handle._entry for handle in handles]
        first_batch, second_batch = object(), object()
        for handle, event in zip(handles, (first_batch, first_batch, second_batch, first_batch)):
            handle._entry = SimpleNamespace(landed=event)  # as four copies in two batches leave them
        waited = []
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(wait_event=waited.append))
        try:
            store._await(handles)
        finally:
            for handle, entry in zip(handles, entries):
                handle._entry = entry
            store.admission.release(handles)
        assert waited == [first_batch, second_batch]
        assert _nothing_pinned(store)


def test_stream_releases_its_slots_when_closed_early_or_the_consumer_raises(store_pack):
    pack = Pack.open(store_pack)
    info = _info(pack)
    experts, layers = info.experts, info.layers
    with _store(pack, 8 * len(layers), 16) as store:
        stream = store.stream(layers[0], list(range(experts)))
        next(stream)
        stream.close()
        assert _nothing_pinned(store)
        with pytest.raises(RuntimeError, match="consumer failed"):
            for _ in store.stream(layers[1], list(range(experts))):
                raise RuntimeError("consumer failed")
        assert _nothing_pinned(store)
        chunks = list(store.stream(layers[1], list(range(experts))))  # the store still serves
        assert sum(len(c) for c in chunks) == experts
        assert _nothing_pinned(store)
        store.check_budgets()


def test_stream_names_a_corrupt_record_and_frees_everything(pack_copy, corrupt_record):
    corrupt_record(pack_copy, 2, 13)
    pack = Pack.open(pack_copy)
    info = _info(pack)
    experts, layers = info.experts, info.layers
    with _store(pack, 8 * len(layers), 16) as store:
        with pytest.raises(FlashpackError, match="corrupt expert record: layer 2 expert 13"):
            for _ in store.stream(2, list(range(experts))):
                pass
        assert _nothing_pinned(store)
        assert (2, 13) not in store.placement.device_slots
        with pytest.raises(FlashpackError, match="layer 2 expert 13"):
            store.fetch(2, [12, 13])
        good = [e for e in range(experts) if e != 13]
        assert sum(len(c) for c in store.stream(2, good)) == len(good)
        assert _nothing_pinned(store)
        store.check_budgets()


def test_streams_from_threads_each_cover_their_request_once(store_pack):
    """Threads streaming prompts and decode steps through a pool a little larger than one
    layer's top_k: staged chunks never starve another thread into dropping experts."""
    pack = Pack.open(store_pack)
    info = _info(pack)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(30):
                layer = rng.choice(info.layers)
                wanted = sorted(rng.sample(range(info.experts), rng.choice([1, info.top_k, info.top_k + 3, 20])))
                seen = [h.expert for chunk in store.stream(layer, wanted) for h in chunk]
                assert sorted(seen) == wanted
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    with _store(pack, 3 * info.top_k, 6) as store:
        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors[0]
        assert _nothing_pinned(store)
        store.check_budgets()


# ---- bank ------------------------------------------------------------------------------------

def test_bank_views_the_device_pool_and_rows_dequantise_like_the_pack(store_pack):
    pack = Pack.open(store_pack)
    info = _info(pack)
    stride, experts, layers, top_k = info.stride, info.experts, info.layers, info.top_k
    with _store(pack, 3 * top_k, 8) as store:
        bank = store.bank
        assert isinstance(bank, ExpertBank) and bank.num_experts == store.plan.device_slots
        pool = store.device_pool.tensor
        assert tuple(pool.shape) == (store.plan.device_slots, stride)
        assert bank.gate_nibbles.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()  # a view
        for layer, wanted in ((layers[0], [0, 5, 31]), (layers[-1], list(range(experts)))):
            for chunk in store.stream(layer, wanted):
                for handle in chunk:
                    record = pack.expert(layer, handle.expert)
                    for projection in PROJECTIONS:
                        got = dequantize_expert(store.bank, handle.slot, projection)
                        assert torch.equal(got, record.dequantize(projection)), (layer, handle.expert, projection)


def test_slot_pools_device_is_one_tensor_host_is_chunked():
    device = SlotPool(10, 4096, "cpu", chunk_bytes=3 * 4096)
    assert tuple(device.tensor.shape) == (10, 4096) and device.slot(7).data_ptr() == device.tensor[7].data_ptr()
    host = SlotPool(10, 4096, "cpu", host=True, chunk_bytes=3 * 4096)
    assert host.nbytes == 10 * 4096 and host.slot(9).numel() == 4096
    with pytest.raises(ValueError, match="chunks"):
        _ = host.tensor


# ---- prefetch --------------------------------------------------------------------------------

def test_prefetch_is_counted_apart_and_a_later_request_uses_it(store_pack):
    pack = Pack.open(store_pack)
    info = _info(pack)
    layers = info.layers
    reference = PackExperts(pack)
    with _store(pack, 8 * len(layers), 32, rebalance=False) as store:
        layer = layers[3]
        store.fetch(layer, [20])  # one host/device resident expert: skipped by the prefetch
        assert store.prefetch(layer, [0, 1, 2, 20]) == 3
        settle(store)
        counters = store.stats.layer(layer)
        assert counters.requests == 1 and counters.prefetch_issued == 3 and counters.prefetch_from_disk == 3
        assert store.prefetch(layer, [0, 1, 2]) == 0  # resident now
        assert all(store.placement.device_slots.get((layer, e)).pins == 0 for e in (0, 1, 2))  # unpinned once landed
        got = store.fetch(layer, [0, 1, 2, 3])
        want = reference.fetch(layer, [0, 1, 2, 3])
        assert all(torch.equal(got[e].up, want[e].up) for e in want)
        assert counters.requests == 5 and counters.device_hits == 3 and counters.disk_reads == 2
        assert counters.prefetch_used == 3 and counters.prefetch_wasted == 0
        # a prefetch still in flight is joined by the request and counts as used
        gate = threading.Event()
        _gate_reads(store, pack, {(layer, 9)}, gate)
        assert store.prefetch(layer, [9]) == 1
        handles = store.request(layer, [9])
        assert handles[0].source == "joined"
        gate.set()
        store.wait(handles)
        assert counters.prefetch_used == 4 and counters.joined == 1
        stats = store.stats.to_dict()
        assert stats["prefetch"] == {"issued": 4, "from_disk": 4, "used": 4, "wasted": 0, "accuracy": 1.0}
        assert stats["layers"][str(layer)]["prefetch_used"] == 4
        assert stats["requests"] == 6
        assert _nothing_pinned(store)


def test_prefetch_evicted_unused_is_wasted_and_host_hits_only_copy(store_pack):
    pack = Pack.open(store_pack)
    info = _info(pack)
    layers = info.layers
    with _store(pack, 8 * len(layers), 64, rebalance=False) as store:
        layer = layers[0]
        store.fetch(layer, [0, 1])
        store.fetch(layer, list(range(8, 16)))  # the layer's share of 8: 0 and 1 go to the host cache only
        assert (layer, 0) not in store.placement.device_slots and (layer, 0) in store.placement.host_slots
        reads = store.stats.read_calls
        assert store.prefetch(layer, [0, 1]) == 2
        settle(store)
        assert store.stats.read_calls == reads  # host-cache hits: copies only
        assert store.stats.layer(layer).prefetch_from_disk == 0
        store.fetch(layer, list(range(16, 24)))  # evicts both before any request used them
        counters = store.stats.layer(layer)
        assert counters.prefetch_wasted == 2 and counters.prefetch_used == 0
        assert store.stats.to_dict()["prefetch"]["accuracy"] == 0.0


def test_prefetch_never_evicts_pinned_entries_nor_leaves_its_share(store_pack):
    pack = Pack.open(store_pack)
    info = _info(pack)
    experts, layers = info.experts, info.layers
    with _store(pack, 8 * len(layers), 64, rebalance=False) as store:
        held = store.request(layers[0], list(range(8)))  # the layer's whole share, pinned
        assert store.prefetch(layers[0], list(range(8, 16))) == 0
        assert all((layers[0], e) in store.placement.device_slots for e in range(8))
        # a layer prefetches into its own share only, though most of the pool is free
        assert store.prefetch(layers[1], list(range(experts))) == store.placement.device_slots.capacity[layers[1]]
        settle(store)
        for layer in layers:
            assert store.placement.device_slots.count[layer] <= store.placement.device_slots.capacity[layer]
        assert store.stats.total().requests == 8
        store.check_budgets()
        # and a prefetch for the held layer never takes the slots the request holds
        store.prefetch(layers[0], list(range(16, 32)))
        assert all((layers[0], e) in store.placement.device_slots for e in range(8))
        store.wait(held)
        assert _nothing_pinned(store)
        store.check_budgets()


def test_read_ahead_brings_disk_records_into_the_host_cache_only_and_a_later_load_takes_them(store_pack):
    pack = Pack.open(store_pack)
    layers = _info(pack).layers
    reference = PackExperts(pack)
    with _store(pack, 8 * len(layers), 32, rebalance=False) as store:
        layer = layers[2]
        store.fetch(layer, [20])  # in the host cache and on the device: skipped
        assert store.read_ahead(layer, [0, 1, 2, 20]) == 3
        settle(store)
        placement = store.placement
        assert all((layer, e) in placement.host_slots and (layer, e) not in placement.device_slots for e in (0, 1, 2))
        assert store.read_ahead(layer, [0, 1, 2]) == 0  # in the host cache now
        reads = store.stats.read_calls
        handles = store.request(layer, [0, 1])
        assert [handle.source for handle in handles] == ["host", "host"]
        got, want = store.wait(handles), reference.fetch(layer, [0, 1])
        assert all(torch.equal(got[e].down, want[e].down) for e in want)
        assert store.stats.read_calls == reads  # taken from the host cache, not read again
        assert store.stats.to_dict()["read_ahead"] == {"issued": 3, "used": 2, "wasted": 0, "accuracy": 2 / 3}
        # evicted from the host cache before any load took it: wasted
        for other, first in ((layers[3], 8), (layers[1], 8), (layers[0], 8), (layers[0], 16)):  # 32 records
            store.fetch(other, list(range(first, first + 8)))
        counters = store.stats.layer(layer)
        assert (layer, 2) not in store.placement.host_slots and counters.read_ahead_wasted == 1
        assert _nothing_pinned(store)


@pytest.mark.parametrize("device_slots, host_slots", [("top_k", 1), ("top_k+1", 2), ("2 per layer", 4)])
def test_prefetch_and_read_ahead_under_a_tiny_budget_neither_block_nor_fail(store_pack, device_slots, host_slots):
    pack = Pack.open(store_pack)
    info = _info(pack)
    experts, layers, top_k = info.experts, info.layers, info.top_k
    reference = PackExperts(pack)
    slots = {"top_k": top_k, "top_k+1": top_k + 1, "2 per layer": 2 * len(layers)}[device_slots]
    rng = random.Random(slots)
    with _store(pack, slots, host_slots) as store:
        for step in range(60):
            layer = layers[step % len(layers)]
            wanted = sorted(rng.sample(range(experts), top_k if step % 7 else experts))
            got = store.fetch(layer, wanted)
            want = reference.fetch(layer, wanted)
            assert all(torch.equal(got[e].gate, want[e].gate) for e in want)
            start = time.perf_counter()
            store.prefetch(layers[(step + 1) % len(layers)], sorted(rng.sample(range(experts), top_k)))
            store.read_ahead(layers[(step + 2) % len(layers)], sorted(rng.sample(range(experts), top_k)))
            assert time.perf_counter() - start < 1.0  # never waits
            store.check_budgets()
        assert _nothing_pinned(store)


def test_required_reads_go_before_queued_prefetch_reads(store_pack):
    pack = Pack.open(store_pack)
    info = _info(pack)
    layers = info.layers
    with _store(pack, 8 * len(layers), 32, reader_threads=1, rebalance=False) as store:
        gate = threading.Event()
        order = _gate_reads(store, pack, {(1, 0)}, gate)
        assert store.prefetch(1, [0, 1, 2]) == 3
        deadline = time.monotonic() + 10
        while not order:  # the first prefetch read holds the only reader thread
            assert time.monotonic() < deadline
            time.sleep(0.01)
        handles = store.request(2, [7])
        assert store.transfers.pending_reads() == (1, 2)
        gate.set()
        store.wait(handles)
        settle(store)
        assert order == [(1, 0), (2, 7), (1, 1), (1, 2)]


def test_a_prefetch_after_a_request_starts_while_its_loads_are_in_flight(store_pack):
    """A through-store decode layer hands the next layer's guess to stream(): it is issued once the
    layer's own reads are queued, before the layer waits for them, and read behind them."""
    pack = Pack.open(store_pack)
    layers = _info(pack).layers
    with _store(pack, 8 * len(layers), 32, reader_threads=1, rebalance=False) as store:
        gate, asked, guessed = threading.Event(), (layers[1], 5), [(layers[2], 0), (layers[2], 1)]
        order = _gate_reads(store, pack, {asked}, gate)
        stream = store.stream(asked[0], [asked[1]], prefetch_after=(layers[2], [e for _, e in guessed]))
        first = threading.Thread(target=lambda: next(stream))
        first.start()
        deadline = time.monotonic() + 10
        while store.stats.layer(layers[2]).prefetch_issued < 2 or not order:  # issued while the read is held
            assert time.monotonic() < deadline, "the prefetch waited for the request's loads"
            time.sleep(0.01)
        assert first.is_alive() and store.transfers.pending_reads() == (0, 2)
        gate.set()
        first.join(10)
        stream.close()
        settle(store)
        assert order == [asked, *guessed]
        assert all((layer, expert) in store.placement.device_slots for layer, expert in guessed)
        assert _nothing_pinned(store)


def test_request_copies_go_before_queued_prefetch_copies(store_pack):
    """One copy thread, two lanes: a request's host-to-device copies overtake the prefetch copies
    queued before them. The copy thread takes a prompt's batches and promotions; a decode layer's
    few copies it takes only with copy_on_requesting_thread off, as here."""
    pack = Pack.open(store_pack)
    info = _info(pack)
    layers, experts = info.layers, info.experts
    with _store(pack, 4 * len(layers), 64, rebalance=False, copy_on_requesting_thread=False) as store:
        store.prewarm({layer: list(range(experts)) for layer in layers})
        settle(store)
        host_only = [[e for e in range(experts) if store.placement.host_slots.get((layer, e)) is not None
                      and store.placement.device_slots.get((layer, e)) is None] for layer in layers[1:3]]
        guessed, asked = [(layers[1], e) for e in host_only[0][:3]], (layers[2], host_only[1][0])
        gate, order, original = threading.Event(), [], store.transfers.copy

        def copy_job(copies, *args):
            order.append([copy.key for copy in copies])
            if copies[0].key == guessed[0]:
                assert gate.wait(20), "gate never opened"
            return original(copies, *args)

        store.transfers.copy = copy_job
        assert store.prefetch(layers[1], [guessed[0][1]]) == 1
        deadline = time.monotonic() + 10
        while not order:  # the first prefetch's copy holds the only copy thread
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert store.prefetch(layers[1], [e for _, e in guessed[1:]]) == 2
        handles = store.request(*asked[:1], [asked[1]])
        gate.set()
        store.wait(handles)
        settle(store)
        assert order == [[guessed[0]], [asked], guessed[1:]]


def test_a_requests_host_hits_cross_as_one_copy_job(store_pack):
    """A request's records found in the host cache go to the copy thread as one batch (one lock,
    one event), not one job a record: a prompt moves hundreds a layer."""
    pack = Pack.open(store_pack)
    info = _info(pack)
    layer, experts = info.layers[0], info.experts
    with _store(pack, 4 * len(info.layers), 64, rebalance=False) as store:
        store.prewarm({layer: list(range(experts))})
        settle(store)
        host_only = [e for e in range(experts) if store.placement.host_slots.get((layer, e)) is not None
                     and store.placement.device_slots.get((layer, e)) is None][:3]
        assert len(host_only) == 3
        jobs, original = [], store.transfers.copy
        store.transfers.copy = lambda copies, *args: (jobs.append([c.key[1] for c in copies]), original(copies, *args))
        handles = store.request(layer, host_only)
        assert all(handle.source == "host" for handle in handles)
        for handle in handles:  # each record lands in its own slot
            handle.wait()
            length = pack.record_entry(layer, handle.expert).length
            assert _slot_bytes(store, handle.slot, length) == bytes(pack.record_bytes(layer, handle.expert))
        store.wait(handles)
        settle(store)
        assert jobs == [host_only]
        assert _nothing_pinned(store)


def test_a_decode_layers_host_hits_are_copied_by_the_calling_thread_a_prompts_by_the_copy_thread(store_pack):
    """A handed-off copy waits for the GIL while the caller runs Python; a decode layer's few
    copies, its request's and its prefetch's, are enqueued where they are asked for, a prompt's many
    on the copy thread."""
    pack = Pack.open(store_pack)
    info = _info(pack)
    layer, experts = info.layers[0], info.experts

    def copying_threads(inline: bool, count: int, prefetch: bool = False) -> set[str]:
        with _store(pack, 4 * len(info.layers) + experts, 64, rebalance=False,
                    copy_on_requesting_thread=inline) as store:
            store.prewarm({layer: list(range(experts))})
            settle(store)
            host_only = [e for e in range(experts) if store.placement.host_slots.get((layer, e)) is not None
                         and store.placement.device_slots.get((layer, e)) is None][:count]
            assert len(host_only) == count
            threads, original = set(), store.transfers.copy
            store.transfers.copy = lambda copies, *args: (threads.add(threading.current_thread().name),
                                                     original(copies, *args))
            if prefetch:
                assert store.prefetch(layer, host_only) == count
            else:
                store.wait(store.request(layer, host_only))
            settle(store)
            assert _nothing_pinned(store)
            return threads

    top_k, caller = pack.manifest.config.num_experts_per_tok, {threading.current_thread().name}
    assert copying_threads(True, top_k) == caller
    assert copying_threads(True, top_k, prefetch=True) == caller
    assert copying_threads(True, top_k + 1) != caller  # a prompt's chunk
    assert copying_threads(False, top_k) != caller  # the control
    assert copying_threads(False, top_k, prefetch=True) != caller


def test_read_lanes_keep_a_thread_for_required_reads():
    lanes = ReadLanes(2)
    release, done = threading.Event(), threading.Event()
    running = []
    for _ in range(3):
        lanes.submit(lambda: (running.append(1), release.wait(10)), low=True)
    time.sleep(0.2)
    assert len(running) == 1  # threads - 1 prefetch reads at once
    lanes.submit(done.set)
    assert done.wait(5)  # served while the prefetch reads wait
    release.set()
    lanes.shutdown()
    assert len(running) == 3
    with pytest.raises(RuntimeError):
        lanes.submit(done.set)


def _running_while_required_reads(beside: bool) -> tuple[bool, bool]:
    """(a prefetch job ran while a required job ran, a queued one was promoted and then ran while
    it ran): three threads, one required job held until the end."""
    lanes = ReadLanes(3, guesses_beside_required=beside)
    hold, started, guessed, promoted = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    lanes.submit(lambda: (started.set(), hold.wait(10)))
    assert started.wait(5)
    lanes.submit(guessed.set, low=True, key="guess")
    lanes.submit(promoted.set, low=True, key="joined")
    beside_ran = guessed.wait(0.3)
    moved = lanes.promote("joined")  # only a job still queued moves
    promoted_ran = promoted.wait(5)
    hold.set()
    assert guessed.wait(5)  # once the required job is done the guess runs
    lanes.shutdown()
    return beside_ran, moved and promoted_ran


def test_a_guess_starts_beside_a_running_required_read_unless_guesses_wait():
    beside, _ = _running_while_required_reads(True)  # the store's default rule
    assert beside
    # the stricter rule: a guess waits while a required read runs, unless a request comes to wait
    # for it (promoted)
    beside, promoted = _running_while_required_reads(False)
    assert not beside and promoted


@pytest.mark.parametrize("guess, source", [("prefetch", "joined"), ("read_ahead", "host")])
def test_a_request_for_a_queued_guess_promotes_its_read(store_pack, guess, source):
    """Two reader threads run one guess's read at a time (threads - 1): a second guess (a prefetch,
    or a read-ahead into the host cache) queues behind the one running; a request that comes to wait
    for the queued guess moves its read to the required lane, where it starts at once."""
    pack = Pack.open(store_pack)
    layers = _info(pack).layers
    with _store(pack, 8 * len(layers), 32, reader_threads=2, rebalance=False) as store:
        gate, running, queued = threading.Event(), (layers[1], 5), (layers[3], 1)
        order = _gate_reads(store, pack, {running}, gate)
        assert store.prefetch(running[0], [running[1]]) == 1
        deadline = time.monotonic() + 10
        while not order:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert getattr(store, guess)(queued[0], [queued[1]]) == 1
        time.sleep(0.2)
        assert order == [running] and store.transfers.pending_reads() == (0, 1)  # one guess at a time
        handles = store.request(queued[0], [queued[1]])
        assert handles[0].source == source
        while len(order) < 2:
            assert time.monotonic() < deadline, "the requested guess still waits behind the running one"
            time.sleep(0.01)
        assert order == [running, queued]
        store.wait(handles)
        gate.set()
        counters = store.stats.layer(queued[0])
        assert (counters.prefetch_used, counters.read_ahead_used) == ((1, 0) if guess == "prefetch" else (0, 1))
        assert _nothing_pinned(store)


def test_copies_go_in_runs_each_after_the_release_that_opens_it():
    """A batch's copies are enqueued a run a call: a new run starts at each release event not yet
    waited for (the compute that last read its slot), so no copy goes before its slot's readers
    finish and none waits for a release that freed no slot of its own; each event once."""
    from flashpack.runtime.store.transfers import runs_after_releases

    first, second = object(), object()
    free = {11: first, 13: second, 14: first, 99: second}  # device slot -> its last readers' event
    runs = runs_after_releases([(0, 10), (1, 11), (2, 12), (3, 13), (4, 14)], free)
    assert runs == [(None, [(0, 10)]), (first, [(1, 11), (2, 12)]), (second, [(3, 13), (4, 14)])]
    assert free == {99: second}  # the copied slots' events are used up, the others' stay
    assert runs_after_releases([(5, 11), (6, 12)], {11: first}) == [(first, [(5, 11), (6, 12)])]
    assert runs_after_releases([], {}) == []
