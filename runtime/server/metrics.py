"""Server metrics in the Prometheus text format (version 0.0.4).

Counters and histograms are updated by the route handlers and the generation worker thread, so
every update takes the instance's lock. Extra gauges come from an optional `stats()` provider (the
expert store's `StoreStats.to_dict`), read at each scrape:

    {"tiers": {"device": {"hits": 120, "misses": 30}, "host": {...}}, "requests": 150,
     "per_token": {"disk_reads": 0.4}, "layers": {...}}

becomes flashpack_store_hits{tier="device"} 120, flashpack_store_misses{tier="device"} 30,
flashpack_store_hit_rate{tier="device"} 0.8 (wherever a tier has hits and misses),
flashpack_store_requests 150 and flashpack_store_per_token_disk_reads 0.4; per-layer counters are
left out. Without a "tiers" key, each mapping-valued entry is taken as a tier.

A `prompt_cache()` provider (the engine's PrefixCache.to_dict) gives flashpack_prompt_cache_*
gauges: hits, misses, stored_hits, tokens_reused, live_entries, live_bytes, restore_seconds, and
its stored tier's as flashpack_prompt_cache_stored_* (entries, bytes, writes, dropped, ...). A
`speculation()` provider (SpeculationStats.to_dict) gives flashpack_speculation_*: steps, drafted,
accepted, rollbacks, tokens_per_step, acceptance, seconds in draft, verify and rollback, and
flashpack_speculation_accepted_at{position="i"} per draft position. A `collector()` provider (the
engine's CollectorPauses.to_dict) gives flashpack_gc_*: collections, full_collections, seconds,
full_seconds and longest_seconds, the process's garbage collections since the first engine was built.
"""

from __future__ import annotations

import math
import re
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_NAME_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{bound}"}} {n}' for bound, n in zip(self.buckets, self.counts, strict=True)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        return out + [f"{name}_sum {self.total:.6f}", f"{name}_count {self.count}"]


class Metrics:
    def __init__(self, queue_depth: Callable[[], int] = lambda: 0,
                 stats: Callable[[], Mapping[str, Any]] | None = None,
                 prompt_cache: Callable[[], Mapping[str, Any]] | None = None,
                 speculation: Callable[[], Mapping[str, Any]] | None = None,
                 collector: Callable[[], Mapping[str, Any]] | None = None):
        self._lock = threading.Lock()
        self._queue_depth = queue_depth
        self._stats = stats
        self._prompt_cache = prompt_cache
        self._speculation = speculation
        self._collector = collector
        self.requests: dict[tuple[str, int], int] = defaultdict(int)  # (route, status) -> count
        self.finishes: dict[str, int] = defaultdict(int)  # generator finish reason -> count
        self.running = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.decode_tokens = 0  # tokens after the first, for the decode rate
        self.decode_seconds = 0.0
        self.last_decode_rate = 0.0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.queue_wait = Histogram(TTFT_BUCKETS)

    def set_queue_depth(self, queue_depth: Callable[[], int]) -> None:
        self._queue_depth = queue_depth

    def count_request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def generation_started(self, waited_seconds: float) -> None:
        with self._lock:
            self.running += 1
            self.queue_wait.observe(waited_seconds)

    def generation_finished(
        self, prompt_tokens: int, generated: int, finish: str, timings: Mapping[str, float] | None,
    ) -> None:
        with self._lock:
            self.running -= 1
            self.finishes[finish] += 1
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += generated
            if timings and generated:
                self.ttft.observe(timings["first_token_seconds"])
                decode_time = timings["total_seconds"] - timings["first_token_seconds"]
                if generated > 1 and decode_time > 0:
                    self.decode_tokens += generated - 1
                    self.decode_seconds += decode_time
                    self.last_decode_rate = (generated - 1) / decode_time

    def render(self) -> str:
        with self._lock:
            lines = _typed("flashpack_requests_total", "counter", "HTTP requests by route and status")
            lines += [f'flashpack_requests_total{{route="{route}",status="{status}"}} {n}'
                      for (route, status), n in sorted(self.requests.items())]
            lines += _typed("flashpack_generations_total", "counter", "finished generations by finish reason")
            lines += [f'flashpack_generations_total{{finish="{f}"}} {n}' for f, n in sorted(self.finishes.items())]
            lines += _gauge("flashpack_queue_depth", "requests waiting for the engine", self._queue_depth())
            lines += _gauge("flashpack_requests_running", "requests generating now", self.running)
            lines += _typed("flashpack_prompt_tokens_total", "counter", "prompt tokens processed")
            lines += [f"flashpack_prompt_tokens_total {self.prompt_tokens}"]
            lines += _typed("flashpack_generated_tokens_total", "counter", "tokens generated")
            lines += [f"flashpack_generated_tokens_total {self.generated_tokens}"]
            rate = self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0
            lines += _gauge("flashpack_decode_tokens_per_second", "decode rate over all requests", rate)
            lines += _gauge("flashpack_last_decode_tokens_per_second", "decode rate of the last request",
                            self.last_decode_rate)
            lines += _typed("flashpack_time_to_first_token_seconds", "histogram", "prefill + first token")
            lines += self.ttft.lines("flashpack_time_to_first_token_seconds")
            lines += _typed("flashpack_queue_wait_seconds", "histogram", "time a request waited for the engine")
            lines += self.queue_wait.lines("flashpack_queue_wait_seconds")
        lines += self._store_lines() + self._prompt_cache_lines() + self._speculation_lines()
        lines += _provided_gauges("flashpack_gc", self._collector)
        return "\n".join(lines) + "\n"

    def _speculation_lines(self) -> list[str]:
        return _provided_gauges("flashpack_speculation", self._speculation)

    def _prompt_cache_lines(self) -> list[str]:
        return _provided_gauges("flashpack_prompt_cache", self._prompt_cache)

    def _store_lines(self) -> list[str]:
        if self._stats is None:
            return []
        try:
            provided = self._stats()
        except Exception as error:  # a broken provider must not take /metrics down
            return [f"# flashpack_store stats unavailable: {type(error).__name__}"]
        if provided is None:  # the engine runs without a tiered store
            return []
        stats = dict(provided)
        series: dict[str, list[str]] = defaultdict(list)
        tiers = stats.pop("tiers", None)
        if not isinstance(tiers, Mapping):  # the flat form: every mapping is a tier
            tiers = {k: v for k, v in stats.items() if isinstance(v, Mapping)}
            stats = {k: v for k, v in stats.items() if k not in tiers}
        for tier, values in tiers.items():
            numbers = {k: v for k, v in values.items() if _is_number(v)}
            if "hits" in numbers and "misses" in numbers and "hit_rate" not in numbers:
                lookups = numbers["hits"] + numbers["misses"]
                numbers["hit_rate"] = numbers["hits"] / lookups if lookups else 0.0
            label = _NAME_UNSAFE.sub("_", str(tier))
            for name, number in numbers.items():
                series[_metric_name(name)].append(f'{_metric_name(name)}{{tier="{label}"}} {_fmt(number)}')
        for key, value in stats.items():
            if key == "layers":
                continue  # per-layer counters: too many series for a scrape; the bench reports them
            flat = {f"{key}_{k}": v for k, v in value.items()} if isinstance(value, Mapping) else {key: value}
            for name, number in flat.items():
                if _is_number(number):
                    series[_metric_name(name)].append(f"{_metric_name(name)} {_fmt(number)}")
        lines: list[str] = []
        for name, samples in sorted(series.items()):
            lines += [f"# TYPE {name} gauge", *samples]
        return lines


def _provided_gauges(prefix: str, provider: Callable[[], Mapping[str, Any]] | None) -> list[str]:
    """`prefix`_KEY gauges from a provider's numbers; a nested mapping's as `prefix`_KEY_INNER (two
    levels deep: the speculation's by_drafter_lookup_steps), a list as one series labelled by
    position (from 1)."""
    if provider is None:
        return []
    try:
        found = dict(provider())
    except Exception as error:  # a broken provider must not take /metrics down
        return [f"# {prefix} stats unavailable: {type(error).__name__}"]
    flat: dict[str, Any] = {}
    for key, value in found.items():
        if isinstance(value, Mapping):
            for inner, number in value.items():
                if isinstance(number, Mapping):
                    flat.update({f"{key}_{inner}_{name}": deeper for name, deeper in number.items()})
                else:
                    flat[f"{key}_{inner}"] = number
        else:
            flat[key] = value
    lines: list[str] = []
    for key, value in flat.items():
        name = f"{prefix}_{_NAME_UNSAFE.sub('_', key)}"
        if isinstance(value, list):
            lines += [f"# TYPE {name} gauge"] + [f'{name}{{position="{i + 1}"}} {_fmt(n)}' for i, n in enumerate(value)
                                                  if _is_number(n)]
        elif _is_number(value):
            lines += [f"# TYPE {name} gauge", f"{name} {_fmt(value)}"]
    return lines


def _metric_name(key: str) -> str:
    return "flashpack_store_" + _NAME_UNSAFE.sub("_", str(key))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fmt(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def _typed(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _gauge(name: str, help_text: str, value: float) -> list[str]:
    return _typed(name, "gauge", help_text) + [f"{name} {_fmt(value)}"]
