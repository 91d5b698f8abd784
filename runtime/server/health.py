"""Whether the server can serve, as /health reports it.

    loading --warm-up done--> ok
       \\___________________\\____pack damage, failed warm-up____> error (for the rest of the process)

Only `ok` answers /health with a 200. While loading, the API routes answer 503 with a Retry-After
(guard.py); in the error state they keep serving, since a damaged record fails only the requests
that read it, but /health's 503 takes the server out of a load balancer's rotation.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

LOADING, OK, ERROR = "loading", "ok", "error"


@dataclass(frozen=True)
class HealthReport:
    status: str
    reason: str | None = None

    @property
    def http_status(self) -> int:
        return 200 if self.status == OK else 503

    def body(self, **fields: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"status": self.status}
        if self.reason is not None:
            body["reason"] = self.reason
        return {**body, **fields} if self.status == OK else body


class Health:
    """Thread-safe: the warm-up thread and the generation worker report here, routes read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._report = HealthReport(LOADING)

    @property
    def report(self) -> HealthReport:
        with self._lock:
            return self._report

    @property
    def loading(self) -> bool:
        return self.report.status == LOADING

    def ready(self) -> None:
        """Warm-up is done; an error reported meanwhile stands."""
        with self._lock:
            if self._report.status == LOADING:
                self._report = HealthReport(OK)

    def failed(self, reason: str) -> None:
        """The engine cannot be trusted to serve (the first reason is kept)."""
        with self._lock:
            if self._report.status != ERROR:
                self._report = HealthReport(ERROR, reason)
