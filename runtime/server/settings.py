"""What a server instance is told at start: one validated dataclass, passed down explicitly."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flashpack.errors import FlashpackError

StatsProvider = Callable[[], Mapping[str, Any]]


@dataclass(frozen=True)
class ServerSettings:
    model_name: str = "flashpack"  # the one model id the API serves; requests naming another get a 404
    api_key: str | None = None  # None: no authentication (fine on loopback only)
    max_request_bytes: int = 16 * 2**20  # request bodies above this get a 413
    max_queue: int = 16  # requests waiting behind the running one; more get a 429
    max_context: int | None = None  # tokens (prompt + output); None: the engine's own limit
    default_max_tokens: int | None = None  # when a request names none; None: the rest of the context
    stats: StatsProvider | None = None  # extra metrics (the expert store's per-tier hits); see metrics.py

    def __post_init__(self) -> None:
        if not self.model_name:
            raise FlashpackError("the served model name must not be empty")
        if self.api_key is not None and not self.api_key.strip():
            raise FlashpackError("the API key must not be blank")
        if self.max_request_bytes < 1024:
            raise FlashpackError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")
        if self.max_queue < 0:
            raise FlashpackError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_context is not None and self.max_context < 2:
            raise FlashpackError(f"max_context must be at least 2, got {self.max_context}")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise FlashpackError(f"default_max_tokens must be at least 1, got {self.default_max_tokens}")
