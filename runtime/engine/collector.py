"""Python's garbage collector in a serving process: the heap frozen after the warm-up, every pause timed.

A warmed engine's process holds hundreds of thousands of objects that live as long as it does: torch's and
transformers' modules, the tokenizer, the compiled graphs' guards and code. CPython's full (generation
2) collection walks every one of them, on whichever thread allocated last, holding the GIL: on the
GPU that thread is usually a request's, and a prompt's kernel launches stop for the whole walk. The
demo engine on a 2-core VM already has ~340k such objects and a full collection of ~0.13 s.

`freeze_heap` collects once and moves every object alive into the permanent generation, which later
collections skip (`gc.freeze`), so a full collection walks only what came since: the server's and
the caches' own objects. vLLM ends its warm-up the same way, and SGLang offers it as an option.
Objects frozen are still freed by reference counting; only cycles among them stay until exit, which
for what lives through the warm-up is the process's life anyway.

`CollectorPauses` times every collection through `gc.callbacks` (each generation's count and seconds,
and the longest pause), for `/metrics` and the benches' per-request figures. Collections are the
process's, not an engine's: every engine holds the one `process_pauses()`, started once, so a
process that builds many engines (the tests) calls one callback a collection, not one an engine.
"""

from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass


def freeze_heap() -> float:
    """One full collection, then every object alive frozen (`gc.get_freeze_count()` says how many).
    Returns the seconds it took."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - start


@dataclass
class Pauses:
    """Collections and their seconds, by generation (0, 1, 2), and the longest pause."""

    counts: tuple[int, int, int] = (0, 0, 0)
    seconds: tuple[float, float, float] = (0.0, 0.0, 0.0)
    longest: float = 0.0

    def since(self, earlier: Pauses) -> Pauses:
        """What happened after `earlier` (the longest pause is the whole run's: a request's own
        longest needs `CollectorPauses.longest_since`)."""
        return Pauses(tuple(a - b for a, b in zip(self.counts, earlier.counts)),
                      tuple(a - b for a, b in zip(self.seconds, earlier.seconds)), self.longest)

    def to_dict(self) -> dict:
        return {"collections": sum(self.counts), "full_collections": self.counts[2],
                "seconds": sum(self.seconds), "full_seconds": self.seconds[2], "longest_seconds": self.longest}


class CollectorPauses:
    """Times every garbage collection of the process from `start()` to `stop()`.

    gc.callbacks run on the collecting thread with the GIL held, so one collection's start and stop
    come from the same thread with no other collection between them. The lock is re-entrant: a reader
    holding it may itself allocate and set off a collection, whose callback then takes it again."""

    def __init__(self):
        self._lock = threading.RLock()
        self._counts, self._seconds = [0, 0, 0], [0.0, 0.0, 0.0]
        self._longest = 0.0
        self._marks: dict[int, float] = {}  # a mark's id -> the longest pause since it was set
        self._began: float | None = None

    def start(self) -> CollectorPauses:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def pauses(self) -> Pauses:
        with self._lock:
            return Pauses(tuple(self._counts), tuple(self._seconds), self._longest)

    def mark(self) -> int:
        """Start tracking the longest pause from now: read it with `longest_since(mark)` (which ends the mark)."""
        with self._lock:
            mark = max(self._marks, default=0) + 1
            self._marks[mark] = 0.0
            return mark

    def longest_since(self, mark: int) -> float:
        with self._lock:
            return self._marks.pop(mark, 0.0)

    def to_dict(self) -> dict:
        return self.pauses().to_dict()

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        if self._began is None:  # started while the callback was being installed
            return
        took, self._began = time.perf_counter() - self._began, None
        generation = min(int(info.get("generation", 2)), 2)
        with self._lock:
            self._counts[generation] += 1
            self._seconds[generation] += took
            self._longest = max(self._longest, took)
            for mark, longest in self._marks.items():
                self._marks[mark] = max(longest, took)


_PROCESS_PAUSES = CollectorPauses()


def process_pauses() -> CollectorPauses:
    """The process's one CollectorPauses, timing from its first use."""
    return _PROCESS_PAUSES.start()
