"""What a server instance is told at start: one validated dataclass, passed down explicitly."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flashpack.errors import FlashpackError

StatsProvider = Callable[[], Mapping[str, Any]]

# The default body limit: room for a context-filling prompt at 8 bytes a token (English runs at ~4;
# CJK sent as \\u escapes at up to ~8) plus 1 MiB for tools, schemas and the JSON around them.
REQUEST_BYTES_PER_CONTEXT_TOKEN = 8
REQUEST_BYTES_BASE = 2**20


@dataclass(frozen=True)
class ServerSettings:
    model_name: str = "flashpack"  # the one model id the API serves; requests naming another get a 404
    api_key: str | None = None  # None: no authentication (fine on loopback only)
    # Request bodies above this get a 413 before they are read; None: 1 MiB + 8 bytes per context
    # token (the real model's 262,144 tokens: 3 MiB), see REQUEST_BYTES_PER_CONTEXT_TOKEN.
    max_request_bytes: int | None = None
    max_queue: int = 16  # requests waiting behind the running one; more get a 429
    max_context: int | None = None  # tokens (prompt + output); None: the engine's own limit
    default_max_tokens: int | None = None  # when a request names none; None: the rest of the context
    # Open connections beyond this evict the longest-idle one (one waiting for a request), or, with
    # none idle, are answered 503 and closed. `serve` also keeps it below the open-file limit.
    max_connections: int = 512
    header_timeout: float = 10.0  # seconds a connection may take to send a whole request head
    keep_alive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open
    body_timeout: float = 30.0  # seconds a request body may pause between chunks before a 408
    max_header_bytes: int = 16 * 2**10  # a request head (path and headers) above this: 431 (400 if it trickles in)
    retry_after_seconds: int = 5  # the Retry-After of a 503 while the engine warms up
    stats: StatsProvider | None = None  # extra metrics (the expert store's per-tier hits); see metrics.py

    def __post_init__(self) -> None:
        if not self.model_name or not self.model_name.strip():
            raise FlashpackError("the served model name must not be empty")
        if self.api_key is not None and not self.api_key.strip():
            raise FlashpackError("the API key must not be blank")
        if self.max_request_bytes is not None and self.max_request_bytes < 1024:
            raise FlashpackError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")
        if self.max_queue < 0:
            raise FlashpackError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_context is not None and self.max_context < 2:
            raise FlashpackError(f"max_context must be at least 2, got {self.max_context}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise FlashpackError(f"default_max_tokens must be at least 1, got {self.default_max_tokens}")
        if self.max_connections < 1:
            raise FlashpackError(f"max_connections must be at least 1, got {self.max_connections}")
        for name in ("header_timeout", "keep_alive_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise FlashpackError(f"{name} must be a positive number of seconds, got {getattr(self, name)}")
        if self.max_header_bytes < 1024:
            raise FlashpackError(f"max_header_bytes must be at least 1024, got {self.max_header_bytes}")
        if self.retry_after_seconds < 1:
            raise FlashpackError(f"retry_after_seconds must be at least 1, got {self.retry_after_seconds}")

    def request_bytes_limit(self, context_tokens: int) -> int:
        """max_request_bytes, or its default for a context of `context_tokens`."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return REQUEST_BYTES_BASE + REQUEST_BYTES_PER_CONTEXT_TOKEN * context_tokens
