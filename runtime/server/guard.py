"""What every request passes before a route sees it: the head's size, the API key, readiness, the
body's size and pace.

A plain ASGI middleware rather than Starlette's BaseHTTPMiddleware, which would buffer streaming
responses and hide client disconnects from the routes. It also counts responses by route and status.

Keys are accepted as `Authorization: Bearer <key>` (OpenAI) or `x-api-key: <key>` (Anthropic) and
compared in constant time; /health is open so a load balancer can probe without the key. Until the
warm-up is done (health.py) the API routes answer 503 with a Retry-After header. A body larger than
the limit is refused (413) by its content-length before it is read, or as it arrives; one that
pauses longer than `body_timeout` seconds between chunks is answered 408.
"""

from __future__ import annotations

import asyncio
import hmac
import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashpack.runtime.server.errors import ApiError, error_body
from flashpack.runtime.server.health import Health
from flashpack.runtime.server.metrics import Metrics

OPEN_PATHS = frozenset({"/health"})
KNOWN_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/messages", "/health", "/metrics")
API_PREFIX = "/v1/"


class _BodyRefused(HTTPException):
    """An HTTPException so that FastAPI's body parsing passes it on as it is (not as a 400)."""

    def __init__(self, error: ApiError):
        super().__init__(error.status, error.message)
        self.error = error


class GuardMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int, max_header_bytes: int,
                 body_timeout: float, metrics: Metrics, health: Health, retry_after_seconds: int):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_request_bytes
        self.max_header_bytes = max_header_bytes
        self.body_timeout = body_timeout
        self.metrics = metrics
        self.health = health
        self.retry_after = str(retry_after_seconds).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        route = next((r for r in KNOWN_ROUTES if path.startswith(r)), "other")
        status_seen: list[int] = []

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
            await send(message)

        try:
            error = self._refusal(scope)
            if error is not None:
                await _send_error(counting_send, path, error, self.retry_after)
                return
            try:
                await self.app(scope, self._limited(receive), counting_send)
            except _BodyRefused as refused:
                if not status_seen:
                    await _send_error(counting_send, path, refused.error)
        finally:
            self.metrics.count_request(route, status_seen[0] if status_seen else 499)

    def _refusal(self, scope: Scope) -> ApiError | None:
        # h11 bounds a head that arrives in pieces (max_incomplete_event_size), not one that arrives whole.
        head_bytes = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b"")) + sum(
            len(name) + len(value) + 4 for name, value in scope["headers"])
        if head_bytes > self.max_header_bytes:
            return ApiError(431, f"the request head is {head_bytes} bytes, over the server's limit of "
                            f"{self.max_header_bytes}", code="request_header_fields_too_large")
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return _too_large(self.max_bytes)
        if self.api_key is None or scope["path"] in OPEN_PATHS:
            return self._not_ready(scope)
        given = headers.get("x-api-key")
        authorization = headers.get("authorization", b"")
        if given is None and authorization[:7].lower() == b"bearer ":
            given = authorization[7:].strip()
        if not given:
            return ApiError(401, "missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`",
                            code="invalid_api_key")
        if not hmac.compare_digest(given, self.api_key):
            return ApiError(401, "invalid API key", code="invalid_api_key")
        return self._not_ready(scope)

    def _not_ready(self, scope: Scope) -> ApiError | None:
        if scope["path"].startswith(API_PREFIX) and self.health.loading:
            return ApiError(503, "the server is warming up; retry shortly", code="loading")
        return None

    def _limited(self, receive: Receive) -> Receive:
        """Count body bytes as they arrive (a chunked body has no content-length to check up front) and
        time the pauses between them; once the body is complete, waits (for a disconnect) are free."""
        received, complete = 0, False

        async def wrapped() -> Message:
            nonlocal received, complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout)
            except asyncio.TimeoutError:
                raise _BodyRefused(ApiError(408, f"the request body paused for more than {self.body_timeout:g} s",
                                            code="request_timeout")) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if received > self.max_bytes:
                    raise _BodyRefused(_too_large(self.max_bytes))
            return message

        return wrapped


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds the server's limit of {limit} bytes", code="request_too_large")


async def _send_error(send: Send, path: str, error: ApiError, retry_after: bytes = b"") -> None:
    body = json.dumps(error_body(path, error)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if error.status == 503 and retry_after:
        headers.append((b"retry-after", retry_after))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
