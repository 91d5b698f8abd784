"""The server as a FastAPI app: `create_app(engine, settings)`; `serve(pack, ...)` runs it with uvicorn.

    GuardMiddleware (API key, body size) -> routes (OpenAI, Anthropic, /health, /metrics)
                                              -> replies -> Scheduler (one worker thread) -> Generator

Every error leaves in the shape of the API its path belongs to (errors.py); an unexpected exception
in one request is a 500 for that request only.
"""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse

from flashpack.runtime.loader import StoreOptions
from flashpack.runtime.server import anthropic_routes, openai_routes
from flashpack.runtime.server.context import ServerContext, context_of
from flashpack.runtime.server.errors import ApiError, error_response, validation_error
from flashpack.runtime.server.guard import GuardMiddleware
from flashpack.runtime.server.settings import ServerSettings

log = logging.getLogger("flashpack.server")
LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def create_app(engine: Any, settings: ServerSettings | None = None) -> FastAPI:
    """engine: a runtime.loader.LoadedEngine (anything with .model, .tokenizer, .generator)."""
    settings = settings or ServerSettings()
    ctx = ServerContext.build(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(ctx.grammars.warm)  # the vocabulary view for grammars: ~1 s once
        ctx.scheduler.start()
        try:
            yield
        finally:
            ctx.scheduler.stop()

    app = FastAPI(title="flashpack", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.flashpack = ctx
    app.add_middleware(GuardMiddleware, api_key=settings.api_key, max_request_bytes=settings.max_request_bytes,
                       metrics=ctx.metrics)
    _add_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        ctx = context_of(request)
        return {"status": "ok", "model": ctx.settings.model_name, "queue_depth": ctx.scheduler.queue_depth}

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
        return error_response(request.url.path, ApiError(exc.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed: %s %s", request.method, request.url.path)
        return error_response(request.url.path, ApiError(500, f"internal error: {type(exc).__name__}"))


def serve(
    pack: str | os.PathLike,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    device: str = "cpu",
    dtype: str = "auto",
    model_name: str | None = None,
    max_request_bytes: int = ServerSettings.max_request_bytes,
    max_queue: int = ServerSettings.max_queue,
    max_context: int | None = None,
    default_max_tokens: int | None = None,
    log_level: str = "info",
    store: StoreOptions | None = None,
    verify_records: bool = True,
) -> None:
    """Load PACK and serve it until interrupted. api_key None: $FLASHPACK_API_KEY, if set."""
    import uvicorn

    from flashpack.runtime.loader import load_engine

    api_key = api_key if api_key is not None else (os.environ.get("FLASHPACK_API_KEY") or None)
    if host not in LOOPBACK and api_key is None:
        log.warning("serving on %s without an API key: anyone who can reach this port can use the model", host)
    engine = load_engine(pack, device=device, dtype=dtype, store=store, verify_records=verify_records)
    settings = ServerSettings(
        model_name=model_name or os.path.basename(os.path.normpath(os.fspath(pack))), api_key=api_key,
        max_request_bytes=max_request_bytes, max_queue=max_queue, max_context=max_context,
        default_max_tokens=default_max_tokens,
    )
    app = create_app(engine, settings)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
