"""One engine, many requests: a bounded queue in front of one worker thread that runs generation.

    route (event loop) --submit--> queue.Queue --worker thread--> Generator.stream
            ^                                                          |
            +------ asyncio.Queue per job <-- call_soon_threadsafe ----+

The engine runs one sequence at a time, so requests wait their turn; a full queue is refused at
once (429). A job without sampling parameters only scores its prompt (Generator.score: `echo` with
`max_tokens` 0); a job's LogprobRequest asks the generator for log-probabilities. A job whose client
went away is cancelled: still queued, it is skipped; running, the generator's `cancelled` callable
stops it after the current token. Any exception inside a job is
delivered to that job's consumer; the worker itself keeps going. A FlashpackError is the request's
fault (400), except PackDamageError: the pack on disk failed a check, which is a 500 naming the
damage and is also reported to `on_pack_damage` (the server's health turns to error).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from flashpack.errors import FlashpackError, PackDamageError
from flashpack.runtime.engine.generate import GenerationEvent, Generator, TokenConstraint
from flashpack.runtime.logprobs import LogprobRequest
from flashpack.runtime.sampling import SamplingParams
from flashpack.runtime.server.errors import ApiError
from flashpack.runtime.server.metrics import Metrics

log = logging.getLogger("flashpack.server")
_END = object()


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams | None  # None: score the prompt, sample nothing
    constraint: TokenConstraint | None
    loop: asyncio.AbstractEventLoop
    logprobs: LogprobRequest | None = None
    checkpoints: tuple[int, ...] = ()  # prompt lengths to save the state at
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel_event: threading.Event = field(default_factory=threading.Event)
    enqueued_at: float = field(default_factory=time.perf_counter)

    def put(self, item: object) -> None:
        """From the worker thread: hand an event (or an error, or the end) to the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop has closed (server shutting down): nobody is listening
            self.cancel_event.set()

    def cancel(self) -> None:
        self.cancel_event.set()

    async def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        """Events until the generator's last one; an error raised in the worker is raised here."""
        while True:
            item = await self.events.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class Scheduler:
    def __init__(self, generator: Generator, max_queue: int, metrics: Metrics,
                 on_pack_damage: Callable[[str], None] = lambda reason: None):
        self.generator = generator
        self.metrics = metrics
        self.max_queue = max_queue
        self.on_pack_damage = on_pack_damage
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._waiting = 0  # queued, not yet picked up
        self._running = 0  # 0 or 1
        self._lock = threading.Lock()

    @property
    def queue_depth(self) -> int:
        with self._lock:
            return self._waiting

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="flashpack-generate", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is None:
            return
        self._drain()
        self._jobs.put(None)
        self._thread.join(timeout)
        self._thread = None

    def submit(
        self, prompt_ids: list[int], params: SamplingParams | None, constraint: TokenConstraint | None = None,
        logprobs: LogprobRequest | None = None, checkpoints: tuple[int, ...] = (),
    ) -> Job:
        """Queue a generation, or with no `params` a prompt to score (call from the event loop); a
        full queue raises a 429."""
        job = Job(prompt_ids, params, constraint, asyncio.get_running_loop(), logprobs, checkpoints)
        with self._lock:
            if self._waiting + self._running > self.max_queue:
                raise ApiError(429, "the server is busy: too many requests are waiting; retry later", code="queue_full")
            self._waiting += 1
            self._jobs.put_nowait(job)
        return job

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self._waiting -= 1
                self._running += 1
            try:
                if job.cancel_event.is_set():
                    job.put(_END)  # its client left while it waited
                else:
                    self._generate(job)
            finally:
                with self._lock:
                    self._running -= 1

    def _generate(self, job: Job) -> None:
        self.metrics.generation_started(time.perf_counter() - job.enqueued_at)
        generated, finish, timings = 0, "error", None
        try:
            for event in self._events(job):
                generated += event.token_id is not None
                if event.finish_reason is not None:
                    finish, timings = event.finish_reason, event.timings
                job.put(event)
        except PackDamageError as error:
            log.error("the pack is damaged: %s", error)
            self.on_pack_damage(str(error))
            job.put(ApiError(500, f"the pack on disk is damaged: {error}", code="pack_damaged"))
        except FlashpackError as error:
            job.put(ApiError(400, str(error)))
        except Exception as error:  # one failing request must not take the worker down
            log.exception("generation failed")
            job.put(ApiError(500, f"generation failed: {type(error).__name__}: {error}"))
        finally:
            self.metrics.generation_finished(len(job.prompt_ids), generated, finish, timings)
            job.put(_END)

    def _events(self, job: Job) -> Iterator[GenerationEvent]:
        if job.params is None:
            return self.generator.score(job.prompt_ids, job.logprobs.top_n if job.logprobs else 0)
        return self.generator.stream(job.prompt_ids, job.params, job.constraint, job.cancel_event.is_set,
                                     logprobs=job.logprobs, checkpoints=job.checkpoints)

    def _drain(self) -> None:
        """Cancel everything still queued (shutdown)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                with self._lock:
                    self._waiting -= 1
                job.cancel()
                job.put(_END)
