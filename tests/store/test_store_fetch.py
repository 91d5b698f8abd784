"""TieredStore on CPU: bit-identical experts to the plain pack fetcher at any budget, budgets
kept, corrupt records and read errors caught by name while the store keeps serving, requests
that join reads in flight, and pre-warming from a hot set."""

from __future__ import annotations

import errno
import random
import threading

import pytest
import torch

from flashpack.errors import FlashpackError
from flashpack.layout.pack import Pack
from flashpack.runtime.experts import ExpertFetcher, ahead_rows
from flashpack.runtime.pack_source import PackExperts
from flashpack.runtime.store import build_store
from flashpack.runtime.store.config import StoreConfig
from flashpack.runtime.store.hotset import hot_set_from_trace, save_hot_set
from flashpack.runtime.store.trace import Trace


def store_devices() -> list[str]:
    """cpu always (CI); cuda too where there is one (the GPU machine)."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _geometry(pack: Pack) -> tuple[int, int, list[int], int]:
    cfg = pack.manifest.config
    layers = sorted({r.layer for r in pack.manifest.expert_records()})
    return pack.manifest.document["experts"]["record_stride"], cfg.num_experts, layers, cfg.num_experts_per_tok


def _store(pack, device_slots, host_slots, device="cpu", **settings):
    """A store of `device_slots` and `host_slots` slots; `settings`: more of its StoreConfig."""
    stride = pack.manifest.document["experts"]["record_stride"]
    config = StoreConfig(vram_budget=device_slots * stride, ram_budget=host_slots * stride, **settings)
    return build_store(pack, config, device, device_reserved=0, poison=True)


def _assert_same(got, want):
    assert sorted(got) == sorted(want)
    for expert in want:
        for projection in ("gate", "up", "down"):
            a, b = getattr(got[expert], projection), getattr(want[expert], projection)
            assert a.dtype == b.dtype and torch.equal(a.cpu(), b), (expert, projection)


def _random_requests(rng, layers, experts, top_k, count):
    for _ in range(count):
        size = rng.choice([1, top_k, top_k, top_k, top_k + 3, experts])  # decode, and prefill unions
        yield rng.choice(layers), sorted(rng.sample(range(experts), min(size, experts)))


class CachedReference:
    """PackExperts, each expert decoded once per session (the tests compare thousands)."""

    def __init__(self, pack: Pack):
        self.inner, self.cache = PackExperts(pack), {}

    def fetch(self, layer, experts):
        missing = [e for e in experts if (layer, e) not in self.cache]
        for expert, weights in self.inner.fetch(layer, missing).items():
            self.cache[layer, expert] = weights
        return {e: self.cache[layer, e] for e in experts}


@pytest.fixture(scope="module")
def reference(store_pack) -> CachedReference:
    return CachedReference(Pack.open(store_pack))


@pytest.mark.parametrize("device", store_devices())
@pytest.mark.parametrize("policy, device_share, host_slots", [
    ("lfu", 1.0, 1), ("lru", 1.25, 3), ("lfu-decay", 2.0, 64), ("lfu", None, None),
])
def test_bit_identical_to_pack_experts_at_any_budget(store_pack, reference, policy, device_share, host_slots, device):
    pack = Pack.open(store_pack)
    stride, experts, layers, top_k = _geometry(pack)
    if device_share is None:  # unlimited: everything fits
        store = build_store(pack, StoreConfig(policy=policy), device, device_reserved=0, poison=True)
    else:  # down to top_k slots for the whole pool (a little more than one token's experts of a layer)
        store = _store(pack, int(top_k * device_share) + (device_share > 1), host_slots, policy=policy,
                       device=device)
    assert isinstance(store, ExpertFetcher)
    rng = random.Random(hash((policy, device_share)) & 0xFFFF)
    with store:
        for layer, wanted in _random_requests(rng, layers, experts, top_k, 80):
            fetched = store.fetch(layer, wanted)
            assert all(w.gate.device.type == device for w in fetched.values())
            _assert_same(fetched, reference.fetch(layer, wanted))
            store.check_budgets()
        if device_share is not None:
            assert store.device_pool.nbytes <= store.plan.device_slots * stride
            assert store.host_pool.nbytes == host_slots * stride
        stats = store.stats.to_dict()
        assert stats["requests"] == stats["tiers"]["device"]["hits"] + stats["tiers"]["host"]["hits"] + \
            stats["tiers"]["disk"]["reads"] + stats["joined"]
        assert stats["tiers"]["disk"]["bytes_to_host"] == stats["tiers"]["disk"]["reads"] * stride


def test_budget_is_kept_after_dense_and_work_buffers(store_pack):
    pack = Pack.open(store_pack)
    stride, _, _, top_k = _geometry(pack)
    from flashpack.runtime.store.build import resident_device_bytes

    reserved = resident_device_bytes(pack.manifest, "float32")
    budget = reserved + 10 * stride + stride // 2
    with build_store(pack, StoreConfig(vram_budget=budget, ram_budget="64KiB")) as store:
        assert store.plan.device_slots == 10 and store.plan.host_slots == 16
        assert store.device_pool.nbytes + reserved <= budget
    with pytest.raises(FlashpackError, match=r"--vram-budget .* too small: the minimum is .*"
                                             rf"{top_k} expert slots \(top_k of one layer\)"):
        build_store(pack, StoreConfig(vram_budget=reserved + (top_k - 1) * stride, ram_budget="1GiB"))
    with pytest.raises(FlashpackError, match="--ram-budget"):
        build_store(pack, StoreConfig(vram_budget="1GiB", ram_budget="0"))


def test_staging_rows_come_out_of_the_device_budget(store_pack):
    from flashpack.runtime.store.budget import STAGING_ROW_SETS

    pack = Pack.open(store_pack)
    stride, _, _, top_k = _geometry(pack)
    staging = STAGING_ROW_SETS * top_k
    config = StoreConfig(vram_budget=(10 + staging) * stride, ram_budget="64KiB")
    with build_store(pack, config, device_reserved=0, staging=True) as store:
        assert (store.plan.device_slots, store.plan.staging_slots) == (10, staging)
        assert store.device_pool.nbytes == store.plan.device_pool_bytes == (10 + staging) * stride
        records = store.host_records
        assert records.first_staging_slot == 10 and records.staging.shape[0] == staging
        for layer in (0, 1):  # even and odd layers stage ahead into the two sets after the late rows
            assert records.first_slot(ahead_rows(layer)) == 10 + (1 + layer) * top_k
            assert records.rows(ahead_rows(layer)).data_ptr() == records.staging[(1 + layer) * top_k].data_ptr()
    with pytest.raises(FlashpackError, match=rf"{top_k} expert slots \(top_k of one layer\) and {staging} staging"):
        build_store(pack, StoreConfig(vram_budget=(top_k + staging - 1) * stride), device_reserved=0, staging=True)


def test_a_store_for_some_layers_gives_the_others_no_room(store_pack):
    """A store for some layers takes those layers' records alone, and `'*'` pre-warms those: an
    engine that runs no MTP head serves the decoder layers, one that drafts with it their and the
    head's."""
    from flashpack.runtime.engine.build import load_engine
    from flashpack.runtime.engine.config import EngineConfig

    pack = Pack.open(store_pack)
    cfg = pack.manifest.config
    decoder = list(range(cfg.num_hidden_layers))
    assert max(r.layer for r in pack.manifest.expert_records()) >= cfg.num_hidden_layers  # the pack has MTP experts
    # no budget: room for the layers' records
    with build_store(pack, StoreConfig(hot_set="*"), layers=decoder) as store:
        assert store.layers == decoder
        assert store.plan.device_slots == store.plan.host_slots == len(decoder) * cfg.num_experts
        assert store.stats.total().prewarmed_device == len(decoder) * cfg.num_experts
    budgets = StoreConfig(vram_budget="1GiB", ram_budget="1GiB")
    for speculate, layers in (("lookup", decoder), ("auto", [*decoder, cfg.num_hidden_layers])):
        engine = load_engine(store_pack, EngineConfig(store=budgets, speculate=speculate))
        try:
            assert engine.store.layers == layers
        finally:
            engine.store.close()


def test_auto_drafts_with_the_mtp_head_only_where_the_budgets_hold_it(store_pack):
    """`--speculate auto` through a store adds the MTP head's experts only where every record of the
    decoder layers and the head fits; a RAM budget that holds the decoder layers' alone leaves the
    head out (it would push decoder records to disk); `mtp` takes it regardless."""
    from flashpack.runtime.engine.build import load_engine
    from flashpack.runtime.engine.config import EngineConfig
    from flashpack.runtime.store.build import store_plan

    pack = Pack.open(store_pack)
    cfg = pack.manifest.config
    decoder = list(range(cfg.num_hidden_layers))
    stride = pack.manifest.document["experts"]["record_stride"]
    device_least = store_plan(pack, StoreConfig(vram_budget="1GiB"), "cpu", layers=decoder).device_reserved
    tight = StoreConfig(vram_budget=device_least + 2 * cfg.num_experts_per_tok * stride,
                        ram_budget=len(decoder) * cfg.num_experts * stride + stride)
    for speculate, layers in (("auto", decoder), ("mtp", [*decoder, cfg.num_hidden_layers])):
        engine = load_engine(store_pack, EngineConfig(store=tight, speculate=speculate))
        try:
            assert engine.store.layers == layers
            assert [d.name for d in engine.generator.speculation.drafters] == (["lookup"] if speculate == "auto" else ["mtp"])
        finally:
            engine.store.close()


def test_missing_or_resized_pack_file_is_refused_at_open(pack_copy):
    layer_file = next((pack_copy / "experts").iterdir())
    with open(layer_file, "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(FlashpackError, match=rf"{layer_file.name} is .* bytes, the manifest says"):
        build_store(pack_copy)
    layer_file.unlink()
    with pytest.raises(FlashpackError, match=f"{layer_file.name} is missing"):
        build_store(pack_copy)


def test_corrupt_record_fails_that_request_by_name_and_the_store_keeps_serving(pack_copy, corrupt_record):
    corrupt_record(pack_copy, 2, 5)
    pack = Pack.open(pack_copy)
    reference = PackExperts(Pack.open(pack_copy), verify_records=False)
    with _store(pack, 8, 4) as store:
        with pytest.raises(FlashpackError, match="corrupt expert record: layer 2 expert 5"):
            store.fetch(2, [1, 5, 9])
        _assert_same(store.fetch(2, [1, 9]), reference.fetch(2, [1, 9]))  # the rest still serves
        _assert_same(store.fetch(3, [5]), reference.fetch(3, [5]))
        with pytest.raises(FlashpackError, match="layer 2 expert 5"):  # never cached as good
            store.fetch(2, [5])
        assert (2, 5) not in store.placement.device_slots and (2, 5) not in store.placement.host_slots
        assert store.stats.layer(2).failed == 2
        store.check_budgets()
    with _store(Pack.open(pack_copy), 8, 4, verify_records=False) as store:  # --no-verify-records
        _assert_same(store.fetch(2, [5]), reference.fetch(2, [5]))


def test_read_error_fails_that_request_and_others_go_on(store_pack, reference, monkeypatch):
    pack = Pack.open(store_pack)
    bad = pack.record_entry(1, 3)
    with _store(pack, 8, 4) as store:
        original = store.transfers.reader.read

        def flaky(file, offset, buffers, need):
            if file == bad.file and offset == bad.offset:
                raise OSError(errno.EIO, "Input/output error")
            return original(file, offset, buffers, need)

        monkeypatch.setattr(store.transfers.reader, "read", flaky)
        with pytest.raises(FlashpackError, match=rf"reading layer 1 expert 3 from {bad.file} .*Input/output error"):
            store.fetch(1, [0, 3, 7])
        _assert_same(store.fetch(1, [0, 7]), reference.fetch(1, [0, 7]))
        monkeypatch.setattr(store.transfers.reader, "read", original)
        _assert_same(store.fetch(1, [3]), reference.fetch(1, [3]))  # the next attempt reads again
        store.check_budgets()


def test_async_requests_hits_are_ready_and_duplicates_join(store_pack, reference):
    pack = Pack.open(store_pack)
    with _store(pack, 16, 8, rebalance=False) as store:
        store.fetch(0, [1, 2])
        gate = threading.Event()
        original = store.transfers.reader.read
        store.transfers.reader.read = lambda *a, **k: (gate.wait(10), original(*a, **k))[1]
        first = store.request(0, [1, 2, 3])
        assert [h.source for h in first] == ["device", "device", "disk"]
        assert first[0].ready() and first[1].ready() and not first[2].ready()
        second = store.request(0, [3])  # asked again while its read is in flight: joins it
        assert second[0].source == "joined" and second[0].slot == first[2].slot
        assert store.stats.layer(0).disk_reads == 3  # 1, 2 earlier and 3 once
        gate.set()
        _assert_same(store.wait(first), reference.fetch(0, [1, 2, 3]))
        _assert_same(store.wait(second), reference.fetch(0, [3]))
        assert store.stats.layer(0).joined == 1
        with pytest.raises(FlashpackError, match="cannot hold"):
            store.request(0, list(range(20)))  # more than the pool: fetch() streams, request() refuses
        assert all(e.pins == 0 for e in store.placement.device_slots.entries.values())


@pytest.mark.parametrize("device", store_devices())
def test_concurrent_fetches_from_threads(store_pack, reference, device):
    pack = Pack.open(store_pack)
    stride, experts, layers, top_k = _geometry(pack)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for layer, wanted in _random_requests(rng, layers, experts, top_k, 25):
                _assert_same(store.fetch(layer, wanted), reference.fetch(layer, wanted))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    with _store(pack, 3 * top_k, 6, device=device) as store:
        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors[0]
        store.check_budgets()


def test_prewarm_from_hot_set_shows_in_stats(pack_copy):
    pack = Pack.open(pack_copy)
    stride, experts, layers, top_k = _geometry(pack)
    rng = random.Random(0)
    fetches = [(layer, sorted(rng.sample(range(6), top_k))) for _ in range(12) for layer in layers]
    save_hot_set(pack_copy, "chat", hot_set_from_trace(Trace.from_fetches(fetches, experts, top_k)))
    slots = 6 * len(layers)
    budget = dict(vram_budget=slots * stride, ram_budget=(slots + 20) * stride)
    with build_store(Pack.open(pack_copy), StoreConfig(hot_set="chat", **budget), device_reserved=0) as store:
        stats = store.stats.to_dict()
        assert stats["tiers"]["device"]["prewarmed"] == slots
        assert stats["tiers"]["host"]["prewarmed"] == slots  # the hot set has 6 experts a layer
        assert stats["requests"] == 0 and stats["tiers"]["disk"]["bytes_to_host"] == 0
        assert stats["tiers"]["disk"]["prewarm_bytes_to_host"] == slots * stride
        for layer, wanted in fetches:
            store.fetch(layer, wanted)
        assert store.stats.total().device_hits == len(fetches) * top_k  # every request a hit
        store.check_budgets()
    with build_store(Pack.open(pack_copy), StoreConfig(**budget), device_reserved=0) as cold:
        for layer, wanted in fetches:
            cold.fetch(layer, wanted)
        assert cold.stats.total().device_hits < len(fetches) * top_k
    with pytest.raises(FlashpackError, match="no hot set 'code' .*chat"):
        build_store(Pack.open(pack_copy), StoreConfig(hot_set="code"))


def test_prewarm_every_record_leaves_no_disk_reads(pack_copy):
    """hot_set "*": every record goes to the device pool or the host cache at start, so requests
    afterwards never read the disk; with a host cache one record short, one record stays out."""
    pack = Pack.open(pack_copy)
    stride, experts, layers, top_k = _geometry(pack)
    records = experts * len(layers)
    slots = 4 * len(layers)
    budget = dict(vram_budget=slots * stride, ram_budget=records * stride)
    with build_store(pack, StoreConfig(hot_set="*", **budget), device_reserved=0) as store:
        stats = store.stats.to_dict()
        assert stats["tiers"]["host"]["prewarmed"] == records and stats["tiers"]["device"]["prewarmed"] == slots
        rng = random.Random(1)
        for _ in range(10):
            for layer in layers:
                store.fetch(layer, sorted(rng.sample(range(experts), top_k)))
        assert store.stats.total().disk_reads == 0 and store.stats.total().host_hits > 0
    with build_store(pack, StoreConfig(hot_set="*", **{**budget, "ram_budget": (records - 1) * stride}),
                     device_reserved=0) as short:
        assert short.stats.to_dict()["tiers"]["host"]["prewarmed"] == records - 1


def test_fetch_while_a_prefetch_holds_the_layer_share(store_pack, reference):
    """A prefetch (request) pins a layer's whole share; a fetch of that layer for more experts
    still completes, taking other slots, and the prefetched handles stay valid."""
    pack = Pack.open(store_pack)
    stride, experts, layers, top_k = _geometry(pack)
    with _store(pack, top_k * len(layers), 4, rebalance=False) as store:
        prefetched = store.request(layers[1], list(range(top_k)))
        wanted = list(range(top_k, top_k + 6))
        _assert_same(store.fetch(layers[1], wanted), reference.fetch(layers[1], wanted))
        _assert_same(store.wait(prefetched), reference.fetch(layers[1], list(range(top_k))))
        store.check_budgets()


def test_decode_with_read_ahead_reads_for_the_layer_after_next_and_computes_the_same(tiny_pack):
    """Read-ahead (`EngineConfig.read_ahead`, on by default; bench --no-read-ahead) changes what the
    store reads from disk while the engine decodes through it, not what the model computes: the same
    logits, rel 1e-5 (FP32 on the CPU; experts may land in other chunks), and read-aheads issued only
    with it on."""
    from flashpack.runtime.engine.build import load_engine
    from flashpack.runtime.engine.config import EngineConfig
    from flashpack.runtime.store.build import resident_device_bytes

    manifest = Pack.open(tiny_pack).manifest
    stride, cfg = manifest.document["experts"]["record_stride"], manifest.config
    layers = cfg.num_hidden_layers
    vram = resident_device_bytes(manifest, "float32") + layers * cfg.num_experts_per_tok * stride
    prompt = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(0))
    logits, issued = {}, {}
    assert EngineConfig().read_ahead
    for read_ahead in (False, True):
        store = StoreConfig(vram_budget=vram, ram_budget=layers * cfg.num_experts_per_tok * stride)
        engine = load_engine(tiny_pack, EngineConfig(dtype="float32", read_ahead=read_ahead, store=store))
        try:
            far = [engine.model.experts.predict_far(layer, torch.ones(1, cfg.hidden_size)) is not None
                   for layer in range(layers - 2)]
            assert far == [read_ahead] * (layers - 2)
            state = engine.step.new_state()
            steps = [engine.step.forward(prompt, state).logits[-1:]]
            for _ in range(6):
                steps.append(engine.step.forward(torch.tensor([int(steps[-1].argmax())]), state).logits)
            logits[read_ahead] = torch.cat(steps)
            issued[read_ahead] = engine.store.stats.total().read_ahead_issued
        finally:
            engine.store.close()
    assert issued[False] == 0 and issued[True] > 0
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
