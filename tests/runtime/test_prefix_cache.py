"""Prompt-state reuse (runtime/engine/prefix_cache.py): a follow-up restores the saved state of its
own first tokens and prefills the rest, with logits bit-identical (FP32, CPU) to the same tokens run
without the cache in the same segments; a restore that drops a part of the state (the control) does
not pass; message boundaries let an edited last message keep everything before it; live entries
stay under their byte budget, least recently used evicted first."""

from __future__ import annotations

import pytest
import torch
from state_controls import restore_without

from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.pinned_arena import PinnedArena
from flashpack.runtime.engine.prefix_cache import PrefixCache, prefix_digests
from flashpack.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_pack):
    return load_engine(tiny_pack, EngineConfig(dtype="float32"))


def _ids(count: int, seed: int) -> list[int]:
    return torch.randint(5, 1000, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _turns(step, first: list[int], reply: list[int], new: list[int], cache: PrefixCache | None) -> torch.Tensor:
    """A first prompt, its reply decoded token by token, then a follow-up's new tokens: the
    follow-up's logits, restored from `cache` when given (the first turn saved there)."""
    state = step.new_state()
    step.forward(torch.tensor(first), state)
    if cache is not None:
        cache.save(first, state)
    for token in reply:
        step.forward(torch.tensor([token]), state)
    if cache is None:
        return step.forward(torch.tensor(new), state).logits
    cache.save(first + reply, state)
    follow_up, fresh = first + reply + new, step.new_state()
    assert cache.restore_longest(follow_up, fresh) == len(first + reply)
    return step.forward(torch.tensor(new), fresh).logits


def test_a_follow_up_restores_its_prefix_and_computes_the_same_logits(engine):
    first, reply, new = _ids(70, 0), _ids(6, 1), _ids(25, 2)
    cache = PrefixCache(1 << 30)
    restored = _turns(engine.step, first, reply, new, cache)
    expected = _turns(engine.step, first, reply, new, None)
    assert torch.equal(restored, expected)
    assert cache.stats.hits == 1 and cache.stats.tokens_reused == len(first + reply)
    # against one prefill of the whole follow-up: another summation order only
    whole = engine.step.forward(torch.tensor(first + reply + new), engine.step.new_state()).logits[-len(new):]
    assert float((restored - whole).norm() / whole.norm()) < 1e-4


@pytest.mark.parametrize("dropped", ["ple", "deltanet", "attention"])
def test_control_a_restore_that_drops_part_of_the_state_differs(engine, monkeypatch, dropped):
    first, reply, new = _ids(70, 0), _ids(6, 1), _ids(25, 2)
    expected = _turns(engine.step, first, reply, new, None)
    restore_without(monkeypatch, dropped)
    restored = _turns(engine.step, first, reply, new, PrefixCache(1 << 30))
    assert float((restored - expected).norm() / expected.norm()) > 1e-3


def test_an_edited_last_message_restores_the_boundary_before_it(engine):
    """The prompt is prefilled in segments ending at its checkpoints, each saved: a prompt that
    differs only after the last boundary restores it, and one that differs earlier restores less. A
    checkpoint too near the one before it or the prompt's end (MIN_SEGMENT) is not worth its forward,
    but for the last, where the reply's turn opens: a regenerated reply restores all before it."""
    generator = engine.generator
    generator.prefix_cache = PrefixCache(1 << 30)
    try:
        system, history, question = _ids(40, 3), _ids(30, 4), _ids(20, 5)
        boundaries = [len(system), len(system) + 3, len(system + history), len(system + history + question) - 2]
        params = SamplingParams(max_tokens=3)
        first = generator.generate(system + history + question, params, checkpoints=boundaries)
        assert first.cached_tokens == 0
        edited = generator.generate(system + history + _ids(19, 6), params, checkpoints=boundaries)
        assert edited.cached_tokens == len(system + history)
        earlier = generator.generate(system + _ids(30, 7) + question, params, checkpoints=boundaries)
        assert earlier.cached_tokens == len(system)
        again = generator.generate(system + history + question + first.token_ids[:-1] + _ids(5, 8), params)
        assert again.cached_tokens == len(system + history + question) + len(first.token_ids) - 1
        regenerated = generator.generate(system + history + question[:-2] + _ids(2, 9), params, checkpoints=boundaries)
        assert regenerated.cached_tokens == boundaries[-1]  # the last boundary, two tokens from the end
    finally:
        generator.prefix_cache = None


def test_a_restored_entry_is_not_changed_by_the_sequence_that_restored_it(engine):
    """Entries are copies: two requests sharing a prefix each continue from the same saved state."""
    cache, prompt = PrefixCache(1 << 30), _ids(50, 9)
    state = engine.step.new_state()
    engine.step.forward(torch.tensor(prompt), state)
    cache.save(prompt, state)
    outputs = []
    for _ in range(2):
        fresh = engine.step.new_state()
        assert cache.restore_longest(prompt + [11, 12], fresh) == len(prompt)
        outputs.append(engine.step.forward(torch.tensor([11, 12]), fresh).logits)
        engine.step.forward(torch.tensor(_ids(20, 10)), fresh)  # the sequence goes on, the entry stays
    assert torch.equal(outputs[0], outputs[1])


def test_live_entries_stay_under_their_budget_least_recent_first(engine):
    prompts = [_ids(30, seed) for seed in range(3)]
    states = []
    for prompt in prompts:
        state = engine.step.new_state()
        engine.step.forward(torch.tensor(prompt), state)
        states.append(state)
    size = states[0].snapshot().nbytes()
    cache = PrefixCache(2 * size)
    for prompt, state in zip(prompts, states):
        cache.save(prompt, state)
    assert cache.stats.live_entries == 2 and cache.stats.evicted == 1 and cache.stats.live_bytes <= 2 * size
    assert cache.restore_longest(prompts[0] + [5], engine.step.new_state()) == 0  # the oldest went first
    assert cache.restore_longest(prompts[2] + [5], engine.step.new_state()) == len(prompts[2])
    with pytest.raises(ValueError, match="needs a state at that position"):
        cache.save(prompts[0][:10], states[0])


def test_prefix_digests_are_the_digests_of_each_prefix():
    import xxhash

    tokens = _ids(100, 11)
    digests = prefix_digests(tokens, [1, 64, 100, 64])
    for length, digest in digests.items():
        assert digest == xxhash.xxh64(torch.tensor(tokens[:length], dtype=torch.int64).numpy().tobytes()).intdigest()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copies to pinned memory are a GPU's")
def test_on_a_gpu_a_save_is_live_at_once_and_moves_to_pinned_host_memory(tiny_pack):
    """A save on a GPU returns before its host copy is made: the entry restores from its device copy
    while the copier thread works, and from pinned host memory once flushed, the same logits both
    ways. Its sequence going on does not change it (the copy is of the state when saved). The host
    copy lies in the cache's pinned arena.

    Against the sequence run on without a save (the same kernels) the restored logits agree to
    FP32's rounding; against one prefill of all 302 tokens to TF32's: that prefill runs its DeltaNet
    layers by fla's chunked rule, whose float32 dot products are TF32 on Hopper, where the two new
    tokens take the recurrent kernel in full FP32 (4.1e-4 apart on an H100)."""
    engine = load_engine(tiny_pack, EngineConfig(device="cuda", dtype="float32", prompt_cache_ram=0, speculate="off"))
    try:
        arena = PinnedArena(256 << 20)
        step, cache, prompt = engine.step, PrefixCache(1 << 30, pinned=arena), _ids(300, 11)
        state = step.new_state()
        step.forward(torch.tensor(prompt), state)
        cache.save(prompt, state)
        step.forward(torch.tensor(_ids(40, 12)), state)  # the sequence goes on, the entry stays
        outputs = []
        for flushed in (False, True):
            if flushed:
                cache.flush()
                recurrent = next(iter(next(iter(cache._live.values())).state.deltanet.values())).recurrent
                assert not recurrent.is_cuda and recurrent.is_pinned()
                assert 0 <= recurrent.data_ptr() - arena.data.data_ptr() < arena.capacity
            fresh = step.new_state()
            assert cache.restore_longest(prompt + [11, 12], fresh) == len(prompt)
            outputs.append(step.forward(torch.tensor([11, 12]), fresh).logits)
        unsaved = step.new_state()
        step.forward(torch.tensor(prompt), unsaved)
        continued = step.forward(torch.tensor([11, 12]), unsaved).logits
        whole = step.forward(torch.tensor(prompt + [11, 12]), step.new_state()).logits[-2:]
        assert torch.equal(outputs[0], outputs[1])
        assert float((outputs[0] - continued).norm() / continued.norm()) < 1e-5
        assert float((outputs[0] - whole).norm() / whole.norm()) < 2e-3
        cache.close()
    finally:
        engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copies to pinned memory are a GPU's")
def test_on_a_gpu_an_entry_whose_host_copy_fails_is_dropped_and_the_copier_goes_on(tiny_pack, monkeypatch):
    from flashpack.runtime.state import SequenceState

    engine = load_engine(tiny_pack, EngineConfig(device="cuda", dtype="float32", prompt_cache_ram=0, speculate="off"))
    try:
        step, cache, prompt = engine.step, PrefixCache(1 << 30, pinned=PinnedArena(64 << 20)), _ids(60, 13)
        state = step.new_state()
        step.forward(torch.tensor(prompt), state)
        real = SequenceState.to

        def failing(self, device, pin=False, allocate=None):
            raise RuntimeError("CUDA error: out of memory (pinned)")

        monkeypatch.setattr(SequenceState, "to", failing)
        cache.save(prompt, state)
        cache.flush()  # returns: the copier took the failure
        assert cache.stats.live_entries == 0 and cache.stats.live_bytes == 0
        assert cache.restore_longest(prompt + [5], step.new_state()) == 0
        monkeypatch.setattr(SequenceState, "to", real)
        cache.save(prompt, state)
        cache.flush()
        assert cache.restore_longest(prompt + [5], step.new_state()) == len(prompt)
        cache.close()
    finally:
        engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copies to pinned memory are a GPU's")
def test_on_a_gpu_an_engine_keeps_a_requests_checkpoints_in_the_arena_it_pinned_at_start(tiny_pack):
    """Nothing is pinned while a request runs: the engine's prefix cache has its arena from the
    start, and every live entry a request left lies in it once the copier is done."""
    engine = load_engine(tiny_pack, EngineConfig(device="cuda", dtype="float32", prompt_cache_ram="64MiB",
                                                 speculate="off"))
    try:
        cache = engine.generator.prefix_cache
        arena = cache.pinned
        assert arena is not None and arena.capacity == cache.ram_budget == 64 << 20
        assert arena.free_bytes() == arena.capacity
        prompt = _ids(200, 14)
        engine.generator.generate(prompt, SamplingParams(max_tokens=4), checkpoints=[60, 120])
        cache.flush()
        assert cache.stats.live_entries >= 3  # two checkpoints, the prompt, the reply
        start, end = arena.data.data_ptr(), arena.data.data_ptr() + arena.capacity
        for entry in cache._live.values():
            for tensor in entry.state.device_tensors():
                assert not tensor.is_cuda and start <= tensor.data_ptr() < end
        assert arena.free_bytes() < arena.capacity
    finally:
        engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned arena is a GPU's")
def test_on_a_gpu_a_stored_hit_is_read_into_the_arena_and_stays_live_there(tiny_pack, tmp_path):
    config = EngineConfig(device="cuda", dtype="float32", prompt_cache_ram="64MiB", prompt_cache_dir=str(tmp_path),
                          speculate="off")
    prompt, params = _ids(80, 15), SamplingParams(max_tokens=4)
    first = load_engine(tiny_pack, config)
    try:
        first.generator.generate(prompt, params)
    finally:
        first.close()
    second = load_engine(tiny_pack, config)
    try:
        follow_up = prompt + [11, 12, 13]
        result = second.generator.generate(follow_up, params)
        cache = second.generator.prefix_cache
        assert result.cached_tokens == len(prompt) and cache.stats.stored_hits == 1
        arena = cache.pinned
        start, end = arena.data.data_ptr(), arena.data.data_ptr() + arena.capacity
        restored = next(entry.state for entry in cache._live.values() if entry.length == len(prompt))
        assert all(start <= t.data_ptr() < end for t in restored.device_tensors() if t.numel())
        second.generator.prefix_cache = None  # the same request with no reuse
        assert second.generator.generate(follow_up, params).token_ids == result.token_ids
        second.generator.prefix_cache = cache
    finally:
        second.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copier thread and its pinned arena are a GPU's")
def test_on_a_gpu_a_live_share_of_one_state_keeps_the_newest_live_and_stores_every_one(tiny_pack, tmp_path):
    """A live budget (and arena) with room for one state and saves in a row (a prompt's checkpoints,
    then its reply's): the newest ends live, in the arena or, while the write of the one before still
    holds its block, in pageable memory, and every one is stored."""
    from flashpack.runtime.engine.pinned_arena import aligned
    from flashpack.runtime.engine.stored_states import StoredStates

    engine = load_engine(tiny_pack, EngineConfig(device="cuda", dtype="float32", prompt_cache_ram=0, speculate="off"))
    try:
        step, prompt = engine.step, _ids(120, 16)
        whole = step.new_state()
        step.forward(torch.tensor(prompt), whole)
        largest = sum(aligned(t.numel() * t.element_size()) for t in whole.snapshot().device_tensors())
        stored = StoredStates(tmp_path, 1 << 30, "fingerprint")
        room = largest * 3 // 2  # one state, not two: the live budget and its arena, as an engine sizes them
        cache = PrefixCache(room, stored=stored, pinned=PinnedArena(room))
        state = step.new_state()
        step.forward(torch.tensor(prompt[:100]), state)
        cache.save(prompt[:100], state)
        for token in prompt[100:]:
            step.forward(torch.tensor([token]), state)
            if state.position % 10 == 0:
                cache.save(prompt[:state.position], state)
        cache.flush()
        assert [entry.length for entry in cache._live.values()] == [120]
        assert sorted(int(key.split("-")[0]) for key in stored.keys()) == [100, 110, 120]
        assert cache.restore_longest(prompt + [5], step.new_state()) == 120 and cache.stats.stored_hits == 0
        cache.close()
    finally:
        engine.close()
