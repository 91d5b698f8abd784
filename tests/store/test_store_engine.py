"""The store behind the real engine: greedy output identical to the all-in-memory run at any
budget; `profile` writes a hot set (and `--reorder` moves records) that pre-warming uses;
`trace record` / `trace replay` report policies against Belady."""

from __future__ import annotations

import json

import pytest
import torch

from flashpack.errors import FlashpackError
from flashpack.layout.manifest import Manifest
from flashpack.layout.pack import Pack
from flashpack.runtime.engine.generate import Generator
from flashpack.runtime.engine.build import engine_model, load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.model import Qwen4ExpModel
from flashpack.runtime.pack_source import PackExperts, PackWeights
from flashpack.runtime.sampling import SamplingParams
from flashpack.runtime.engine.profile import profile_pack, record_trace
from flashpack.runtime.store import build_store, replay_trace
from flashpack.runtime.store.config import StoreConfig
from flashpack.runtime.store.trace import Trace

PROMPTS = ["The cache keeps hot experts close.", "Belady evicts what is needed furthest in the future."]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class Greedy:
    """One pack's tokenizer and prompts; a fresh engine per fetcher (the fetcher is bound at build)."""

    def __init__(self, pack_root):
        self.engine = load_engine(pack_root, EngineConfig(dtype="float32"))
        self.pack = self.engine.pack
        self.prompts = [self.engine.tokenizer.encode(text) for text in PROMPTS]

    def run(self, fetcher, max_tokens=8, device="cpu") -> list[list[int]]:
        model = engine_model(PackWeights(self.pack), fetcher, EngineConfig(dtype="float32"), torch.float32,
                             torch.device(device))
        generator = Generator(model, self.engine.tokenizer)
        return [generator.generate(ids, SamplingParams(max_tokens=max_tokens)).token_ids for ids in self.prompts]


@pytest.fixture(scope="module")
def greedy(store_pack) -> Greedy:
    return Greedy(store_pack)


@pytest.fixture(scope="module")
def all_in_memory(greedy) -> dict[str, list[list[int]]]:
    return {device: greedy.run(PackExperts(greedy.pack), device=device) for device in DEVICES}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("device_slots, host_slots, policy", [
    ("top_k+1", 1, "lfu"), ("top_k+2 per layer", 8, "lru"), (None, None, "lfu-decay"),
])
def test_greedy_output_identical_to_all_in_memory(greedy, all_in_memory, device_slots, host_slots, policy, device):
    pack = greedy.pack
    stride = pack.manifest.document["experts"]["record_stride"]
    top_k = pack.manifest.config.num_experts_per_tok
    layers = len({r.layer for r in pack.manifest.expert_records()})
    slots = {"top_k+1": top_k + 1, "top_k+2 per layer": (top_k + 2) * layers, None: None}[device_slots]
    config = StoreConfig(vram_budget=slots and slots * stride, ram_budget=host_slots and host_slots * stride,
                         policy=policy)
    with build_store(pack, config, device, device_reserved=0, poison=True) as store:
        assert greedy.run(store, device=device) == all_in_memory[device]
        store.check_budgets()
        if slots is not None:
            assert store.device_pool.nbytes == slots * stride
            assert store.stats.total().disk_reads > 0


def test_a_streamed_prompt_gives_the_one_chunk_logits_bit_for_bit(greedy, monkeypatch):
    """A prompt whose experts the store streams in chunks fills each (token, pick) row once and sums
    them as the one-call path does: its logits equal a whole-budget store's exactly, however the
    chunks fell."""
    from flashpack.runtime.engine import expert_paths

    pack = greedy.pack
    stride = pack.manifest.document["experts"]["record_stride"]
    top_k = pack.manifest.config.num_experts_per_tok
    prompt = torch.tensor(greedy.prompts[1])
    calls, pairs = [], expert_paths.moe_expert_pairs
    monkeypatch.setattr(expert_paths, "moe_expert_pairs", lambda *args: (calls.append(1), pairs(*args))[1])
    logits = []
    for slots in (top_k + 1, None):
        calls.clear()
        with build_store(pack, StoreConfig(vram_budget=slots and slots * stride), device_reserved=0,
                         poison=True) as store:
            model = engine_model(PackWeights(pack), store, EngineConfig(dtype="float32"), torch.float32,
                                 torch.device("cpu"))
            logits.append(model(prompt, model.new_state()).logits)
        assert (len(calls) > len(pack.manifest.config.layer_types)) == (slots is not None)  # chunks, or one call
    assert torch.equal(logits[0], logits[1])


def test_a_short_prompts_prefetch_of_the_next_layer_changes_no_logit(greedy):
    """`prompt_prefetch_max_tokens`: a prompt step through a small store prefetches each next
    layer's guessed experts (counted as prefetches issued), and its logits are the same bits as
    without. Control: off, a prompt prefetches nothing."""
    pack = greedy.pack
    stride = pack.manifest.document["experts"]["record_stride"]
    layers = len(pack.manifest.config.layer_types)
    slots = (pack.manifest.config.num_experts_per_tok + 2) * layers
    prompt = torch.tensor(greedy.prompts[1])
    found = {}
    for tokens in (64, 0):
        config = EngineConfig(dtype="float32", prompt_prefetch_max_tokens=tokens)
        with build_store(pack, StoreConfig(vram_budget=slots * stride, rebalance=False), device_reserved=0,
                         poison=True) as store:
            model = engine_model(PackWeights(pack), store, config, torch.float32, torch.device("cpu"))
            logits = model(prompt, model.new_state()).logits
            found[tokens] = (logits, store.stats.total().prefetch_issued)
    assert found[64][1] > 0 and found[0][1] == 0
    assert torch.equal(found[64][0], found[0][0])


def _workload(path, prompts=PROMPTS, max_tokens=4):
    path.write_text("\n".join(json.dumps({"prompt": p, "max_tokens": max_tokens}) for p in prompts) + "\n")
    return path


def test_profile_writes_a_hot_set_and_reorder_keeps_every_record(pack_copy, tmp_path):
    before = {(r.layer, r.expert): r for r in Pack.open(pack_copy).manifest.expert_records()}
    original = PackExperts(Pack.open(pack_copy))
    reference = {key: original.fetch(key[0], [key[1]])[key[1]] for key in list(before)[:40]}
    profile = profile_pack(pack_copy, _workload(tmp_path / "w.jsonl"), "chat", reorder=True,
                           trace_out=tmp_path / "t.json")
    manifest = Manifest.load(pack_copy)  # schema-valid after the rewrite
    stored = manifest.hot_sets["chat"]
    assert stored["reordered"] and stored["unit"] == "fetches" and stored["workload"]["prompts"] == len(PROMPTS)
    assert stored["workload"]["generated_tokens"] > 0 and len(stored["workload"]["xxh64"]) == 16
    stride = manifest.document["experts"]["record_stride"]
    after = {(r.layer, r.expert): r for r in manifest.expert_records()}
    for entry in stored["layers"]:
        counts = entry["counts"]
        assert counts == sorted(counts, reverse=True) and sum(counts) >= entry["requests"]
        offsets = [after[entry["layer"], e].offset for e in entry["experts"]]
        assert offsets == [rank * stride for rank in range(len(offsets))]  # hot experts first, contiguous
    assert {k: v.xxh64 for k, v in after.items()} == {k: v.xxh64 for k, v in before.items()}
    assert sum(profile["moved"].values()) > 0
    pack = Pack.open(pack_copy)  # sizes still match the files list
    reordered = PackExperts(pack)
    for key, weights in reference.items():
        assert torch.equal(reordered.fetch(key[0], [key[1]])[key[1]].up, weights.up)
    # pre-warming the reordered pack reads each layer's hot set in one run
    with build_store(pack, StoreConfig(hot_set="chat"), device_reserved=0) as store:
        total = sum(len(entry["experts"]) for entry in stored["layers"])
        assert store.stats.to_dict()["tiers"]["host"]["prewarmed"] == total
        assert store.stats.read_calls == sum(1 for entry in stored["layers"] if entry["experts"])
    with pytest.raises(FlashpackError, match="hot set name"):
        profile_pack(pack_copy, tmp_path / "w.jsonl", "bad name")


def test_profile_refuses_bad_workloads(pack_copy, tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(FlashpackError, match="bad.jsonl:2: not JSON"):
        profile_pack(pack_copy, tmp_path / "bad.jsonl", "x")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(FlashpackError, match="has no requests"):
        profile_pack(pack_copy, tmp_path / "empty.jsonl", "x")


def test_trace_record_and_replay(store_pack, tmp_path):
    trace = record_trace(store_pack, _workload(tmp_path / "w.jsonl"), tmp_path / "trace.json")
    loaded = Trace.load(tmp_path / "trace.json")
    assert loaded.to_dict() == trace.to_dict()
    assert loaded.steps[0].tokens > 1 and all(s.tokens == 1 for s in loaded.steps[1:4])  # max_tokens 4
    assert {layer for layer, _ in loaded.fetches()} <= set(loaded.layers)
    report = replay_trace(tmp_path / "trace.json", [loaded.top_k, 2 * loaded.top_k], ["lru", "lfu"])
    for capacity in (loaded.top_k, 2 * loaded.top_k):
        best = report.row(capacity, "belady").total
        assert report.row(capacity, "lru").total >= best and report.row(capacity, "lfu").total >= best
    assert report.to_dict()["rows"][0]["bytes_per_token"] > 0
