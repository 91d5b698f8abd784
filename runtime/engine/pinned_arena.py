"""Pinned host memory for the live prompt states, pinned once when the engine starts.

Pinning memory (cudaHostAlloc) holds the CUDA driver while it runs: every other thread's kernel
launch waits for it. Pinned per entry as the prefix cache's copier moved each checkpoint to the
host, those allocations landed in the middle of the next request's prefill and held up its
launches for most of its time to first token. So the live entries' whole budget is pinned in one
piece when the engine is built, and each host copy takes a range of it: no pinning while a
request runs. The piece is registered with the driver (cudaHostRegister) rather than taken from
torch's pinned allocator, which rounds every allocation up to a power of two: 6.4 GB would pin 8 GiB.

`FreeRanges` is the bookkeeping, plain Python: first fit over the free ranges kept in offset
order, merged with their neighbours when given back. `PinnedArena` hands out `ArenaBlock`s: a
device state's host copy in one block, its tensors views of the arena, or a stored state read
straight into one; a block goes back once the host state it holds is garbage (`weakref.finalize`),
so anything still reading it (a stored write encoding it) keeps it.
"""

from __future__ import annotations

import bisect
import math
import threading
import weakref

import torch

from flashpack.errors import FlashpackError
from flashpack.runtime.state import SequenceState

ALIGNMENT = 512  # each tensor of a host copy starts on this many bytes: any dtype's view of it is aligned
SMALLEST_ARENA = 64 << 20  # pinning is halved down to this after a failure, then given up


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


class FreeRanges:
    """The free byte ranges of a block of `capacity` bytes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._starts: list[int] = [0] if capacity else []
        self._sizes: list[int] = [capacity] if capacity else []

    def take(self, nbytes: int) -> int | None:
        """The offset of a range of `nbytes` now taken (the lowest that fits), None where none fits."""
        for index, size in enumerate(self._sizes):
            if size >= nbytes:
                offset = self._starts[index]
                if size == nbytes:
                    del self._starts[index], self._sizes[index]
                else:
                    self._starts[index] += nbytes
                    self._sizes[index] -= nbytes
                return offset
        return None

    def give(self, offset: int, nbytes: int) -> None:
        """Give back a range `take` returned, merged with the free ranges it touches."""
        index = bisect.bisect_left(self._starts, offset)
        if index < len(self._starts) and self._starts[index] < offset + nbytes or (
                index and self._starts[index - 1] + self._sizes[index - 1] > offset):
            raise ValueError(f"range {offset}+{nbytes} overlaps a free range: given back twice?")
        if index < len(self._starts) and self._starts[index] == offset + nbytes:  # the next one
            nbytes += self._sizes[index]
            del self._starts[index], self._sizes[index]
        if index and self._starts[index - 1] + self._sizes[index - 1] == offset:  # the one before
            self._sizes[index - 1] += nbytes
            return
        self._starts.insert(index, offset)
        self._sizes.insert(index, nbytes)

    def free_bytes(self) -> int:
        return sum(self._sizes)

    def largest(self) -> int:
        return max(self._sizes, default=0)


class PinnedArena:
    """`capacity` bytes of host memory (pinned with `pin`), handed out as host copies of states."""

    def __init__(self, capacity: int, pin: bool = True):
        self.data = torch.empty(capacity, dtype=torch.uint8)
        if pin and capacity:
            _register(self.data)
            weakref.finalize(self, _unregister, self.data)  # before the memory goes back
        self._ranges = FreeRanges(capacity)
        self._lock = threading.Lock()  # the copier takes, whichever thread drops a copy gives back

    @property
    def capacity(self) -> int:
        return self._ranges.capacity

    @classmethod
    def pinned(cls, capacity: int) -> PinnedArena:
        """An arena of `capacity` bytes, or of the most that could be pinned, halving down to
        SMALLEST_ARENA (a machine short of pinnable memory still reuses prompts, fewer of them)."""
        size = capacity
        while True:
            try:
                return cls(size)
            except RuntimeError as error:
                if size // 2 < SMALLEST_ARENA:
                    raise FlashpackError(f"could not pin {capacity / 2**30:.1f} GiB of host memory for the live prompt "
                                         f"states ({error}); give --prompt-cache-ram a smaller size, or 0") from None
                size //= 2

    def free_bytes(self) -> int:
        with self._lock:
            return self._ranges.free_bytes()

    def block(self, nbytes: int) -> ArenaBlock | None:
        """A block of `nbytes`, None where no free range is that large."""
        with self._lock:
            offset = self._ranges.take(nbytes)
        return None if offset is None else ArenaBlock(self, offset, nbytes)

    def host_copy(self, state: SequenceState) -> SequenceState | None:
        """A host copy of the device state `state` in one block, its copies queued on the current
        stream (synchronize it before reading the copy); None where no free range is large enough."""
        block = self.block(sum(aligned(t.numel() * t.element_size()) for t in state.device_tensors()))
        if block is None:
            return None
        cursor = 0

        def allocate(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
            nonlocal cursor
            size = math.prod(shape) * dtype.itemsize
            if cursor + size > block.nbytes:
                raise AssertionError("a host copy moved more than state.device_tensors() names")
            view = block.data[cursor:cursor + size].view(dtype).view(shape)
            cursor += aligned(size)
            return view

        try:
            copy = state.to(torch.device("cpu"), pin=True, allocate=allocate)
        except BaseException:
            block.release()
            raise
        block.held_by(copy)
        return copy

    def _give(self, offset: int, nbytes: int) -> None:
        with self._lock:
            self._ranges.give(offset, nbytes)


class ArenaBlock:
    """`nbytes` of an arena (`data`, uint8), until `release` or until what `held_by` names is garbage."""

    def __init__(self, arena: PinnedArena, offset: int, nbytes: int):
        self.data = arena.data[offset:offset + nbytes]
        self.nbytes = nbytes
        self._give = (arena._give, offset, nbytes)
        self._done = False

    def held_by(self, owner: object) -> None:
        """Give the block back once `owner` (a host state made of views of it) is garbage."""
        self._settle()
        weakref.finalize(owner, *self._give)

    def release(self) -> None:
        """Give the block back now: nothing reads it."""
        self._settle()
        give, offset, nbytes = self._give
        give(offset, nbytes)

    def _settle(self) -> None:
        if self._done:
            raise ValueError("this block was given away already")
        self._done = True


def _register(data: torch.Tensor) -> None:
    error = int(torch.cuda.cudart().cudaHostRegister(data.data_ptr(), data.numel(), 0))
    if error:
        raise RuntimeError(f"cudaHostRegister of {data.numel()} bytes failed (CUDA error {error})")


def _unregister(data: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(data.data_ptr())
