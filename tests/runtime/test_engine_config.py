"""The engine's one typed configuration: EngineConfig and StoreConfig refuse bad values, `--set`
reaches every field by name, every run/serve/bench/profile flag reaches the config the engine is
built from (on a CPU as on a GPU, with or without budgets), and two engines with different
configs live in one process, each computing as its own says."""

from __future__ import annotations

import dataclasses

import click
import pytest
import torch
from click.testing import CliRunner

from flashpack.cli import main
from flashpack.errors import FlashpackError
from flashpack.runtime.bench.presets import PRESETS, preset_settings
from flashpack.runtime.engine import build
from flashpack.runtime.engine.build import load_engine, uses_store
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.expert_paths import StoreExperts
from flashpack.runtime.engine.settings import setting_keys, with_settings
from flashpack.runtime.model.routed_experts import DequantisedExperts
from flashpack.runtime.store.budget import parse_budget
from flashpack.runtime.store.config import StoreConfig


@pytest.mark.parametrize("make, message", [
    (lambda: EngineConfig(dtype="float64"), "unknown dtype 'float64'"),
    (lambda: EngineConfig(experts="disk"), "unknown expert source 'disk'"),
    (lambda: EngineConfig(layers_per_graph=0), "layers_per_graph must be a whole number of at least 1"),
    (lambda: EngineConfig(staging_programs=True), "staging_programs must be a whole number"),
    (lambda: EngineConfig(store="24GiB"), "must be a StoreConfig"),
    (lambda: StoreConfig(policy="fifo"), "unknown eviction policy 'fifo'"),
    (lambda: StoreConfig(read_pieces=0), "read_pieces must be a whole number of at least 1"),
    (lambda: StoreConfig(vram_budget="lots"), "cannot read vram_budget 'lots'"),
    (lambda: StoreConfig(ram_budget=-1), "ram_budget must not be negative"),
])
def test_a_bad_value_is_refused_with_its_name(make, message):
    with pytest.raises(FlashpackError, match=message):
        make()


@pytest.mark.parametrize("assignment, message", [
    ("bogus=1", "unknown setting 'bogus'"),
    ("store.bogus=1", "unknown setting 'store.bogus'"),
    ("store=1", "unknown setting 'store'"),
    ("cuda_graphs=maybe", "cuda_graphs takes true or false"),
    ("layers_per_graph=two", "layers_per_graph takes a whole number"),
    ("store.read_pieces=0", "read_pieces must be a whole number of at least 1"),
    ("read_ahead", "--set takes KEY=VALUE"),
])
def test_a_bad_setting_is_refused(assignment, message):
    with pytest.raises(FlashpackError, match=message):
        with_settings(EngineConfig(), [assignment])


def test_every_key_can_be_set_and_reads_back():
    """Each key, set to a value other than its default, lands in that field and only there."""
    changed = {bool: lambda value: not value, int: lambda value: value + 1}
    for key, default in setting_keys().items():
        if isinstance(default, (bool, int)):
            value = changed[type(default)](default)
        else:
            value = {"device": "cuda", "dtype": "bfloat16", "experts": "store", "store.policy": "lru",
                     "speculate": "lookup", "prompt_cache_ram": "2GiB", "prompt_cache_dir": "/tmp/states", "prompt_cache_disk": "1GiB", "decoded_experts_ram": "64MiB",
                     "checkpoints_in_one_step": True, "restore_as_it_arrives": True, "delta_rule_recurrent_max_tokens": 16,
                     "store.vram_budget": "8GiB", "store.ram_budget": "32GiB", "store.hot_set": "chat"}[key]
        text = str(value).lower() if isinstance(value, bool) else str(value)
        config = with_settings(EngineConfig(), [f"{key}={text}"])
        owner, name = (config.store, key[6:]) if key.startswith("store.") else (config, key)
        assert getattr(owner, name) == value, key
        others = {**dataclasses.asdict(config), "store": {**dataclasses.asdict(config.store), name: None}}
        defaults = {**dataclasses.asdict(EngineConfig()), "store": {**dataclasses.asdict(StoreConfig()), name: None}}
        if not key.startswith("store."):
            others[name] = defaults[name] = None
        assert others == defaults, key


def test_presets_are_valid_settings_that_change_what_they_name():
    for name, settings in PRESETS.items():
        config = with_settings(EngineConfig(), preset_settings([name]))
        assert config != EngineConfig(), name
    with pytest.raises(FlashpackError, match="unknown bench preset 'fast'"):
        preset_settings(["fast"])


def _captured(monkeypatch, arguments: list[str]) -> EngineConfig:
    """The EngineConfig a command builds its engine from (the command stops there)."""
    seen = {}

    def recording(pack, config, **kwargs):
        seen["config"] = config
        raise click.exceptions.Exit(0)

    import flashpack.runtime.bench.bench as bench_module  # first, or it would bind the recording for good

    monkeypatch.setattr(build, "load_engine", recording)
    monkeypatch.setattr(bench_module, "load_engine", recording)
    result = CliRunner().invoke(main, arguments)
    assert result.exit_code == 0, result.output
    return seen["config"]


STORE_FLAGS = ["--vram-budget", "8GiB", "--ram-budget", "32GiB", "--policy", "lru", "--hot-set", "chat",
               "--no-direct-io", "--no-verify-records", "--set", "store.read_pieces=2", "--set", "staging_programs=16"]


def _store_flags_arrived(config: EngineConfig) -> None:
    store = config.store
    budgets = [parse_budget(budget) for budget in (store.vram_budget, store.ram_budget)]
    assert budgets == [8 << 30, 32 << 30] and (store.policy, store.hot_set) == ("lru", "chat")
    assert not store.direct_io and not store.verify_records and store.read_pieces == 2
    assert config.staging_programs == 16 and config.dtype == "float32"


def test_run_flags_reach_the_config(tiny_pack, monkeypatch):
    config = _captured(monkeypatch, ["run", str(tiny_pack), "hi", "--dtype", "float32", "--cuda-graphs", "off",
                                     *STORE_FLAGS])
    _store_flags_arrived(config)
    assert config.cuda_graphs is False and config.device == "cpu" and config.speculate == "auto"
    assert _captured(monkeypatch, ["run", str(tiny_pack), "hi", "--speculate", "off"]).speculate == "off"


def test_serve_flags_reach_the_config(tiny_pack, monkeypatch):
    pytest.importorskip("fastapi", reason="serve needs the server's extra")
    config = _captured(monkeypatch, ["serve", str(tiny_pack), "--dtype", "float32", "--port", "8765", *STORE_FLAGS,
                                     "--speculate", "lookup"])
    _store_flags_arrived(config)
    assert config.speculate == "lookup"


def test_bench_flags_and_presets_reach_the_config(tiny_pack, monkeypatch):
    config = _captured(monkeypatch, [
        "bench", str(tiny_pack), "--dtype", "float32", *STORE_FLAGS, "--no-cuda-graphs", "--no-compile",
        "--graph-layers", "2", "--no-prefetch", "--no-read-ahead", "--promote", "--no-fused-mix",
        "--preset", "copy-thread", "--quiet"])
    _store_flags_arrived(config)
    assert (config.cuda_graphs, config.compile_layers, config.layers_per_graph, config.prefetch, config.read_ahead,
            config.fused_mix) == (False, False, 2, False, False, False)
    assert config.store.promote and not config.store.copy_on_requesting_thread and config.experts == "store"
    assert config.speculate == "off"  # the bench times plain steps unless asked
    assert _captured(monkeypatch, ["bench", str(tiny_pack), "--speculate", "lookup", "--quiet"]).speculate == "lookup"


def test_prompt_cache_flags_reach_the_config(tiny_pack, monkeypatch, tmp_path):
    pytest.importorskip("fastapi", reason="serve needs the server's extra")
    monkeypatch.setenv("FLASHPACK_CACHE_DIR", str(tmp_path / "cache"))
    served = _captured(monkeypatch, ["serve", str(tiny_pack), "--port", "8766"])
    assert served.prompt_cache_dir == str(tmp_path / "cache" / "prompt-states") and served.prompt_cache_ram is None
    kept_in_ram = _captured(monkeypatch, ["serve", str(tiny_pack), "--port", "8766", "--no-prompt-cache-dir",
                                          "--prompt-cache-ram", "2GiB"])
    assert kept_in_ram.prompt_cache_dir is None and kept_in_ram.prompt_cache_ram == "2GiB"
    run = _captured(monkeypatch, ["run", str(tiny_pack), "hi"])
    assert run.prompt_cache_dir is None and run.prompt_cache_ram == "0"  # one shot: nothing to reuse
    run = _captured(monkeypatch, ["run", str(tiny_pack), "hi", "--prompt-cache-dir", str(tmp_path / "states"),
                                  "--prompt-cache-disk", "1GiB"])
    assert (run.prompt_cache_dir, run.prompt_cache_disk) == (str(tmp_path / "states"), "1GiB")


def test_profile_and_trace_flags_reach_the_config(tiny_pack, monkeypatch, tmp_path):
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt": "hi"}\n')
    for command in (["profile", str(tiny_pack), "--name", "x"], ["trace", "record", str(tiny_pack), "--out",
                                                                 str(tmp_path / "t.json")]):
        config = _captured(monkeypatch, [*command, "--workload", str(workload), "--dtype", "float32",
                                         "--vram-budget", "8GiB", "--ram-budget", "32GiB"])
        assert (config.store.vram_budget, config.store.ram_budget, config.dtype) == ("8GiB", "32GiB", "float32")


def test_a_store_setting_on_a_cpu_routes_experts_through_the_store():
    """On a GPU experts always come through the store; on a CPU any store setting given (not only a
    budget) does too, so --policy or --no-direct-io is never silently ignored."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert uses_store(EngineConfig(), cuda) and not uses_store(EngineConfig(), cpu)
    assert not uses_store(EngineConfig(store=StoreConfig(verify_records=False)), cpu)
    for store in (StoreConfig(policy="lru"), StoreConfig(direct_io=False), StoreConfig(ram_budget="1GiB")):
        assert uses_store(EngineConfig(store=store), cpu), store
    assert not uses_store(EngineConfig(experts="pack"), cuda)
    assert uses_store(EngineConfig(experts="store"), cpu)


def test_two_engines_with_different_configs_in_one_process(tiny_pack):
    """One engine decodes straight from the pack, the other through an LRU store with whole-record
    reads and no read-ahead: each keeps its own settings, and both compute the same logits."""
    plain = load_engine(tiny_pack, EngineConfig(dtype="float32"))
    stored = load_engine(tiny_pack, EngineConfig(dtype="float32", read_ahead=False, store=StoreConfig(
        policy="lru", read_pieces=1, vram_budget="64MiB", ram_budget="64MiB")))
    try:
        assert isinstance(plain.model.experts, DequantisedExperts) and plain.store is None
        assert isinstance(stored.model.experts, StoreExperts) and stored.config.store.policy == "lru"
        assert not stored.model.experts.prediction.read_ahead and plain.config.read_ahead
        prompt = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(0))
        logits = [engine.step.forward(prompt, engine.step.new_state(), last_only=True).logits
                  for engine in (plain, stored)]
        torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
    finally:
        stored.close()


def test_kernel_choices_reach_every_projection_and_mix(tiny_pack):
    """The token counts that pick the BF16 and the FP8 projections' kernels reach every projection,
    (the hyper-connections' up projections among them), and the one that picks DeltaNet's recurrence
    every DeltaNet layer."""
    from flashpack.runtime.model.linear import StackedLinear

    from flashpack.runtime.model.deltanet import GatedDeltaNet

    from flashpack.runtime.model.hyper_connection import GatedResidual

    engine = load_engine(tiny_pack, EngineConfig(dtype="float32", dense_matvec_max_tokens=2, dense_tile_max_tokens=7,
                                                 fp8_matvec_max_tokens=5, delta_rule_recurrent_max_tokens=16))
    stacks = [m for m in engine.model.modules() if isinstance(m, StackedLinear)]
    assert stacks and all((m.matvec_max_tokens, m.tile_max_tokens, m.fp8_matvec_max_tokens) == (2, 7, 5) for m in stacks)
    assert all(m.mix_up in stacks for m in engine.model.modules() if isinstance(m, GatedResidual))
    deltanets = [m for m in engine.model.modules() if isinstance(m, GatedDeltaNet)]
    assert deltanets and all(m.recurrent_max_tokens == 16 for m in deltanets)
    with pytest.raises(FlashpackError, match="fp8_matvec_max_tokens must be a whole number of at least 0"):
        EngineConfig(fp8_matvec_max_tokens=-1)


def test_delta_rule_recurrence_defaults_to_short_steps_on_a_gpu_and_one_token_on_a_cpu(tiny_pack):
    """Unset, DeltaNet steps of up to 128 tokens take the recurrence where fla's kernels run the rule
    (its recurrent kernel: one launch) and only one token where the plain rule does (its loop loses
    to the chunked form); a value set is taken either way, 0 is refused, and a CPU engine's layers
    get the plain rule's default."""
    from flashpack.runtime.engine.config import GPU_RECURRENT_MAX_TOKENS
    from flashpack.runtime.model.delta_rule import fla_kernels
    from flashpack.runtime.model.deltanet import GatedDeltaNet

    assert EngineConfig().delta_rule_recurrent_max_tokens is None
    assert (EngineConfig().recurrent_max_tokens(True), EngineConfig().recurrent_max_tokens(False)) == (
        GPU_RECURRENT_MAX_TOKENS, 1) == (128, 1)
    assert EngineConfig(delta_rule_recurrent_max_tokens=16).recurrent_max_tokens(True) == 16
    assert EngineConfig(delta_rule_recurrent_max_tokens=16).recurrent_max_tokens(False) == 16
    assert not fla_kernels("cpu")
    with pytest.raises(FlashpackError, match="delta_rule_recurrent_max_tokens must be a whole number of at least 1"):
        EngineConfig(delta_rule_recurrent_max_tokens=0)
    engine = load_engine(tiny_pack, EngineConfig(dtype="float32"))
    deltanets = [m for m in engine.model.modules() if isinstance(m, GatedDeltaNet)]
    assert deltanets and all(m.recurrent_max_tokens == 1 for m in deltanets)
