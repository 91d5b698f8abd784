"""The reader threads (and the one copy thread): two FIFO lanes, required jobs first, prefetch jobs
only in the gaps.

A read a request waits for goes in the required lane; a prefetch (a guess at what the next layer
will ask for) goes in the low lane. A free thread always takes the oldest required read; it takes
a prefetch read only when no required read is waiting, and at most `threads - 1` threads run
prefetch reads at once, so a required read arriving behind a burst of prefetches finds a thread
(or the next one to free up) instead of queueing behind them. The store's host-to-device copies
run on one thread of their own lanes the same way. Plain Python.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

log = logging.getLogger("flashpack.store")


class ReadLanes:
    def __init__(self, threads: int, name: str = "flashpack-read"):
        self._cond = threading.Condition()
        self._required: deque = deque()
        self._low: deque = deque()
        self._low_limit = max(1, threads - 1)
        self._low_running = 0
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Callable, *args, low: bool = False) -> None:
        """Queue `job(*args)`; `low` puts it in the prefetch lane. Jobs handle their own errors."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the reader threads are shut down")
            (self._low if low else self._required).append((job, args))
            self._cond.notify()

    def pending(self) -> tuple[int, int]:
        """(required, prefetch) jobs queued and not yet started."""
        with self._cond:
            return len(self._required), len(self._low)

    def _take(self):
        with self._cond:
            while True:
                if self._required:
                    return self._required.popleft(), False
                if self._low and self._low_running < self._low_limit:
                    self._low_running += 1
                    return self._low.popleft(), True
                if self._closed and not self._low:
                    return None, False
                self._cond.wait()

    def _work(self) -> None:
        while True:
            item, low = self._take()
            if item is None:
                return
            job, args = item
            try:
                job(*args)
            except BaseException:  # a job handles its own failures; this is a bug, logged
                log.exception("expert read job failed")
            finally:
                if low:
                    with self._cond:
                        self._low_running -= 1
                        self._cond.notify_all()

    def shutdown(self, wait: bool = True) -> None:
        """Run what is queued, then stop the threads."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()
