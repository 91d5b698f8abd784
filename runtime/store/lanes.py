"""The reader threads (and the one copy thread): two FIFO lanes, required jobs first, prefetch jobs
only in the gaps.

A read a request waits for goes in the required lane; a prefetch (a guess at what the next layer
will ask for) goes in the low lane. A free thread always takes the oldest required read; it takes
a prefetch read only when no required read is waiting. By default it may start one beside a
required read that is already running (`guesses_beside_required`): holding every guess back until
the disk is free decoded slower on the H200, since a guess then lands after its layer asks
(bench/HISTORY.md). At most `threads - 1` threads run prefetch reads at once, so a required read
arriving behind a burst of prefetches finds a thread (or the next one to free up) instead of
queueing behind them. A prefetch that a request comes to wait for is moved to the required lane
(`promote`). The store's host-to-device copies run on one thread of their own lanes the same way.
Plain Python.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable

log = logging.getLogger("flashpack.store")


class ReadLanes:
    def __init__(self, threads: int, name: str = "flashpack-read", guesses_beside_required: bool = True):
        """`guesses_beside_required`: a prefetch job may start while a required job runs (False: only
        once none runs, unless a request promotes it)."""
        self._cond = threading.Condition()
        self._required: deque = deque()
        self._low: deque = deque()
        self._low_limit = max(1, threads - 1)
        self._running = {False: 0, True: 0}  # jobs running, by lane (True: the low lane)
        self._beside_required = guesses_beside_required
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Callable, *args, low: bool = False, key: Hashable = None) -> None:
        """Queue `job(*args)`; `low` puts it in the prefetch lane, where `promote(key)` finds it.
        Jobs handle their own errors."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the reader threads are shut down")
            (self._low if low else self._required).append((job, args, key))
            self._cond.notify()

    def promote(self, key: Hashable) -> bool:
        """Move the queued prefetch job of `key` to the back of the required lane (a request now
        waits for it); False when none is queued (it runs already, or never was a prefetch)."""
        with self._cond:
            for index, item in enumerate(self._low):
                if item[2] == key:
                    del self._low[index]
                    self._required.append(item)
                    self._cond.notify()
                    return True
        return False

    def pending(self) -> tuple[int, int]:
        """(required, prefetch) jobs queued and not yet started."""
        with self._cond:
            return len(self._required), len(self._low)

    def _take(self):
        with self._cond:
            while True:
                if self._required:
                    self._running[False] += 1
                    return self._required.popleft(), False
                if self._low and self._running[True] < self._low_limit and (
                        self._beside_required or not self._running[False]):
                    self._running[True] += 1
                    return self._low.popleft(), True
                if self._closed and not self._low:
                    return None, False
                self._cond.wait()

    def _work(self) -> None:
        while True:
            item, low = self._take()
            if item is None:
                return
            job, args, _ = item
            try:
                job(*args)
            except BaseException:  # a job handles its own failures; this is a bug, logged
                log.exception("expert read job failed")
            finally:
                with self._cond:
                    self._running[low] -= 1
                    self._cond.notify_all()  # a prefetch may be waiting for the disk to be its own

    def shutdown(self, wait: bool = True) -> None:
        """Run what is queued, then stop the threads."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()
