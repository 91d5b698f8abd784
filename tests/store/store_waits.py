"""Waiting for a store's background loads in tests."""

from __future__ import annotations

import time


def settle(store, timeout: float = 10.0) -> None:
    """Wait until no load is in flight (a released chunk's loads, prefetches and promotions still land)."""
    deadline = time.monotonic() + timeout
    with store._changed:
        while store._inflight or store._host_loads or store._landing:
            assert time.monotonic() < deadline, "loads still in flight"
            store._changed.wait(0.05)
