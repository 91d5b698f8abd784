"""Engine: a pack opened for generation, what the server, verify and bench hold.

    engine.generator.stream(prompt_ids, params)   generation (runtime/engine/generate.py)
    engine.step([StepInput(tokens, state)])       one step of the model (runtime/engine/step.py)
    engine.warm_up()                              compile, tune and capture before the first request,
                                                  then freeze Python's heap (runtime/engine/collector.py)
    engine.stats()                                the expert store's counters (None without a store)
    engine.memory()                               how the budgets were split, in a line (the server logs it)
    engine.collector                              the process's garbage collections, timed
    engine.close()                                stop the store's and the stored states' threads
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashpack.layout.model_config import TextConfig
from flashpack.layout.pack import Pack
from flashpack.runtime.engine.collector import CollectorPauses, freeze_heap, process_pauses
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.generate import Generator
from flashpack.runtime.engine.step import Step
from flashpack.runtime.model.model import Qwen4ExpModel
from flashpack.runtime.model.qsa_attention import QUERY_CHUNK
from flashpack.runtime.store.budget import format_bytes, served_records
from flashpack.runtime.store.resident import ResidentExperts
from flashpack.runtime.tokenizer import PackTokenizer


@dataclass
class Engine:
    pack: Pack
    config: EngineConfig
    model: Qwen4ExpModel
    step: Step
    tokenizer: PackTokenizer
    generator: Generator
    store: object | None = None  # runtime.store.TieredStore (or ResidentExperts) when experts come through one
    collector: CollectorPauses = field(default_factory=process_pauses)  # the process's collections

    @property
    def model_config(self) -> TextConfig:
        return self.model.config

    def warm_up(self) -> dict[str, float]:
        """Compile, tune and capture at start what the first requests need (`warm_up_plan`,
        Generator.warm_up; on a CPU, where nothing is compiled or tuned per shape, nothing), then
        freeze the heap. Returns the seconds each part took."""
        parts = {}
        if self.model.device.type == "cuda":
            lengths, depth = self.warm_up_plan()
            parts = self.generator.warm_up(lengths, prompt_depth=depth)
        return parts | self.freeze_heap()

    def freeze_heap(self) -> dict[str, float]:
        """Everything alive now out of later garbage collections' walks (`EngineConfig.freeze_heap`;
        collector.freeze_heap): the warm-up's end, when the process's long-lived objects exist.
        Returns {"freeze_heap": seconds}, or nothing where the setting is off."""
        return {"freeze_heap": freeze_heap()} if self.config.freeze_heap else {}

    def warm_up_plan(self) -> tuple[list[int], int]:
        """(prompt lengths, layers they run through): a prompt of each shape class a first request
        may bring (`warm_up_lengths`), through one layer of each kind and the PLE layers."""
        cfg = self.model.config
        lengths = warm_up_lengths(cfg, (self.generator.max_context or cfg.max_position_embeddings) - 8)
        first_attention = next((i for i in range(cfg.num_hidden_layers) if not cfg.is_linear(i)), 0)
        depth = max(first_attention + 1, *cfg.ple_layer_ids, 1)
        return lengths, min(depth, cfg.num_hidden_layers)

    def stats(self) -> dict | None:
        self.step.settle()
        return self.store.stats.to_dict() if self.store is not None else None

    def memory(self) -> str:
        """Where the routed experts and the live prompt states are held, in a line: the budgets as
        the engine split them (the server logs it once loaded)."""
        if isinstance(self.store, ResidentExperts):
            experts = "experts: every record resident on the device"
        elif self.store is not None:
            plan, records = self.store.plan, len(served_records(self.pack, self.store.layers))
            experts = (f"experts: {records:,} records of {format_bytes(plan.record_stride)}, "
                       f"{min(plan.device_slots, records):,} of them on the device, "
                       f"{min(plan.host_slots, records):,} in host memory")
        else:
            experts = "experts: decoded from the pack as they are used"
        cache = self.generator.prefix_cache
        states = f"live prompt states: {format_bytes(cache.ram_budget)}" if cache is not None else "prompt reuse off"
        return f"{experts}; {states}"

    def time_layers(self, clock) -> None:
        """Have decode steps replayed from CUDA graphs call `clock.begin()` before their layers and
        `clock.lap(layer)` after each (runtime/bench/clock.py); None stops it. Eager steps are
        timed by the caller."""
        if self.step.graphs is not None:
            self.step.graphs.layer_clock = clock

    def close(self) -> None:
        """Stop the store's threads and the prompt states' copier and writer (after their pending work)."""
        if self.store is not None:
            self.store.close()
        if self.generator.prefix_cache is not None:
            self.generator.prefix_cache.close()


def warm_up_lengths(cfg: TextConfig, limit: int) -> list[int]:
    """Prompt lengths of every shape class a first request may bring, none over `limit`: 2 and 4
    tokens (a few-token projection takes the matvec kernel up to 3 tokens, the tile kernel up to 16:
    runtime/kernels/dispatch.py; compiled pieces are compiled once for each of those classes too),
    every power of two from 16 up to the QSA indexer's budget (the prompt attention kernel is built
    once for each power of two of the key blocks its queries read, key_block_steps, and a chat
    turn's few hundred tokens would otherwise build one on its first request), just past the
    budget, and several query chunks past it."""
    past_budget = cfg.indexer_budget + 2 * cfg.indexer_compress_ratio + 1
    candidates = [2, 4, past_budget, max(2 * past_budget, 4 * QUERY_CHUNK) + 37]
    power = 16
    while power < past_budget:
        candidates.append(power)
        power *= 2
    return sorted({min(length, limit) for length in candidates})
