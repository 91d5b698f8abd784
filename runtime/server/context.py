"""Everything a request handler needs, held by one app instance (no module-level state)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from flashpack.runtime.server.constraints import GrammarCompiler
from flashpack.runtime.server.errors import ApiError
from flashpack.runtime.server.health import Health
from flashpack.runtime.server.metrics import Metrics
from flashpack.runtime.server.scheduler import Scheduler
from flashpack.runtime.server.settings import ServerSettings, StatsProvider

log = logging.getLogger("flashpack.server")
# A system turn and a user turn, one with marker characters, so both of the chat encoder's paths run.
_WARM_UP_CONVERSATION = [{"role": "system", "content": "<warm-up>"}, {"role": "user", "content": "Hello."}]


@dataclass
class ServerContext:
    engine: Any  # runtime.engine.Engine (or anything with .model_config, .tokenizer, .generator)
    settings: ServerSettings
    metrics: Metrics
    scheduler: Scheduler
    grammars: GrammarCompiler
    health: Health
    started: float = field(default_factory=time.time)
    loading_since: float = field(default_factory=time.perf_counter)  # serve() passes when the load began

    @classmethod
    def build(cls, engine: Any, settings: ServerSettings, loading_since: float | None = None) -> ServerContext:
        tokenizer = engine.tokenizer
        stats = settings.stats or _engine_stats(engine)
        prefix_cache = getattr(engine.generator, "prefix_cache", None)
        speculation = getattr(engine.generator, "speculation", None)
        collector = getattr(engine, "collector", None)
        metrics = Metrics(stats=stats, prompt_cache=prefix_cache.to_dict if prefix_cache is not None else None,
                          speculation=speculation.stats.to_dict if speculation is not None else None,
                          collector=collector.to_dict if collector is not None else None)
        health = Health()
        scheduler = Scheduler(engine.generator, settings.max_queue, metrics,
                              on_pack_damage=lambda reason: health.failed(f"the pack is damaged: {reason}"))
        metrics.set_queue_depth(lambda: scheduler.queue_depth)
        vocab_size = int(getattr(engine.model_config, "vocab_size", 0) or len(tokenizer.tokenizer))
        grammars = GrammarCompiler(tokenizer.tokenizer, vocab_size, tokenizer.stop_token_ids)
        ctx = cls(engine, settings, metrics, scheduler, grammars, health)
        if loading_since is not None:
            ctx.loading_since = loading_since
        return ctx

    @property
    def context_limit(self) -> int:
        """Tokens a sequence may hold (prompt + output): the engine's limit, or less if configured."""
        generator = self.engine.generator
        engine_limit = generator.max_context or self.engine.model_config.max_position_embeddings
        return min(engine_limit, self.settings.max_context or engine_limit)

    @property
    def max_request_bytes(self) -> int:
        return self.settings.request_bytes_limit(self.context_limit)

    def check_prompt_size(self, characters: int, param: str) -> None:
        """Refuse, before tokenizing, a prompt whose text alone cannot fit the context: `characters`
        of text make at least characters / max_chars_per_token tokens (runtime/tokenizer.py)."""
        per_token = self.engine.tokenizer.max_chars_per_token
        if per_token is None:
            return
        at_least = -(-characters // per_token)
        if at_least >= self.context_limit:
            raise ApiError(400, f"This model's maximum context length is {self.context_limit} tokens; the prompt's "
                           f"{characters} characters make at least {at_least}.", param=param,
                           code="context_length_exceeded")

    def check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.settings.model_name}`",
                           param="model", code="model_not_found")

    def warm_up(self) -> None:
        """What the first requests need, built before /health says ok (call from a thread): the
        grammar vocabulary, the chat encoder, and the engine's own warm-up where it has one."""
        start = time.perf_counter()
        try:
            self.grammars.warm()  # the vocabulary view for grammars: ~1 s for a real vocabulary
            tokenizer = self.engine.tokenizer
            tokenizer.max_chars_per_token  # a scan of the vocabulary, cached
            if getattr(tokenizer.tokenizer, "chat_template", None):
                tokenizer.encode_chat(_WARM_UP_CONVERSATION)
            engine_warm_up = getattr(self.engine, "warm_up", None)
            if callable(engine_warm_up):
                engine_warm_up()
        except Exception as error:  # the server stays up to say why on /health
            log.exception("warm-up failed")
            self.health.failed(f"warm-up failed: {type(error).__name__}: {error}")
            return
        now = time.perf_counter()
        self.health.ready()
        memory = getattr(self.engine, "memory", None)
        if callable(memory):  # how the budgets were split: what a user tunes them by
            log.info("memory: %s", memory())
        log.info("ready in %.1f s (warm-up %.1f s)", now - self.loading_since, now - start)


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
