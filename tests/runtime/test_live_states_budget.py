"""The live prompt states' default host memory (build.prompt_cache_bytes): on a GPU through a store it
takes the RAM budget's spare beyond the decoder layers' expert records, at least one 32k-token state
and at most a tenth of the budget, so the states never push records to the disk where the budget
holds them all and a floor's worth of spare. The engine says how it split the budgets in a line."""

from __future__ import annotations

import dataclasses

import torch

from flashpack.layout.pack import Pack
from flashpack.runtime.engine.build import LIVE_STATES_LEAST_TOKENS, load_engine, prompt_cache_bytes
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.state import SequenceState, state_bytes
from flashpack.runtime.store.budget import format_bytes, plan_store, served_records
from flashpack.runtime.store.config import StoreConfig
from flashpack.runtime.store.resident import ResidentExperts

GPU = torch.device("cuda")  # only its type is read: no GPU is needed


def records_bytes(pack: Pack) -> tuple[int, int, int]:
    """(decoder records, their stride, their bytes)."""
    records = len(served_records(pack, list(range(pack.manifest.config.num_hidden_layers))))
    stride = pack.manifest.document["experts"]["record_stride"]
    return records, stride, records * stride


def default_states(pack: Pack, ram: int, device=GPU, through_store: bool = True,
                   least_tokens: int = LIVE_STATES_LEAST_TOKENS) -> int:
    config = EngineConfig(store=StoreConfig(ram_budget=str(ram)))
    return prompt_cache_bytes(pack, config, device, torch.bfloat16, through_store, least_tokens)


def host_holds_every_record(pack: Pack, ram: int, states: int) -> bool:
    records, stride, _ = records_bytes(pack)
    plan = plan_store(record_stride=stride, total_records=records, top_k=pack.manifest.config.num_experts_per_tok,
                      vram_budget=None, ram_budget=ram, host_reserved=states)
    return plan.host_slots >= records


def test_state_bytes_holds_a_prompts_saved_state_and_grows_by_the_keys(tiny_pack):
    engine = load_engine(tiny_pack, EngineConfig(prompt_cache_ram=0, speculate="off"))
    try:
        cfg = engine.model_config
        for tokens in (256, 300):  # a whole number of the caches' 64-position growth steps, and not
            state = engine.step.new_state()
            engine.step.forward(torch.arange(tokens) % 500 + 5, state, last_only=True)
            assert state.snapshot().nbytes() <= state_bytes(cfg, torch.float32, tokens)  # what a live entry holds
    finally:
        engine.close()
    # by hand: each attention layer (the MTP head's too) keeps keys and values of every head, an indexer
    # key, and a pooled block key every `ratio` positions, for each position
    attention = sum(not cfg.is_linear(layer) for layer in range(cfg.num_hidden_layers)) + cfg.mtp_num_hidden_layers
    per_position = 2 * cfg.num_key_value_heads * cfg.head_dim + cfg.indexer_head_dim
    per_block = cfg.indexer_head_dim
    grown = attention * (256 * per_position + 256 // cfg.indexer_compress_ratio * per_block) * 2  # bf16
    assert state_bytes(cfg, torch.bfloat16, 512) - state_bytes(cfg, torch.bfloat16, 256) == grown


def test_a_large_budget_gives_the_states_a_tenth(tiny_pack):
    pack = Pack.open(tiny_pack)
    _, _, held = records_bytes(pack)
    ram = 4 * held + (1 << 30)
    assert default_states(pack, ram) == ram // 10
    assert host_holds_every_record(pack, ram, ram // 10)


def test_the_states_take_only_the_spare_where_the_records_fill_the_budget(tiny_pack):
    pack = Pack.open(tiny_pack)
    _, stride, held = records_bytes(pack)
    # the tiny model's records are small beside a long state of its own: a floor of 64 tokens here
    least = state_bytes(pack.manifest.config, torch.bfloat16, 64)
    spare = least + stride  # more than the floor, less than a tenth of the budget
    ram = held + spare
    assert least < spare < ram // 10
    states = default_states(pack, ram, least_tokens=64)
    assert states == spare
    assert host_holds_every_record(pack, ram, states)
    # control: a tenth, as the states once took, pushes records out of the RAM budget
    assert not host_holds_every_record(pack, ram, ram // 10)


def test_the_states_keep_their_floor_where_the_budget_has_no_spare(tiny_pack):
    pack = Pack.open(tiny_pack)
    _, _, held = records_bytes(pack)
    least = state_bytes(pack.manifest.config, torch.bfloat16, 64)  # as above: under a tenth of these budgets
    assert least < held // 10
    assert default_states(pack, held, least_tokens=64) == least  # the records fill it: the floor, not a tenth
    assert default_states(pack, held + least // 2, least_tokens=64) == least
    assert default_states(pack, held // 2, least_tokens=64) == held // 2 // 10  # the records do not all fit: a tenth caps it
    assert default_states(pack, 100 << 30) == 8 << 30  # a budget far over the records: the 8 GiB cap


def test_a_cpu_an_engine_without_a_store_and_a_given_value(tiny_pack):
    pack = Pack.open(tiny_pack)
    _, _, held = records_bytes(pack)
    assert default_states(pack, held, device=torch.device("cpu")) == 1 << 30
    assert default_states(pack, held, through_store=False) == 1 << 30
    config = EngineConfig(prompt_cache_ram="3MiB", store=StoreConfig(ram_budget=str(held)))
    assert prompt_cache_bytes(pack, config, GPU, torch.bfloat16, True) == 3 << 20


def test_the_engine_says_how_it_split_the_budgets(tiny_pack):
    pack = Pack.open(tiny_pack)
    _, stride, held = records_bytes(pack)
    config = EngineConfig(prompt_cache_ram="3MiB", store=StoreConfig(vram_budget="3MiB", ram_budget=str(held // 2)))
    engine = load_engine(tiny_pack, config)
    try:
        line = engine.memory()
        served = len(served_records(pack, engine.store.layers))  # the MTP head's layer too, where it drafts
        device = engine.store.plan.device_slots
    finally:
        engine.close()
    assert device < served  # the budgets hold some records only: the line's counts are the plan's
    assert line == (f"experts: {served:,} records of {format_bytes(stride)}, {device:,} of them on the device, "
                    f"{(held // 2) // stride:,} in host memory; live prompt states: 3.00 MiB")
    engine = load_engine(tiny_pack, EngineConfig(prompt_cache_ram=0))
    try:
        assert engine.memory() == "experts: decoded from the pack as they are used; prompt reuse off"
        resident = dataclasses.replace(engine, store=ResidentExperts(pack, "cpu", progress=False))  # a GPU's, unbounded
        assert resident.memory() == "experts: every record resident on the device; prompt reuse off"
    finally:
        engine.close()
