"""Open a pack as a ready engine: model, tokenizer and generator, on the requested device."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from flashpack.errors import FlashpackError
from flashpack.layout.pack import Pack
from flashpack.runtime.experts import ExpertFetcher, ResidentSlots
from flashpack.runtime.generate import Generator
from flashpack.runtime.model.decode_graphs import LAYERS_PER_GRAPH
from flashpack.runtime.model.model import Qwen4ExpModel
from flashpack.runtime.model.qsa_attention import QUERY_CHUNK
from flashpack.runtime.pack_source import PackExperts, PackWeights
from flashpack.runtime.tokenizer import PackTokenizer

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


@dataclass(frozen=True)
class StoreOptions:
    """The tiered store's settings; with none given the engine decodes experts straight from the pack."""

    vram_budget: str | None = None  # e.g. "24GiB"; None: room for every record
    ram_budget: str | None = None
    policy: str = "lfu"
    hot_set: str | None = None  # a profile in the manifest to pre-warm from
    direct_io: bool = True
    prefetch: bool = True  # decode: load the next layer's predicted experts into the gaps
    # decode: also read the disk records the layer after next is predicted to pick into the host cache
    # (8/32 on the H200, benched side by side: 6.54 and 6.28 tok/s by kind with it against 5.98 and
    # 6.07 without in runs 31 and 33; by t_layers 5.46 against 5.18, and 5.05 against 5.19)
    read_ahead: bool = True
    # decode: move a staged expert that outranks its victim into a device slot. Off: on the H200 the
    # copies and their bookkeeping cost more than the hits they bought (bench/results/README.md)
    promote: bool = False


@dataclass
class LoadedEngine:
    pack: Pack
    model: Qwen4ExpModel
    tokenizer: PackTokenizer
    generator: Generator
    store: object | None = None  # runtime.store.TieredStore (or ResidentExperts) when tiers are in use

    def warm_up(self) -> dict[str, float]:
        """Compile, tune and capture at start what the first requests need (`warm_up_plan`,
        Generator.warm_up). Returns the seconds each part took; on a CPU, where nothing is
        compiled or tuned per shape, it does nothing."""
        if self.model.device.type != "cuda":
            return {}
        lengths, depth = self.warm_up_plan()
        return self.generator.warm_up(lengths, prompt_depth=depth)

    def warm_up_plan(self) -> tuple[list[int], int]:
        """(prompt lengths, layers they run through): a prompt of each shape class a first request
        may bring (short, a few hundred tokens, past the QSA indexer's budget, several query chunks
        past it), through one layer of each kind and the PLE layers."""
        cfg = self.model.config
        limit = (self.generator.max_context or cfg.max_position_embeddings) - 8
        past_budget = cfg.indexer_budget + 2 * cfg.indexer_compress_ratio + 1
        candidates = [16, 300, past_budget, max(2 * past_budget, 4 * QUERY_CHUNK) + 37]
        lengths = sorted({min(length, limit) for length in candidates})
        first_attention = next((i for i in range(cfg.num_hidden_layers) if not cfg.is_linear(i)), 0)
        depth = max(first_attention + 1, *cfg.ple_layer_ids, 1)
        return lengths, min(depth, cfg.num_hidden_layers)

    def stats(self) -> dict | None:
        self.model.settle()
        return self.store.stats.to_dict() if self.store is not None else None


# Decoding from CUDA graphs pays for building them once a run's new tokens times its decoder layers
# reach this. On the H200 machine (real widths, bench/startup.sh) a layer decodes in ~4.5 ms eagerly
# and ~0.4 ms from graphs, and building a step's graphs took ~8 s with the compile caches an earlier
# process left: ~1,900 layer-tokens to break even. So at 48 layers graphs pay from ~43 tokens, and a
# 4-layer benchmark pack's short runs decode eagerly. (With empty caches building takes ~35 s; the
# caches are kept between processes, runtime/compile_cache.py.)
GRAPHS_MIN_LAYER_TOKENS = 2048


def decode_graphs_pay(max_tokens: int, layers: int) -> bool:
    """Whether a run of at most `max_tokens` new tokens through `layers` decoder layers should decode
    from CUDA graphs."""
    return max_tokens * layers >= GRAPHS_MIN_LAYER_TOKENS


def parse_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is BF16 on a GPU and FP32 on a CPU, where BF16 matmuls are emulated and slower."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[name]
    except KeyError:
        raise FlashpackError(f"unknown dtype {name!r}: use one of {', '.join(sorted(DTYPES))}") from None


def parse_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FlashpackError("--device cuda was asked for but no CUDA device is available")
    return device


def load_engine(
    pack_path: Path | str,
    device: str = "cpu",
    dtype: str = "auto",
    fetcher: ExpertFetcher | None = None,
    verify_records: bool = True,
    store: StoreOptions | None = None,
    cuda_graphs: bool = True,
    compile_layers: bool = True,
    layers_per_graph: int = LAYERS_PER_GRAPH,
    fused_mix: bool = True,
    decode_tokens: int | None = None,
) -> LoadedEngine:
    """`cuda_graphs`: on a GPU, replay the fixed-shape work of decode steps from CUDA graphs
    (runtime/model/decode_graphs.py), `layers_per_graph` layers a graph; off, every kernel is
    issued from Python (for comparison). `compile_layers`: fuse the graphs' small kernels with
    torch.compile first (the first decode steps of a process compile; later processes reuse
    Inductor's disk cache). `fused_mix`: on a GPU, one-token hyper-connection mixes as two Triton
    kernels each (Qwen4ExpModel.fuse_hyper_connections); off, the module's own code (for comparison).
    `decode_tokens`: the most tokens this engine will decode, where known (a one-shot run): CUDA
    graphs are then built only if that many pay for building them (`decode_graphs_pay`)."""
    pack = Pack.open(pack_path)
    if decode_tokens is not None:
        cuda_graphs = cuda_graphs and decode_graphs_pay(decode_tokens, pack.manifest.config.num_hidden_layers)
    torch_device = parse_device(device)
    torch_dtype = parse_dtype(dtype, torch_device)
    tiered = None
    if fetcher is None and store is None and torch_device.type == "cuda":
        store = StoreOptions()  # a GPU reads experts through the store: resident when they all fit
    if fetcher is None and store is not None:
        from flashpack.runtime.store import build_store
        from flashpack.runtime.store.config import StoreConfig

        tiered = build_store(
            pack, StoreConfig(vram_budget=store.vram_budget, ram_budget=store.ram_budget, policy=store.policy,
                              hot_set=store.hot_set, direct_io=store.direct_io, verify_records=verify_records,
                              promote=store.promote),
            torch_device, dtype=torch_dtype,
            # staging rows whether or not graphs run: a budget gives the same store either way
            allow_resident=torch_device.type == "cuda", staging=torch_device.type == "cuda",
            layers=list(range(pack.manifest.config.num_hidden_layers)),  # the engine runs no MTP head
        )
    model = Qwen4ExpModel(
        PackWeights(pack),
        fetcher or tiered or PackExperts(pack, verify_records=verify_records),
        dtype=torch_dtype,
        device=torch_device,
    )
    if tiered is not None and not isinstance(tiered, ResidentSlots):
        model.prefetch_next_layer(store.prefetch, read_ahead=store.read_ahead)
    if fused_mix and torch_device.type == "cuda":
        model.fuse_hyper_connections()
    if cuda_graphs and tiered is not None and torch_device.type == "cuda":
        count_replay = tiered.count_replay if isinstance(tiered, ResidentSlots) else None
        model.capture_decode_graphs(count_replay, compile_layers=compile_layers, layers_per_graph=layers_per_graph)
    tokenizer = PackTokenizer.load(pack.root)
    return LoadedEngine(pack, model, tokenizer, Generator(model, tokenizer), tiered)
