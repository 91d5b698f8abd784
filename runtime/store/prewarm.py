"""Pre-warming: fill the host cache, then the device pool, from a hot-set profile at start.

The host tier gets the hottest records of all layers (each layer's device share first, then the
rest by count), read in runs of records that are contiguous on disk: one `preadv` of several
page-aligned slots per run, so a pack whose hot experts were moved together (`--reorder`) is read
sequentially. The device pool then takes each layer's hottest `capacity[layer]` experts through
the ordinary request path (host hits, or disk reads where the host tier was too small).
"""

from __future__ import annotations

import time
from concurrent.futures import wait as wait_futures

from flashpack.runtime.store.admission import Admission
from flashpack.runtime.store.placement import Placement
from flashpack.runtime.store.stats import StoreStats


def profile_weights(ranked: dict[int, list[int]], counts: dict[int, list[int]] | None) -> dict[tuple[int, int], float]:
    """Each ranked expert's popularity relative to its layer's hottest, in (0, 1]."""
    weights = {}
    for layer, experts in ranked.items():
        layer_counts = (counts or {}).get(layer) or [len(experts) - rank for rank in range(len(experts))]
        top = max(layer_counts[:1] or [1])
        for expert, count in zip(experts, layer_counts):
            weights[(layer, expert)] = count / top
    return weights


def plan_prewarm(
    ranked: dict[int, list[int]], counts: dict[int, list[int]] | None, device_capacity: dict[int, int], host_slots: int,
) -> tuple[dict[int, list[int]], list[tuple[int, int]]]:
    """(device targets per layer hottest first, host targets hottest first). Plain Python."""
    device = {layer: list(experts[:device_capacity.get(layer, 0)]) for layer, experts in ranked.items()}
    first = [(layer, e) for layer, experts in device.items() for e in experts]
    rest = []
    for layer, experts in ranked.items():
        weights = (counts or {}).get(layer) or [len(experts) - rank for rank in range(len(experts))]
        cut = len(device[layer])
        rest += [(-weights[rank], rank, layer, e) for rank, e in enumerate(experts) if rank >= cut]
    rest.sort()
    host = (first + [(layer, e) for _, _, layer, e in rest])[:host_slots]
    return device, host


def prewarm_store(
    admission: Admission, placement: Placement, stats: StoreStats, ranked: dict[int, list[int]],
    counts: dict[int, list[int]] | None = None,
) -> dict[str, int]:
    """Fill the host cache, then the device pool, from `ranked` (and `counts`); returns how many
    records went to each tier."""
    start = time.perf_counter()
    device_slots = placement.device_slots
    ranked = {layer: experts for layer, experts in ranked.items() if layer in device_slots.capacity}
    device, host = plan_prewarm(ranked, counts, device_slots.capacity, placement.host_slots.slots)
    weights = profile_weights(ranked, counts)
    # coldest first, so LRU keeps the hottest longest
    loads = admission.prewarm_host(list(reversed(host)), weights)
    wait_futures(loads)
    placed_device = 0
    for layer, experts in device.items():
        # coldest first: LRU order and LFU ties then keep the hottest longest
        remaining = [e for e in reversed(experts) if (layer, e) not in device_slots]
        seeds = {e: weights.get((layer, e), 0.0) for e in remaining}
        while remaining:
            handles, remaining = admission.request(layer, remaining, partial=True, prewarm=seeds)
            for handle in handles:
                try:
                    handle.wait()
                    placed_device += 1
                except Exception:
                    pass  # a bad record is reported when a request needs it, not at pre-warming
                finally:
                    handle.release()
    stats.add_time("prewarm_seconds", time.perf_counter() - start)
    return {"device": placed_device, "host": len(loads)}
