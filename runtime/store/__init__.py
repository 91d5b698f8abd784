"""The tiered expert store: device slot pool, pinned host cache, the pack read with O_DIRECT.

    build_store(pack, StoreConfig(...), device, ...) -> TieredStore (or ResidentExperts)
    TieredStore.bank / stream / prefetch    the engine's ExpertSlots source (kernels read slots in place)
    TieredStore.fetch(layer, experts)       the ExpertFetcher call (dequantised weights)
    TieredStore.request / wait              the asynchronous form (handles, ready or in flight)
    replay_trace(trace, ...)                what a recorded trace would hit at given budgets

Bookkeeping (config, policy, residency, placement, capacity, budget, simulate, trace, stats) is
plain Python; the modules that hold or move bytes (reader, tiers, transfers, admission, handles,
table_steps, store, prewarm) are the only ones that touch torch (lanes, the reader threads' queue,
is plain Python too).
Imports are lazy so the plain-Python parts load without torch.
"""

from __future__ import annotations

__all__ = ["build_store", "TieredStore", "replay_trace"]


def __getattr__(name: str):
    if name == "build_store":
        from flashpack.runtime.store.build import build_store

        return build_store
    if name == "TieredStore":
        from flashpack.runtime.store.store import TieredStore

        return TieredStore
    if name == "replay_trace":
        from flashpack.runtime.store.simulate import replay_trace

        return replay_trace
    raise AttributeError(name)
