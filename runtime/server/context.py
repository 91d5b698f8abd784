"""Everything a request handler needs, held by one app instance (no module-level state)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from flashpack.runtime.server.constraints import GrammarCompiler
from flashpack.runtime.server.errors import ApiError
from flashpack.runtime.server.metrics import Metrics
from flashpack.runtime.server.scheduler import Scheduler
from flashpack.runtime.server.settings import ServerSettings, StatsProvider


@dataclass
class ServerContext:
    engine: Any  # runtime.loader.LoadedEngine (or anything with .model, .tokenizer, .generator)
    settings: ServerSettings
    metrics: Metrics
    scheduler: Scheduler
    grammars: GrammarCompiler
    started: float = field(default_factory=time.time)

    @classmethod
    def build(cls, engine: Any, settings: ServerSettings) -> ServerContext:
        tokenizer = engine.tokenizer
        stats = settings.stats or _engine_stats(engine)
        metrics = Metrics(stats=stats)
        scheduler = Scheduler(engine.generator, settings.max_queue, metrics)
        metrics.set_queue_depth(lambda: scheduler.queue_depth)
        vocab_size = int(getattr(engine.model.config, "vocab_size", 0) or len(tokenizer.tokenizer))
        grammars = GrammarCompiler(tokenizer.tokenizer, vocab_size, tokenizer.stop_token_ids)
        return cls(engine, settings, metrics, scheduler, grammars)

    @property
    def context_limit(self) -> int:
        """Tokens a sequence may hold (prompt + output): the engine's limit, or less if configured."""
        generator = self.engine.generator
        engine_limit = generator.max_context or self.engine.model.config.max_position_embeddings
        return min(engine_limit, self.settings.max_context or engine_limit)

    def check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.settings.model_name}`",
                           param="model", code="model_not_found")


def context_of(request: Request) -> ServerContext:
    return request.app.state.flashpack


def _engine_stats(engine: Any) -> StatsProvider | None:
    """The engine's store counters, where it exposes them: a callable `stats()`, or a `stats` object
    with `to_dict()` (runtime.store.StoreStats), on the engine or on its `store` or `fetcher`."""
    for owner in (engine, getattr(engine, "store", None), getattr(engine, "fetcher", None)):
        stats = getattr(owner, "stats", None)
        if callable(getattr(stats, "to_dict", None)):
            return stats.to_dict
        if callable(stats):
            return stats
    return None
