"""A stored prompt state restored layer by layer as the disk delivers it, so that a stored hit's
read and the prefill of its new tokens overlap.

A stored entry holds each layer's parts in turn (state_codec.encode_state). The prefix cache
starts its read (StoredStates.arriving) and hangs an ArrivingState on the request's state; the
model, before each layer, restores that layer's parts once their bytes have landed
(SequenceState.arrive), and everything left before anything reads the state whole
(SequenceState.arrive_all: after the layers, or before a step the graphs run). So layer L's
compute is queued while the disk still reads the layers after it: the request waits for the read,
or for the prefill, not for both in turn.

A fault found partway (a frame failing its checksum, a truncated file) leaves the state part
restored: `layer` and `finish` then raise StoredStateLost, having let the read and its memory go,
and the generator prefills the prompt afresh, throwing away what the layers computed before. So no
request fails, and no answer comes from a state that was not read whole and checked (each layer's
frames pass their checksums before it is restored; tests/runtime/test_arriving_state.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from flashpack.runtime.state import SequenceState


class StoredStateLost(Exception):
    """A stored state found damaged or unreadable after its layers began to be restored."""


class ArrivingState:
    """`saved` (views of memory the read `read` fills: StoredStates.arriving) restored into `target`
    layer by layer. `ends`: each layer's end in that memory (state_codec.layer_ends). `done(saved,
    waited)`: called once it is all in, `waited` the seconds the request spent waiting for bytes;
    `lost(error)`: called where the read failed (or the state was let go first: `error` None),
    after which nothing writes into that memory."""

    def __init__(self, target: SequenceState, saved: SequenceState, read, ends: dict[int, int],
                 done: Callable[[SequenceState, float], None], lost: Callable[[BaseException | None], None]):
        self.target, self.saved, self.read = target, saved, read
        self._ends, self._done, self._lost = dict(ends), done, lost
        self.waited = 0.0
        target.begin_restore(saved)
        target.arriving = self

    def layer(self, layer: int) -> None:
        """`layer`'s parts, once their bytes are in."""
        end = self._ends.pop(layer, None)
        if end is None:
            return
        self._wait(lambda: self.read.wait(end))
        self.target.restore_layer(self.saved, layer)

    def finish(self) -> None:
        """The rest: every byte in and checked, every layer not yet restored, the MTP head's input."""
        self._wait(self.read.wait_all)
        for layer in sorted(self._ends):
            self.target.restore_layer(self.saved, layer)
        self._ends.clear()
        self.target.end_restore(self.saved)
        self._done(self.saved, self.waited)

    def abandon(self) -> None:
        """Let the read go unfinished (the target is being reset)."""
        self.read.cancel()
        self._lost(None)

    def _wait(self, until: Callable[[], None]) -> None:
        start = time.perf_counter()
        try:
            until()
        except Exception as error:
            self.target.arriving = None
            self.read.cancel()
            self._lost(error)
            raise StoredStateLost(f"a stored prompt state failed partway through its read: {error}") from error
        finally:
            self.waited += time.perf_counter() - start
