"""The server as a FastAPI app: `create_app(engine, settings)`; `serve(pack, settings)` runs it with uvicorn.

    GuardedH11Protocol (connection cap, head deadline: connections.py)
      -> GuardMiddleware (API key, body size, readiness) -> routes (OpenAI, Anthropic, /health, /metrics)
                                              -> replies -> Scheduler (one worker thread) -> Generator

The app accepts connections at once and warms up in a thread (ServerContext.warm_up); /health says
"loading" until that is done (health.py). Every error leaves in the shape of the API its path belongs
to (errors.py); an unexpected exception in one request is a 500 for that request only.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse

from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.server import anthropic_routes, openai_completions, openai_routes
from flashpack.runtime.server.connections import connection_budget, raise_open_file_limit, uvicorn_options
from flashpack.runtime.server.context import ServerContext, context_of
from flashpack.runtime.server.errors import ApiError, body_parse_error, error_response, validation_error
from flashpack.runtime.server.guard import GuardMiddleware
from flashpack.runtime.server.settings import ServerSettings

log = logging.getLogger("flashpack.server")
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def create_app(engine: Any, settings: ServerSettings | None = None, loading_since: float | None = None) -> FastAPI:
    """engine: a runtime.engine.Engine (anything with .model_config, .tokenizer, .generator; an optional
    .warm_up() runs before /health says ok). loading_since: perf_counter() when loading began, for
    the "ready in" line."""
    settings = settings or ServerSettings()
    ctx = ServerContext.build(engine, settings, loading_since)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.scheduler.start()
        # Connections are served meanwhile (/health says "loading"); a daemon thread, so that an
        # interrupt during a long warm-up still ends the process.
        threading.Thread(target=ctx.warm_up, name="flashpack-warm-up", daemon=True).start()
        try:
            yield
        finally:
            ctx.scheduler.stop()

    app = FastAPI(title="flashpack", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.flashpack = ctx
    app.add_middleware(GuardMiddleware, api_key=settings.api_key, max_request_bytes=ctx.max_request_bytes,
                       max_header_bytes=settings.max_header_bytes, body_timeout=settings.body_timeout,
                       metrics=ctx.metrics, health=ctx.health, retry_after_seconds=settings.retry_after_seconds)
    _add_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(openai_completions.router)
    app.include_router(anthropic_routes.router)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        ctx = context_of(request)
        report = ctx.health.report
        body = report.body(model=ctx.settings.model_name, queue_depth=ctx.scheduler.queue_depth)
        return JSONResponse(body, status_code=report.http_status)

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(context_of(request).metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request.url.path, validation_error(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        error = body_parse_error(exc.__cause__) if exc.status_code == 400 and exc.__cause__ is not None else None
        return error_response(request.url.path, error or ApiError(exc.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed: %s %s", request.method, request.url.path)
        return error_response(request.url.path, ApiError(500, f"internal error: {type(exc).__name__}"))


def serve(
    pack: str | os.PathLike,
    settings: ServerSettings,
    config: EngineConfig = EngineConfig(),
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
) -> None:
    """Load PACK and serve it until interrupted; `settings` is built (and so validated) first."""
    import uvicorn

    from flashpack.runtime.engine.build import load_engine

    loading_since = time.perf_counter()
    if host not in LOOPBACK and settings.api_key is None:
        log.warning("serving on %s without an API key: anyone who can reach this port can use the model", host)
    budget = connection_budget(settings.max_connections, raise_open_file_limit())
    if budget.max_connections < settings.max_connections:
        log.warning("open connections capped at %d, below the open-file limit", budget.max_connections)
    engine = load_engine(pack, config)
    app = create_app(engine, settings, loading_since)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=_log_config(),
                            timeout_graceful_shutdown=5, **uvicorn_options(settings, budget))
    uvicorn.Server(config).run()


def _log_config() -> dict[str, Any]:
    """uvicorn's logging, with flashpack's own lines (warm-up, damage) through its handler."""
    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["flashpack"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config
