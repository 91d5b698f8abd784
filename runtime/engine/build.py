"""Open a pack as a ready Engine on the device an EngineConfig names.

    load_engine(pack, EngineConfig(...)) -> Engine

Where routed experts come from (EngineConfig.experts): on a GPU through the tiered store, which
holds every record resident in a device bank when the budget allows; on a CPU decoded from the
pack, or through the store when any store setting was given. The step replays one-token decode
from CUDA graphs on a GPU with a store, unless a run that says how many tokens it decodes would
not make up for building them (`decode_graphs_pay`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from flashpack.errors import FlashpackError
from flashpack.layout.checksums import MANIFEST_HASH_KEY
from flashpack.layout.pack import Pack
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.checked_graphs import CheckedGraphs
from flashpack.runtime.engine.decode_graphs import DecodeGraphs
from flashpack.runtime.engine.engine import Engine
from flashpack.runtime.engine.expert_paths import BankExperts, Prediction, StoreExperts, routed_experts
from flashpack.runtime.engine.generate import Generator
from flashpack.runtime.engine.pinned_arena import PinnedArena
from flashpack.runtime.engine.prefix_cache import PrefixCache
from flashpack.runtime.engine.drafters import LookupDrafter, MTPDrafter
from flashpack.runtime.engine.speculative import SpeculativeDecoder
from flashpack.runtime.engine.step import Step
from flashpack.runtime.experts import ExpertFetcher
from flashpack.runtime.model.delta_rule import fla_kernels
from flashpack.runtime.model.model import Qwen4ExpModel
from flashpack.runtime.model.mtp import MTPHead
from flashpack.runtime.pack_source import PackExperts, PackWeights
from flashpack.runtime.state import state_bytes
from flashpack.runtime.store.budget import parse_budget, served_records
from flashpack.runtime.store.config import StoreConfig
from flashpack.runtime.tokenizer import PackTokenizer
from flashpack.runtime.weights import WeightSource

# The live prompt states' default takes at least room for one state of this many tokens (about
# 1 GB at the real model's dimensions), even where the RAM budget has little to spare beyond the
# experts' records (EngineConfig.prompt_cache_ram)
LIVE_STATES_LEAST_TOKENS = 32_768

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def decode_graphs_pay(max_tokens: int, layers: int, min_layer_tokens: int = EngineConfig.graphs_min_layer_tokens
                      ) -> bool:
    """Whether a run of at most `max_tokens` new tokens through `layers` decoder layers should decode
    from CUDA graphs (EngineConfig.graphs_min_layer_tokens says why)."""
    return max_tokens * layers >= min_layer_tokens


def parse_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is BF16 on a GPU and FP32 on a CPU, where BF16 matmuls are emulated and slower."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise FlashpackError(f"unknown dtype {name!r}: use one of {', '.join(sorted(DTYPES))}") from None


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise FlashpackError(f"unknown device {name!r}: use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FlashpackError("--device cuda was asked for but no CUDA device is available")
    return device


def uses_store(config: EngineConfig, device: torch.device) -> bool:
    """Whether routed experts come through the tiered store (EngineConfig.experts)."""
    if config.experts != "auto":
        return config.experts == "store"
    given = replace(config.store, verify_records=StoreConfig.verify_records) != StoreConfig()
    return device.type == "cuda" or given


def load_engine(
    pack_path: Path | str, config: EngineConfig = EngineConfig(), *, fetcher: ExpertFetcher | None = None,
    decode_tokens: int | None = None,
) -> Engine:
    """`fetcher`: routed experts from it instead (tests' in-memory experts). `decode_tokens`: the
    most tokens this engine will decode, where known (a one-shot run): CUDA graphs are then built
    only if that many pay for building them."""
    pack = Pack.open(pack_path)
    cfg = pack.manifest.config
    device = parse_device(config.device)
    dtype = parse_dtype(config.dtype, device)
    store = None
    through_store = fetcher is None and uses_store(config, device)
    states_ram = prompt_cache_bytes(pack, config, device, dtype, through_store)
    host_reserved = states_ram if config.prompt_cache_ram is None and device.type == "cuda" else 0
    mtp = runs_mtp(pack, config, device, dtype, host_reserved if through_store else None)
    if fetcher is not None:
        source = fetcher
    elif through_store:
        from flashpack.runtime.store import build_store

        store = source = build_store(
            pack, config.store, device, dtype=dtype,
            # staging rows whether or not graphs run: a budget gives the same store either way
            allow_resident=device.type == "cuda", staging=device.type == "cuda",
            # the MTP head's experts are one more layer of the store's, where it runs
            layers=list(range(cfg.num_hidden_layers + (cfg.mtp_num_hidden_layers if mtp else 0))),
            host_reserved=host_reserved,
        )
    else:
        source = PackExperts(pack, verify_records=config.store.verify_records,
                             cache_bytes=parse_budget(config.decoded_experts_ram, "decoded_experts_ram"))
    model = engine_model(PackWeights(pack), source, config, dtype, device)
    graphs = checked = None
    graphs_pay = decode_tokens is None or decode_graphs_pay(decode_tokens, cfg.num_hidden_layers,
                                                            config.graphs_min_layer_tokens)
    slots = isinstance(model.experts, (BankExperts, StoreExperts))
    if config.cuda_graphs and graphs_pay and device.type == "cuda" and slots:
        graphs = engine_graphs(model, config)
        if config.checked_graphs:
            checked = CheckedGraphs(model.layers, model.experts, compiled=config.compile_checked,
                                    compile_mixers=config.compile_checked_mixers)
    step = Step(model, graphs, checked,
                prompt_graphs_max_tokens=config.prompt_graphs_max_tokens if checked is not None else 0)
    tokenizer = PackTokenizer.load(pack.root)
    speculation = _speculation(step, model, PackWeights(pack), config, mtp)
    one_step = config.checkpoints_in_one_step
    if one_step is None:  # EngineConfig.checkpoints_in_one_step says why
        one_step = device.type == "cuda" or isinstance(model.experts, StoreExperts)
    generator = Generator(step, tokenizer, prefix_cache=_prefix_cache(pack, config, device, states_ram),
                          speculation=speculation, checkpoints_in_one_step=one_step)
    return Engine(pack, config, model, step, tokenizer, generator, store)


def has_mtp(pack: Pack) -> bool:
    """Whether the pack carries the MTP head (its dense weights and its layers' expert records)."""
    cfg = pack.manifest.config
    if cfg.mtp_num_hidden_layers < 1 or "mtp.fc_hidden.weight" not in pack.manifest.dense_tensors():
        return False
    return any(record.layer == cfg.num_hidden_layers for record in pack.manifest.expert_records())


def runs_mtp(pack: Pack, config: EngineConfig, device: torch.device, dtype: torch.dtype,
             host_reserved: int | None) -> bool:
    """Whether the engine drafts with the MTP head. `mtp` asks for it (a pack without one is an
    error): its experts are then one more layer of the store, competing for the budgets. `auto`
    takes it where the pack has one and, through a store (`host_reserved` not None), only where the
    budgets hold every record of the decoder layers and the head together: a head that pushed
    decoder records to disk would cost every token a disk read (at 24/64 the 48 layers' records
    alone fill the RAM budget)."""
    if config.speculate not in ("mtp", "auto"):
        return False
    found = has_mtp(pack)
    if config.speculate == "mtp" and not found:
        raise FlashpackError("--speculate mtp: the pack has no MTP head (convert a checkpoint that has one)")
    if config.speculate == "mtp" or not found or host_reserved is None:
        return found
    from flashpack.runtime.store.build import holds_every_record, store_plan

    cfg = pack.manifest.config
    layers = list(range(cfg.num_hidden_layers + cfg.mtp_num_hidden_layers))
    plan = store_plan(pack, config.store, device, dtype=dtype, host_reserved=host_reserved,
                      staging=device.type == "cuda", layers=layers)
    return holds_every_record(plan, len(served_records(pack, layers)))


def _speculation(step: Step, model: Qwen4ExpModel, weights: WeightSource, config: EngineConfig, mtp: bool
                 ) -> SpeculativeDecoder | None:
    """The drafters `config.speculate` names: lookup first (cheap, and right where the context
    repeats), then the MTP head."""
    drafters = [LookupDrafter()] if config.speculate in ("lookup", "auto") else []
    if mtp:
        drafters.append(MTPDrafter(MTPHead(model, weights)))
    return SpeculativeDecoder(step, drafters, config.draft_tokens) if drafters else None


def _prefix_cache(pack: Pack, config: EngineConfig, device: torch.device, states_ram: int) -> PrefixCache | None:
    if states_ram == 0:
        return None
    pinned = None
    if device.type == "cuda":  # the live states' host memory, pinned now: never while a request runs
        pinned = PinnedArena.pinned(states_ram)
        states_ram = pinned.capacity
    stored = None
    if config.prompt_cache_dir is not None:
        from flashpack.runtime.engine.stored_states import StoredStates

        fingerprint = pack.manifest.document[MANIFEST_HASH_KEY]
        # a folder per pack: one pack's states never evict or collide with another's
        stored = StoredStates(Path(config.prompt_cache_dir).expanduser() / fingerprint,
                              parse_budget(config.prompt_cache_disk), fingerprint)
    arriving = config.restore_as_it_arrives
    return PrefixCache(states_ram, stored, pinned, arriving=device.type == "cuda" if arriving is None else arriving)


def prompt_cache_bytes(pack: Pack, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                       through_store: bool, least_tokens: int = LIVE_STATES_LEAST_TOKENS) -> int:
    """The live prompt states' host memory (EngineConfig.prompt_cache_ram says how it is chosen);
    by default at least a state of `least_tokens` tokens."""
    given = parse_budget(config.prompt_cache_ram, "--prompt-cache-ram")
    if given is not None:
        return given
    if device.type != "cuda" or not through_store:
        return 1 << 30
    from flashpack.runtime.store.build import machine_free_bytes

    ram = parse_budget(config.store.ram_budget, "--ram-budget")
    ram = machine_free_bytes(device)[1] if ram is None else ram
    cfg = pack.manifest.config
    records = len(served_records(pack, list(range(cfg.num_hidden_layers))))
    spare = ram - records * pack.manifest.document["experts"]["record_stride"]
    least = state_bytes(cfg, dtype, least_tokens)
    return min(ram // 10, 8 << 30, max(spare, least))


def engine_model(weights: WeightSource, source, config: EngineConfig, dtype: torch.dtype, device: torch.device
                 ) -> Qwen4ExpModel:
    """The model over `source`'s routed experts (expert_paths.routed_experts), as `config` runs it:
    through a store, decode predicts each next layer's experts with that layer's router."""
    prediction = Prediction(config.prefetch, config.read_ahead, config.prefetch_during_loads,
                            config.prompt_prefetch_max_tokens)
    routed = routed_experts(source, weights.config, dtype, device, prediction)
    model = Qwen4ExpModel(weights, routed, dtype=dtype, device=device,
                          fused_mix=config.fused_mix and device.type == "cuda",
                          dense_matvec_max_tokens=config.dense_matvec_max_tokens,
                          dense_tile_max_tokens=config.dense_tile_max_tokens,
                          fp8_matvec_max_tokens=config.fp8_matvec_max_tokens,
                          delta_rule_recurrent_max_tokens=config.recurrent_max_tokens(fla_kernels(device)),
                          compile_pieces=config.compile_prompt_pieces,
                          fused_norms=config.fused_norms and device.type == "cuda")
    if isinstance(routed, StoreExperts):
        routed.predict_with({layer.layer: layer.moe.route for layer in model.layers})
    return model


def engine_graphs(model: Qwen4ExpModel, config: EngineConfig, make_call=None) -> DecodeGraphs:
    """CUDA graphs for `model`'s one-token decode steps, as `config` cuts them (`make_call`:
    DecodeGraphs'; the CPU tests run the pieces plainly)."""
    routed = model.experts
    return DecodeGraphs(
        model.layers, routed, routed.source.count_replay if isinstance(routed, BankExperts) else None,
        make_call=make_call, compile_layers=config.compile_layers, layers_per_graph=config.layers_per_graph,
        combo_kernels=config.combo_kernels, staging_programs=config.staging_programs,
        staged_beside_experts=config.staged_beside_experts,
    )
