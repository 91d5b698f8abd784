"""Waiting for a store's background loads in tests."""

from __future__ import annotations

import time


def settle(store, timeout: float = 10.0) -> None:
    """Wait until no load is in flight (a released chunk's loads, prefetches and promotions still land)."""
    deadline = time.monotonic() + timeout
    placement = store.placement
    with placement.changed:
        while placement.busy():
            assert time.monotonic() < deadline, "loads still in flight"
            placement.changed.wait(0.05)
