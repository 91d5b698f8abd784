"""Connections that cannot starve the server: a deadline for each request head, a cap on open ones.

uvicorn times out a keep-alive connection between requests, but a connection that never sends a
complete request head (an idle socket, a slow drip of header bytes) stays open for ever, and with
enough of them accept() fails with EMFILE: the event loop then logs every failed attempt and
/health stops answering. `GuardedH11Protocol` is uvicorn's h11 protocol with two additions:

- a connection waiting for a request (new, or after a response) must deliver the whole head within
  `header_timeout` seconds, or it is closed;
- beyond `max_connections` open connections, a new one evicts the connection that has waited for a
  request longest; if every connection has a request in flight, the new one is answered 503 and
  closed at once (no log line per refusal: counted in `ConnectionLimits.refused`).

`serve` raises the soft open-file limit to the hard one and fits the cap and the listen backlog
under it (`connection_budget`), so accept() itself never runs out of descriptors.
"""

from __future__ import annotations

import functools
import json
import resource
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from flashpack.runtime.server.settings import ServerSettings

RESERVED_FILES = 256  # descriptors left for the pack's files, the engine and the interpreter
MIN_BACKLOG, MAX_BACKLOG = 8, 2048  # uvicorn's default backlog is the most
# A connection closed to make room frees its descriptor some turns of the event loop after it was
# accepted, while each turn may accept a backlog more: room is kept for this many backlogs.
BACKLOGS_IN_FLIGHT = 5
_BUSY_BODY = json.dumps({"error": {"message": "too many open connections; retry shortly", "type": "server_error",
                                     "param": None, "code": "too_many_connections"}}).encode()
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
         b"retry-after: 1\r\ncontent-length: %d\r\n\r\n" % len(_BUSY_BODY)) + _BUSY_BODY


@dataclass
class ConnectionLimits:
    max_connections: int
    header_timeout: float
    refused: int = 0  # connections answered 503 because every open one was busy
    evicted: int = 0  # idle connections closed to make room


class GuardedH11Protocol(H11Protocol):
    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._head_deadline: Any = None  # asyncio.TimerHandle while waiting for a request head
        self.waiting_since = time.monotonic()

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections and not self._make_room():
            self.limits.refused += 1
            transport.write(_BUSY)
            transport.close()
            return
        self._watch_for_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_for_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_for_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    @property
    def waiting_for_request(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _watch_for_head(self) -> None:
        """Arm the head deadline when the connection starts waiting for a request; cancel it once one
        is in flight. Bytes of a partial head do not re-arm it: the whole head has one deadline."""
        if self.transport.is_closing() or not self.waiting_for_request:
            self._cancel_deadline()
        elif self._head_deadline is None:
            self.waiting_since = time.monotonic()
            self._head_deadline = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def _cancel_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.waiting_for_request and not self.transport.is_closing():
            self.transport.close()

    def _make_room(self) -> bool:
        """Close the connection that has waited longest for a request; False if none waits."""
        idle = [c for c in self.connections if c is not self and isinstance(c, GuardedH11Protocol)
                and c.waiting_for_request and not c.transport.is_closing()]
        if not idle:
            return False
        oldest = min(idle, key=lambda connection: connection.waiting_since)
        oldest._cancel_deadline()
        oldest.transport.close()
        self.limits.evicted += 1
        return True


@dataclass(frozen=True)
class ConnectionBudget:
    max_connections: int
    backlog: int  # the listen backlog, which is also how many connections asyncio accepts in one turn


def connection_budget(wanted: int, open_file_limit: int) -> ConnectionBudget:
    """`wanted` connections, fewer if that many would not fit under the open-file limit beside
    RESERVED_FILES (a quarter of a small limit) and BACKLOGS_IN_FLIGHT backlogs of fresh accepts."""
    reserve = RESERVED_FILES if open_file_limit >= 4 * RESERVED_FILES else open_file_limit // 4
    room = max(1, open_file_limit - reserve)
    backlog = min(MAX_BACKLOG, max(MIN_BACKLOG, room // (2 * BACKLOGS_IN_FLIGHT)))
    return ConnectionBudget(max(1, min(wanted, room - BACKLOGS_IN_FLIGHT * backlog)), backlog)


def uvicorn_options(settings: ServerSettings, budget: ConnectionBudget | None = None) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for `settings`'s connection limits; without a budget, the one
    for the current open-file limit."""
    if budget is None:
        budget = connection_budget(settings.max_connections, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    limits = ConnectionLimits(budget.max_connections, settings.header_timeout)
    return {"http": functools.partial(GuardedH11Protocol, limits=limits), "backlog": budget.backlog,
            "timeout_keep_alive": settings.keep_alive_timeout, "h11_max_incomplete_event_size": settings.max_header_bytes}


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (where allowed); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # the kernel's cap (nr_open) can sit below the hard limit: keep what we have
    return soft
