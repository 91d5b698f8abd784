"""What the store did: hits, misses and bytes moved per tier and per layer, and time spent waiting.

Tiers: `device` (the slot pool the compute reads), `host` (the pinned RAM cache), `disk` (the
pack, read with O_DIRECT). A request is a device hit, else a host hit (one host->device copy),
else a disk read (disk->host, then host->device). Pre-warming is counted apart, so the hits it
buys show up as hits and the bytes it moved are not charged to decoding. Prefetches (loads started
for a layer the engine expects to ask for next) are no requests either: they are counted as
issued, used (a later request found the entry resident or in flight) and wasted (evicted before
any request used it), so used / issued is the accuracy of the prediction; the bytes they move are
real traffic and count in the bytes_* totals. Read-aheads (disk reads into the host cache for a
layer two ahead) are counted the same way. Plain Python.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class LayerCounters:
    requests: int = 0
    device_hits: int = 0
    host_hits: int = 0  # device misses served from the host cache
    disk_reads: int = 0  # device misses read from disk (host misses)
    joined: int = 0  # requests that joined a read or copy already in flight
    bytes_host_to_device: int = 0
    bytes_disk_to_host: int = 0
    evictions_device: int = 0
    evictions_host: int = 0
    prewarmed_device: int = 0  # records placed by pre-warming (not requests)
    prewarmed_host: int = 0
    prewarm_bytes_disk_to_host: int = 0  # bytes pre-warming moved (not in the bytes_* above)
    prewarm_bytes_host_to_device: int = 0
    failed: int = 0
    prefetch_issued: int = 0  # prefetch loads started (not requests)
    prefetch_from_disk: int = 0  # of those, read from disk (the rest were host-cache copies)
    prefetch_used: int = 0  # a request found the prefetched entry resident or in flight
    prefetch_wasted: int = 0  # evicted before any request used it
    read_ahead_issued: int = 0  # disk reads into the host cache for a layer expected later
    read_ahead_used: int = 0  # a load took the record from the host cache
    read_ahead_wasted: int = 0  # evicted from the host cache before any load took it

    def add(self, other: "LayerCounters") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class StoreStats:
    layers: dict[int, LayerCounters] = field(default_factory=dict)
    wait_seconds: float = 0.0  # time stream/fetch/wait blocked on loads (on CUDA: reads; streams wait for copies)
    prewarm_seconds: float = 0.0
    read_seconds: float = 0.0  # time reader threads spent in preadv (summed over threads)
    read_calls: int = 0  # preadv calls (a run of contiguous records is one)
    verified_records: int = 0
    tokens: int = 0  # set by whoever knows (bench, run); divides the per-token figures
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def layer(self, layer: int) -> LayerCounters:
        counters = self.layers.get(layer)
        if counters is None:
            counters = self.layers[layer] = LayerCounters()
        return counters

    def bump(self, layer: int, **amounts: int) -> None:
        """Thread-safe increments: reader threads count bytes while the engine counts hits."""
        with self._lock:
            counts = self.layer(layer).__dict__  # the dataclass's fields, added to in place
            for name, amount in amounts.items():
                counts[name] += amount

    def add_time(self, name: str, seconds: float) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + seconds)

    def total(self) -> LayerCounters:
        out = LayerCounters()
        for counters in self.layers.values():
            out.add(counters)
        return out

    def reset(self) -> None:
        """Zero the counters (after pre-warming or warm-up), keeping nothing but the lock."""
        with self._lock:
            self.layers.clear()
            self.wait_seconds = self.read_seconds = self.prewarm_seconds = 0.0
            self.verified_records = self.tokens = self.read_calls = 0

    def to_dict(self) -> dict:
        total = self.total()
        misses = total.requests - total.device_hits
        per_token = (lambda v: v / self.tokens) if self.tokens else (lambda v: None)
        return {
            "tiers": {
                "device": {"hits": total.device_hits, "misses": misses, "evictions": total.evictions_device,
                           "prewarmed": total.prewarmed_device},
                "host": {"hits": total.host_hits, "misses": total.disk_reads, "evictions": total.evictions_host,
                         "prewarmed": total.prewarmed_host, "bytes_to_device": total.bytes_host_to_device,
                         "prewarm_bytes_to_device": total.prewarm_bytes_host_to_device},
                "disk": {"reads": total.disk_reads, "bytes_to_host": total.bytes_disk_to_host,
                         "prewarm_bytes_to_host": total.prewarm_bytes_disk_to_host},
            },
            "requests": total.requests,
            "joined": total.joined,
            "failed": total.failed,
            "device_hit_rate": total.device_hits / total.requests if total.requests else None,
            "prefetch": {
                "issued": total.prefetch_issued, "from_disk": total.prefetch_from_disk,
                "used": total.prefetch_used, "wasted": total.prefetch_wasted,
                "accuracy": total.prefetch_used / total.prefetch_issued if total.prefetch_issued else None,
            },
            "read_ahead": {
                "issued": total.read_ahead_issued, "used": total.read_ahead_used, "wasted": total.read_ahead_wasted,
                "accuracy": total.read_ahead_used / total.read_ahead_issued if total.read_ahead_issued else None,
            },
            "tokens": self.tokens,
            "per_token": {
                "device_misses": per_token(misses), "disk_reads": per_token(total.disk_reads),
                "bytes_host_to_device": per_token(total.bytes_host_to_device),
                "bytes_disk_to_host": per_token(total.bytes_disk_to_host),
            },
            "wait_seconds": self.wait_seconds,
            "read_seconds": self.read_seconds,
            "read_calls": self.read_calls,
            "prewarm_seconds": self.prewarm_seconds,
            "verified_records": self.verified_records,
            "layers": {str(layer): {f.name: getattr(c, f.name) for f in fields(c)}
                       for layer, c in sorted(self.layers.items())},
        }
