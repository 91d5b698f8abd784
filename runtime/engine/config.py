"""EngineConfig: every setting of how the engine runs a step, with its default and why.

The CLI's flags build one (`run`, `serve`, `bench`, `verify`); `bench --set KEY=VALUE` changes any
field by name (runtime/engine/settings.py), `store.KEY=VALUE` the store's. Each engine holds its
own, so two engines with different settings can live in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashpack.errors import FlashpackError
from flashpack.runtime.kernels.dispatch import DENSE_MATVEC_MAX_TOKENS, DENSE_TILE_MAX_TOKENS, FP8_MATVEC_MAX_TOKENS
from flashpack.runtime.store.budget import parse_budget
from flashpack.runtime.store.config import StoreConfig

DTYPES = ("auto", "bfloat16", "bf16", "float32", "fp32")
EXPERT_SOURCES = ("auto", "store", "pack")


SPECULATE = ("auto", "mtp", "lookup", "off")
MAX_DRAFT_TOKENS = 16  # a checked step's positions stay a decode's few (DeltaNet runs them one by one)
# DeltaNet steps of up to this many tokens by fla's recurrent kernel (delta_rule_recurrent_max_tokens).
GPU_RECURRENT_MAX_TOKENS = 128


@dataclass(frozen=True)
class EngineConfig:
    # "cpu", "cuda" or "cuda:N".
    device: str = "cpu"
    # The engine's dtype: "auto" is BF16 on a GPU and FP32 on a CPU, where BF16 matmuls are emulated.
    dtype: str = "auto"
    # Where routed experts come from: "store" through the tiered store (budgets, policy, prefetch;
    # every expert resident on the device when the budget holds them all), "pack" decoded from the
    # pack on each use (the plain path). "auto": the store on a GPU, and on a CPU when any store
    # setting differs from its default, else the pack.
    experts: str = "auto"
    # On the pack path, the dequantised experts kept in RAM (least recently used dropped first), e.g.
    # "1GiB"; 0 decodes every expert on every use. Decoding costs far more than using an expert
    # (runtime/pack_source.py), and a checked step pays it for the union of its positions' experts.
    # The demo model's experts take 28 MB in all.
    decoded_experts_ram: str | int = "1GiB"
    # On a GPU, replay decode steps' fixed-shape work from CUDA graphs (runtime/engine/decode_graphs.py).
    cuda_graphs: bool = True
    # Speculative decoding's checked steps (a token and its drafts) from CUDA graphs too, captured for
    # each step length (runtime/engine/checked_graphs.py); through a tiered store each layer's graph
    # stops at its router and the routed experts come through the store between the graphs.
    checked_graphs: bool = True
    # Fuse the checked steps' pieces without a per-token loop with torch.compile (one compile for
    # every step length).
    compile_checked: bool = True
    # Compile the checked steps' sequence mixers too (their per-token loops unrolled: one compile for
    # each step length), as decode graphs compile a layer's front: eagerly, the mixers' many small
    # kernels are what a checked step spends most on beside its projections.
    compile_checked_mixers: bool = True
    # A run that knows how many tokens it decodes builds graphs only when its new tokens times its
    # decoder layers reach this: a layer decodes in ~4.5 ms eagerly and ~0.4 ms from graphs on an
    # H200, and building a step's graphs takes ~8 s with warm compile caches.
    graphs_min_layer_tokens: int = 2048
    # Fuse each graph's small kernels with torch.compile before capturing it.
    compile_layers: bool = True
    # TorchInductor's combo kernels: independent small kernels of a piece launched as one (a decode
    # step's kernels are mostly launch and tail, not work).
    combo_kernels: bool = True
    # Steps the model runs eagerly (prompts; decode without graphs) take the plain code between each
    # layer's kernels of its own (hyper-connection mixes and combines, router and shared expert,
    # DeltaNet's projections, conv and output norm, attention's projections and gated output)
    # compiled by torch.compile, one compile for every layer and step length, instead of
    # several dozen small kernels a layer, each launched by the host: a short prompt's layer (a
    # follow-up's new tokens) is bound by its launches, not by its GPU work. Off: on an H100 a live
    # hit's 100 new tokens took 0.097 s with them against 0.070 s without (the compiled calls' guards
    # and wrappers cost more than the launches they save), and on a CPU a compiled call's own
    # overhead loses to the eager operations it replaces (PERFORMANCE.md, *Prompt-state reuse*).
    compile_prompt_pieces: bool = False
    # Prompts of 2 to this many new tokens (a follow-up's question and markers after a restored
    # state) run as checked steps from CUDA graphs (`checked_graphs`), in chunks of 16, 8, 4, 3 and
    # 2 tokens, all warmed up at start (and at the end of a request whose state's buffers moved),
    # where every expert is resident: a chunk's layer is one replay, where an eager layer of ~100
    # tokens is several hundred launches from the host. A chunk
    # of T tokens does more GPU work than a T-token share of one step (attention token by token, the
    # decode kernels' few rows), which eats most of what the host saves: at real dimensions a live
    # hit's 100 tokens gained ~10 %, for 7-70 s more warm-up at every start. 0: off, a bench option
    # (`--set prompt_graphs_max_tokens=128`; PERFORMANCE.md, *Prompt-state reuse*).
    prompt_graphs_max_tokens: int = 0
    # Decoder layers per CUDA graph: one a layer keeps the GPU on layer L while the host launches L + 1.
    layers_per_graph: int = 1
    # One-token hyper-connection mixes as two Triton kernels each (GPU only) instead of the module's code.
    fused_mix: bool = True
    # The RMS norms of steps run eagerly (prompts, a follow-up's new tokens; not compiled pieces,
    # which fuse them anyway) as one Triton kernel each (GPU only) instead of the module's seven
    # operations: ~36 of the host's operations a layer of a short prompt. Off: on an H100 a live
    # hit took 2-4 % less with it, under the 5 % a change must win by (`--set fused_norms=true`;
    # PERFORMANCE.md, *Prompt-state reuse*).
    fused_norms: bool = False
    # BF16 projections of up to this many tokens take the matvec kernel, more cuBLAS; beyond one token
    # only matrices of under 2,048 rows (the router's stack, the hyper-connections' down projections),
    # where cuBLAS's few-row kernels are slow (runtime/kernels/dispatch.py says where it was measured).
    dense_matvec_max_tokens: int = DENSE_MATVEC_MAX_TOKENS
    # BF16 projections of more tokens than that, up to this many, take the tile kernel's few-token
    # tiles (their columns split) on the same short matrices, where cuBLAS's few-row kernels read them
    # far below the memory's rate; 0 leaves them to cuBLAS (runtime/kernels/dispatch.py says where it
    # was measured).
    dense_tile_max_tokens: int = DENSE_TILE_MAX_TOKENS
    # FP8 projections (`convert --dense-fp8`) of up to this many tokens take the matvec kernel, more
    # the tile kernel on tensor cores, whose few-token tiles take about as long for 2 as for 16 tokens;
    # beyond one token only matrices of under 4,096 rows (DeltaNet's output projection, the shared
    # expert's), where the matvec still wins (runtime/kernels/dispatch.py says where it was measured).
    fp8_matvec_max_tokens: int = FP8_MATVEC_MAX_TOKENS
    # DeltaNet steps of up to this many tokens take the recurrence, longer ones the chunked rule.
    # None: 128 on a GPU with fla-core, where its recurrent kernel is one launch (each token's arithmetic as
    # decode does it) and its chunked rule several kernels and ~2 ms of the host's time a call, paid
    # in every DeltaNet layer of a short step: a follow-up's ~100 new tokens after a restored state
    # took 15 % less with it (PERFORMANCE.md, *Prompt-state reuse*); 1 where the plain rule runs (a
    # CPU, a GPU without fla-core): its recurrence is a loop of a Python step a token and the
    # chunked form wins.
    delta_rule_recurrent_max_tokens: int | None = None
    # Decode through a store: the next layer's router, applied to this layer's input, names experts
    # to load ahead.
    prefetch: bool = True
    # Start those prefetches while this layer's own loads land (True) or once they have (False).
    prefetch_during_loads: bool = True
    # A prompt step of up to this many tokens through a store (a follow-up's new tokens) prefetches
    # the next layer's predicted experts too, once its own loads are queued, so the link works while
    # each layer's mixer runs and its ids come back. 0: off, a bench option
    # (`--set prompt_prefetch_max_tokens=256`): at 24/64 about half its guesses went unused, the
    # follow-up's own reads from disk rose by half, and a live hit took longer with it
    # (PERFORMANCE.md, *Prompt-state reuse*).
    prompt_prefetch_max_tokens: int = 0
    # Also read from disk into the host cache the records the layer after next is predicted to pick
    # (a disk read takes about as long as a layer).
    read_ahead: bool = True
    # Programs of the kernel that stages the next layer's host records on a side stream: 16 already
    # reach 0.92 of the pinned copy rate on an H200, and the rest of the SMs stay with the layer.
    staging_programs: int = 32
    # Of the next layer's predicted host records, how many a graph's last layer stages beside its own
    # experts (the rest cross at the next graph's start): a graph joins what it forks, so more hold
    # its end back; none leaves the link idle through the experts.
    staged_beside_experts: int = 1
    # Prompt-state reuse (runtime/engine/prefix_cache.py). Live entries: host memory for saved
    # sequence states, e.g. "4GiB"; 0 turns reuse off. None: on a GPU through a store, the RAM
    # budget's spare beyond every decoder layer's expert record, at least one 32k-token state (about
    # 1 GB at the real model's dimensions) and at most a tenth of the budget and 8 GiB, taken from
    # it. A record pushed out of RAM is read from the disk by every prompt and every token that
    # picks it, where a state saves one prefill of a long prompt: at 24/64, where the records fill
    # the RAM budget, a tenth would put ~9 % of the records on the disk, the floor under 1 %. On a CPU
    # 1 GiB. On a GPU it is pinned when the engine is built (runtime/engine/pinned_arena.py).
    prompt_cache_ram: str | int | None = None
    # Stored entries: a folder that keeps saved states across restarts (zstd-compressed), None: none.
    prompt_cache_dir: str | None = None
    # The stored entries' disk budget, least recently used removed first.
    prompt_cache_disk: str | int = "20GiB"
    # A stored hit restored layer by layer as its bytes land, beside the prefill of the new tokens
    # (runtime/engine/arriving_state.py), or read whole first. None: as it arrives on a GPU, whose
    # host mostly launches kernels while the read's threads run on other cores; whole first on a
    # CPU, where decompression and the prefill would share the same few cores, and the read the
    # overlap hides is less than the prefill loses to them.
    restore_as_it_arrives: bool | None = None
    # A prompt's checkpoints taken in one step as the layers pass them (Qwen4ExpModel.forward's
    # marks), or a step a segment. None: one step on a GPU, where each segment's step costs its
    # ~150 kernel launches a layer, and through a tiered store, where it fetches every layer's
    # experts again; a step a segment on a CPU, where a restore then continues bit for bit what the
    # first request computed (a mark's state is rounded as the whole step sums, not as its segment).
    checkpoints_in_one_step: bool | None = None
    # Speculative decoding (runtime/engine/speculative.py) of requests without a grammar or
    # log-probabilities: drafts checked in one step, lossless, while measured tokens per second say
    # it pays. "lookup" drafts by prompt lookup, "mtp" with the pack's MTP head, "auto" both
    # (lookup where the context repeats itself; the MTP head where the pack has one and the budgets
    # hold its experts beside every decoder layer's: build.runs_mtp), "off" decodes one token a step.
    speculate: str = "auto"
    # Drafts a speculative step checks at most.
    draft_tokens: int = 4
    # Freeze Python's heap at the end of the warm-up (runtime/engine/collector.py): the process's
    # long-lived objects (modules, compiled graphs' guards) are then skipped by every later garbage
    # collection, whose full walk of them would otherwise stall a request's thread, GIL held, for as
    # long as the walk takes (~0.13 s for the demo engine on a 2-core VM, more with compiled graphs).
    freeze_heap: bool = True
    store: StoreConfig = field(default_factory=StoreConfig)

    def recurrent_max_tokens(self, fla_kernels: bool) -> int:
        """delta_rule_recurrent_max_tokens as set, or its default where fla's kernels run the delta
        rule (a GPU with fla-core) or where the plain rule does (a CPU, or a GPU without fla-core,
        whose plain recurrence is a launch an operation a token)."""
        if self.delta_rule_recurrent_max_tokens is not None:
            return self.delta_rule_recurrent_max_tokens
        return GPU_RECURRENT_MAX_TOKENS if fla_kernels else 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise FlashpackError(f"unknown dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if self.speculate not in SPECULATE:
            raise FlashpackError(f"unknown drafter {self.speculate!r}: use one of {', '.join(SPECULATE)}")
        if self.experts not in EXPERT_SOURCES:
            raise FlashpackError(f"unknown expert source {self.experts!r}: use one of {', '.join(EXPERT_SOURCES)}")
        minimums = {"layers_per_graph": 1, "staging_programs": 1, "graphs_min_layer_tokens": 0,
                    "dense_matvec_max_tokens": 0, "dense_tile_max_tokens": 0, "fp8_matvec_max_tokens": 0, "staged_beside_experts": 0,
                    "draft_tokens": 1, "delta_rule_recurrent_max_tokens": 1, "prompt_prefetch_max_tokens": 0,
                    "prompt_graphs_max_tokens": 0}
        for name, least in minimums.items():
            value = getattr(self, name)
            if value is None and name == "delta_rule_recurrent_max_tokens":  # the device's default
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise FlashpackError(f"engine {name} must be a whole number of at least {least}, got {value!r}")
        if self.draft_tokens > MAX_DRAFT_TOKENS:
            raise FlashpackError(f"engine draft_tokens must be at most {MAX_DRAFT_TOKENS}, got {self.draft_tokens}")
        parse_budget(self.prompt_cache_ram, "prompt_cache_ram")
        if parse_budget(self.decoded_experts_ram, "decoded_experts_ram") is None:
            raise FlashpackError("engine decoded_experts_ram must be a size such as 1GiB, or 0")
        parse_budget(self.prompt_cache_disk, "prompt_cache_disk")
        if not isinstance(self.store, StoreConfig):
            raise FlashpackError("engine store must be a StoreConfig")
