"""The live prompt states' pinned arena (runtime/engine/pinned_arena.py): its free ranges against a
byte map on random takes and gives; host copies that are exact, aligned, disjoint and give their
range back once garbage; a prefix cache that makes room by evicting its least recently used host
entries. On a CPU the arena is plain memory (pin=False): the bookkeeping and the copies are the
same; tests/runtime/test_prefix_cache.py runs the pinned one on a GPU."""

from __future__ import annotations

import gc
import random
import time

import pytest
import torch

from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.pinned_arena import ALIGNMENT, FreeRanges, PinnedArena, aligned
from flashpack.runtime.engine.prefix_cache import PrefixCache


@pytest.fixture(scope="module")
def engine(tiny_pack):
    return load_engine(tiny_pack, EngineConfig(dtype="float32"))


def _state(engine, tokens: int, seed: int):
    state = engine.step.new_state()
    ids = torch.randint(5, 1000, (tokens,), generator=torch.Generator().manual_seed(seed))
    engine.step.forward(ids, state)
    return state


def _copy_bytes(state) -> int:
    return sum(aligned(t.numel() * t.element_size()) for t in state.device_tensors())


def test_free_ranges_match_a_byte_map_on_random_takes_and_gives():
    capacity, rng = 4096, random.Random(0)
    ranges, used, taken = FreeRanges(capacity), [False] * capacity, []
    for _ in range(2000):
        if taken and rng.random() < 0.5:
            offset, size = taken.pop(rng.randrange(len(taken)))
            ranges.give(offset, size)
            used[offset:offset + size] = [False] * size
        else:
            size = rng.randint(1, 600)
            offset = ranges.take(size)
            first_fit = next((start for start in range(capacity - size + 1)
                              if not any(used[start:start + size])), None)
            # first fit over merged free ranges is the lowest free run of that length
            assert offset == first_fit
            if offset is not None:
                used[offset:offset + size] = [True] * size
                taken.append((offset, size))
        assert ranges.free_bytes() == used.count(False)
    for offset, size in taken:
        ranges.give(offset, size)
    assert ranges.free_bytes() == ranges.largest() == capacity  # merged back into one range


def test_free_ranges_refuse_a_range_given_back_twice():
    ranges = FreeRanges(1000)
    offset = ranges.take(100)
    ranges.give(offset, 100)
    with pytest.raises(ValueError, match="given back twice"):
        ranges.give(offset, 100)


def test_a_host_copy_is_exact_aligned_and_disjoint_from_the_next(engine):
    arena = PinnedArena(4 << 20, pin=False)
    arena.data.fill_(0xFF)  # poisoned: a byte the copy misses reads as NaN
    state = _state(engine, 40, 1)
    first, second = arena.host_copy(state), arena.host_copy(_state(engine, 40, 2))
    start, end = arena.data.data_ptr(), arena.data.data_ptr() + arena.capacity
    for got, want in zip(first.device_tensors(), state.device_tensors()):
        assert torch.equal(got, want)
        assert start <= got.data_ptr() < end and (got.data_ptr() - start) % ALIGNMENT == 0
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for copy in (first, second) for t in copy.device_tensors() if t.numel()]
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    # the copy restores as the snapshot does
    fresh, again = engine.step.new_state(), engine.step.new_state()
    fresh.restore(first)
    again.restore(state.snapshot())
    token = torch.tensor([7])
    assert torch.equal(engine.step.forward(token, fresh).logits, engine.step.forward(token, again).logits)


def test_a_restore_from_a_host_copy_reads_only_contiguous_sources(engine):
    """A snapshot's attention buffers round up to the block ratio, so after a length that is not a
    multiple of it all heads' keys together are strided; a strided pinned source is gathered into
    pageable memory before it crosses to the GPU, at a fraction of the link's rate. Every copy the
    restore makes must read one contiguous run.
    Control: the filled keys of all heads at once are strided."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sources(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.strided = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default and not args[1].is_contiguous():
                self.strided.append(tuple(args[1].shape))
            return func(*args, **(kwargs or {}))

    arena = PinnedArena(4 << 20, pin=False)
    state = _state(engine, 41, 4)
    host = arena.host_copy(state)
    cache = next(iter(host.attention.values()))
    assert cache.capacity > cache.length and cache.keys.shape[0] > 1 and not cache.keys.is_contiguous()
    fresh, again = engine.step.new_state(), engine.step.new_state()
    with Sources() as sources:
        fresh.restore(host)
    assert sources.strided == []
    again.restore(state.snapshot())
    token = torch.tensor([7])
    assert torch.equal(engine.step.forward(token, fresh).logits, engine.step.forward(token, again).logits)


def test_a_host_copy_gives_its_range_back_once_garbage(engine):
    arena = PinnedArena(4 << 20, pin=False)
    state = _state(engine, 40, 3)
    copy = arena.host_copy(state)
    assert arena.free_bytes() == arena.capacity - _copy_bytes(state)
    held = [copy]  # a stored write still encoding it
    del copy
    gc.collect()
    assert arena.free_bytes() < arena.capacity
    held.clear()
    assert arena.free_bytes() == arena.capacity


def test_a_host_copy_that_does_not_fit_or_fails_takes_nothing(engine, monkeypatch):
    from flashpack.runtime.state import SequenceState

    state = _state(engine, 40, 4)
    small = PinnedArena(_copy_bytes(state) - ALIGNMENT, pin=False)
    assert small.host_copy(state) is None and small.free_bytes() == small.capacity
    arena = PinnedArena(4 << 20, pin=False)

    def failing(self, device, pin=False, allocate=None):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(SequenceState, "to", failing)
    with pytest.raises(RuntimeError, match="copy failed"):
        arena.host_copy(state)
    assert arena.free_bytes() == arena.capacity


def test_the_cache_evicts_least_recent_host_entries_to_make_room(engine):
    states = [_state(engine, 40, seed) for seed in range(3)]
    size = _copy_bytes(states[0])
    arena = PinnedArena(2 * size + ALIGNMENT, pin=False)  # room for two copies, not three
    cache = PrefixCache(1 << 30, pinned=arena)
    for index, state in enumerate(states):
        key = f"40-{index:016x}"
        copy = cache._host_copy(key, state)
        assert copy is not None
        cache._keep(key, 40, copy, write=False)
        del copy  # the entry holds it now
    assert list(cache._live) == ["40-0000000000000001", "40-0000000000000002"]  # the first made room
    assert cache.stats.evicted == 1
    lone = PrefixCache(1 << 30, pinned=PinnedArena(size - ALIGNMENT, pin=False))
    assert lone._host_copy("40-0000000000000009", states[0]) is None  # nothing to evict: dropped


def test_an_arena_that_cannot_be_pinned_whole_halves_then_gives_one_clear_error(monkeypatch):
    from flashpack.errors import FlashpackError
    from flashpack.runtime.engine import pinned_arena

    limit = [100 << 20]  # what the machine lets us pin

    def register(data):
        if data.numel() > limit[0]:
            raise RuntimeError("cudaHostRegister failed (CUDA error 2)")

    monkeypatch.setattr(pinned_arena, "_register", register)
    monkeypatch.setattr(pinned_arena, "_unregister", lambda data: None)
    assert PinnedArena.pinned(400 << 20).capacity == 100 << 20
    limit[0] = 0
    with pytest.raises(FlashpackError, match="could not pin 0.4 GiB .* --prompt-cache-ram"):
        PinnedArena.pinned(400 << 20)


def _stored_tier(tmp_path, release=None):
    """A StoredStates tier whose writer waits for `release` (a threading.Event) before each write."""
    from flashpack.runtime.engine.stored_states import StoredStates

    stored = StoredStates(tmp_path, 1 << 30, "fingerprint")
    if release is not None:
        write = stored._write

        def held_write(*args):
            release.wait(10)
            write(*args)

        stored._write = held_write
    return stored


def _in(arena: PinnedArena, state) -> bool:
    return 0 <= state.device_tensors()[0].data_ptr() - arena.data.data_ptr() < arena.capacity


def test_a_state_too_large_for_the_arena_is_still_stored_from_a_copy_of_its_own(engine, tmp_path):
    """An arena smaller than a state (a tiered store's spare RAM can leave one): every saved state
    still reaches the disk, from a pageable copy; one neither stored nor live is not copied."""
    state = _state(engine, 40, 5)
    stored = _stored_tier(tmp_path)
    arena = PinnedArena(_copy_bytes(state) - ALIGNMENT, pin=False)
    cache = PrefixCache(1 << 30, stored=stored, pinned=arena)
    host, written = cache._host_copies("40-0000000000000005", state, write=True)
    assert host is written is not None and not _in(arena, host)
    assert cache._host_copies("40-0000000000000005", state, write=False) == (None, None)
    stored.put("40-0000000000000005", 40, written)
    stored.flush()
    back, follow = engine.step.new_state(), torch.tensor([11, 12, 13])
    back.restore(stored.get("40-0000000000000005", state))
    assert torch.equal(engine.step.forward(follow, back).logits, engine.step.forward(follow, state).logits)
    stored.close()


@pytest.mark.parametrize("writes_queued", [True, False], ids=["queued", "control-evicts-first"])
def test_while_queued_writes_hold_the_arena_a_copy_goes_to_pageable_memory_and_evicts_nothing(
        engine, tmp_path, writes_queued):
    """Room for two states: one live, one evicted whose write (held up) still holds its block. The
    next copy neither waits for that write nor evicts the live entry: it lands in pageable memory,
    the same values. Evicting first (the control, as if no write were queued) takes the live
    entry's block and loses the entry."""
    import threading

    live, evicted, new = (_state(engine, 40, seed) for seed in (8, 9, 10))
    release = threading.Event()
    stored = _stored_tier(tmp_path, release)
    arena = PinnedArena(2 * _copy_bytes(live) + ALIGNMENT, pin=False)
    cache = PrefixCache(1 << 30, stored=stored, pinned=arena)
    host = cache._host_copies("40-0000000000000008", live, write=False)[0]
    cache._keep("40-0000000000000008", 40, host, write=False)
    written = cache._host_copies("40-0000000000000009", evicted, write=True)[1]
    stored.put("40-0000000000000009", 40, written)
    del host, written  # the live entry and the queued write hold the blocks now
    if not writes_queued:
        stored.pending_bytes = lambda: 0
    cache._keep("40-000000000000000a", 40, new, write=False)  # live (from its device copy, on a GPU)
    start = time.monotonic()
    host, written = cache._host_copies("40-000000000000000a", new, write=True)
    assert time.monotonic() - start < 5  # nothing waited for the held-up write (its writer waits 10 s)
    assert host is written is not None
    assert all(torch.equal(a, b) for a, b in zip(host.device_tensors(), new.device_tensors()))
    assert _in(arena, host) != writes_queued  # the control took the live entry's block
    assert ("40-0000000000000008" in cache._live) == writes_queued
    release.set()
    stored.close()


def test_the_writer_lets_go_of_a_state_once_written(engine, tmp_path):
    """A state's arena block comes back when its write is done (flush), not when the next write
    arrives: the copy after it lands in the arena."""
    state, other = _state(engine, 40, 11), _state(engine, 40, 12)
    stored = _stored_tier(tmp_path)
    arena = PinnedArena(_copy_bytes(state) + ALIGNMENT, pin=False)
    cache = PrefixCache(1 << 30, stored=stored, pinned=arena)
    written = cache._host_copies("40-000000000000000b", state, write=True)[1]
    assert _in(arena, written)
    stored.put("40-000000000000000b", 40, written)
    del written
    stored.flush()
    assert _in(arena, cache._host_copies("40-000000000000000c", other, write=True)[0])
    stored.close()
