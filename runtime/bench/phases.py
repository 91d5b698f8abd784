"""The store's counters over one phase (prefill or decode): a snapshot before, one after, the difference.

Every request is a device hit, a host hit, a disk read, or joins a load already in flight (a
prefetch or another request's). Hit rates per tier: `device` = device hits / requests; `host` =
host hits / device misses (the host cache's share of what the device lacked); `disk` = disk reads
/ requests. Bytes per tier and per token come straight from the counters (LayerCounters, summed
over layers), so they are the bytes the store actually moved, slot-sized, prefetches included.
"""

from __future__ import annotations

from dataclasses import fields

TIMES = ("wait_seconds", "read_seconds", "read_calls")


def snapshot(store) -> dict[str, float]:
    """Every total counter of `store.stats` (a TieredStore's StoreStats) and its timers."""
    stats = store.stats
    total = stats.total()
    counters = {f.name: getattr(total, f.name) for f in fields(total)}
    for name in TIMES:
        counters[name] = getattr(stats, name, 0)
    return counters


def difference(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0) for name in after}


def _ratio(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def phase_summary(delta: dict[str, float], tokens: int) -> dict:
    """What the store did for `tokens` tokens: counts, hit rates, bytes and per-token figures."""
    requests = delta.get("requests", 0)
    device_hits = delta.get("device_hits", 0)
    host_hits, disk_reads = delta.get("host_hits", 0), delta.get("disk_reads", 0)
    to_device, from_disk = delta.get("bytes_host_to_device", 0), delta.get("bytes_disk_to_host", 0)
    return {
        "tokens": tokens,
        "requests": requests,
        "device_hits": device_hits,
        "host_hits": host_hits,
        "disk_reads": disk_reads,
        "joined": delta.get("joined", 0),  # requests that joined a load already in flight
        "hit_rates": {
            "device": _ratio(device_hits, requests),
            "host": _ratio(host_hits, requests - device_hits),
            "disk": _ratio(disk_reads, requests),
        },
        "bytes": {"host_to_device": to_device, "disk_to_host": from_disk},
        "per_token": {
            "requests": requests / tokens,
            "disk_reads": disk_reads / tokens,
            "bytes_host_to_device": to_device / tokens,
            "bytes_disk_to_host": from_disk / tokens,
        },
        "wait_seconds": delta.get("wait_seconds", 0.0),
        "read_seconds": delta.get("read_seconds", 0.0),
        "counters": delta,
    }
