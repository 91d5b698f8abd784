"""A step with marks (Qwen4ExpModel.forward's `marks`): the states after the step's first m tokens,
taken in one pass over the layers, are the states separate steps ending there leave (float32, CPU,
within a summation order); a follow-up continuing from one computes what the whole step did. With
checkpoints_in_one_step (an engine through a tiered store) a prompt with checkpoints is prefilled in
one step, each checkpoint saved from its mark, the MTP head's part included; without, a step a
segment. Controls: a mark state taken one token late differs; one whose DeltaNet part
is left at the step's end does not continue correctly; one whose PLE context is the step end's
differs."""

from __future__ import annotations

import pytest
import torch

from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.prefix_cache import PrefixCache
from flashpack.runtime.sampling import SamplingParams
from flashpack.runtime.store.config import StoreConfig

TOLERANCE = dict(rtol=1e-4, atol=1e-5)  # float32: the whole step and its segments sum in other orders


@pytest.fixture(scope="module")
def engine(tiny_pack):
    return load_engine(tiny_pack, EngineConfig(dtype="float32", prompt_cache_ram=0, speculate="off"))


def _ids(count: int, seed: int) -> list[int]:
    return torch.randint(5, 1000, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_states_close(found, expected) -> None:
    assert found.position == expected.position
    for layer, part in expected.deltanet.items():
        torch.testing.assert_close(found.deltanet[layer].recurrent, part.recurrent, **TOLERANCE)
        torch.testing.assert_close(found.deltanet[layer].conv, part.conv, **TOLERANCE)
    for layer, part in expected.ple.items():
        assert found.ple[layer].context.tolist() == part.context.tolist()
        torch.testing.assert_close(found.ple[layer].conv, part.conv, **TOLERANCE)
    for layer, cache in expected.attention.items():
        got = found.attention[layer]
        assert (got.length, got.blocks) == (cache.length, cache.blocks)
        for a, b in zip((got.keys, got.values, got.index_keys, got.block_keys),
                        (cache.keys, cache.values, cache.index_keys, cache.block_keys)):
            torch.testing.assert_close(a, b, **TOLERANCE)


def test_marked_states_are_the_states_of_steps_ending_there(engine):
    step, tokens, marks = engine.step, _ids(90, 0), [17, 40, 89]
    state = step.new_state()
    step.forward(torch.tensor(_ids(30, 1)), state)  # the step continues a sequence
    before = state.snapshot()
    whole = step.forward(torch.tensor(tokens), state, marks=marks)
    assert len(whole.marked) == len(marks)
    for mark, found in zip(marks, whole.marked):
        expected = before.snapshot()
        step.forward(torch.tensor(tokens[:mark]), expected)
        _assert_states_close(found, expected)
        # continuing from the mark computes what the whole step did for the tokens after it
        rest = step.forward(torch.tensor(tokens[mark:]), found.snapshot())
        assert float((rest.logits[-1] - whole.logits[-1]).norm() / whole.logits[-1].norm()) < 1e-4
    _assert_states_close(state, _after(step, before, tokens))


def _after(step, before, tokens):
    state = before.snapshot()
    step.forward(torch.tensor(tokens), state)
    return state


def test_control_a_mark_taken_one_token_late_differs(engine):
    step, tokens = engine.step, _ids(60, 2)
    state = step.new_state()
    found = step.forward(torch.tensor(tokens), state, marks=[31]).marked[0]
    late = _after(step, step.new_state(), tokens[:32])
    recurrent = next(iter(late.deltanet))
    assert not torch.allclose(found.deltanet[recurrent].recurrent, late.deltanet[recurrent].recurrent, **TOLERANCE)


def test_control_a_mark_whose_deltanet_part_is_the_step_end_does_not_continue(engine):
    step, tokens, mark = engine.step, _ids(60, 3), 25
    state = step.new_state()
    whole = step.forward(torch.tensor(tokens), state, marks=[mark])
    broken = whole.marked[0]
    for layer, part in state.deltanet.items():
        broken.deltanet[layer] = part.copy()
    rest = step.forward(torch.tensor(tokens[mark:]), broken)
    assert float((rest.logits[-1] - whole.logits[-1]).norm() / whole.logits[-1].norm()) > 1e-3


def test_control_a_mark_whose_ple_context_is_the_step_end_differs(engine, monkeypatch):
    """The PLE rows are gathered once for the whole step, which leaves the n-gram context at its end:
    a mark must take the context of its own position."""
    from flashpack.runtime.state import PLEState

    step, tokens, mark = engine.step, _ids(60, 5), 25
    expected = _after(step, step.new_state(), tokens[:mark])
    layer = next(iter(expected.ple))
    found = step.forward(torch.tensor(tokens), step.new_state(), marks=[mark]).marked[0]
    assert found.ple[layer].context.tolist() == expected.ple[layer].context.tolist()
    monkeypatch.setattr(PLEState, "at", lambda self, kept: PLEState(self.context.clone(), self.conv.clone()))
    late = step.forward(torch.tensor(tokens), step.new_state(), marks=[mark]).marked[0]
    assert late.ple[layer].context.tolist() != expected.ple[layer].context.tolist()


@pytest.mark.parametrize("marks", [[0], [5, 5], [7, 3], [60], [61]])
def test_marks_outside_the_step_or_out_of_order_are_refused(engine, marks):
    with pytest.raises(ValueError, match="marks"):
        engine.step.forward(torch.tensor(_ids(60, 4)), engine.step.new_state(), marks=marks)


def test_a_prompt_with_checkpoints_is_prefilled_in_one_step_and_each_is_restorable(engine, monkeypatch):
    """As through a tiered store (Generator.checkpoints_in_one_step)."""
    generator = engine.generator
    generator.prefix_cache, generator.checkpoints_in_one_step = PrefixCache(1 << 30), True
    steps = []
    forward = engine.step.forward
    monkeypatch.setattr(engine.step, "forward", lambda tokens, *a, **k: steps.append(len(tokens)) or forward(tokens, *a, **k))
    try:
        system, history, question = _ids(40, 5), _ids(30, 6), _ids(20, 7)
        prompt = system + history + question
        boundaries = [len(system), len(system + history)]
        generator.generate(prompt, SamplingParams(max_tokens=1), checkpoints=boundaries)
        assert steps == [len(prompt)]
        assert generator.prefix_cache.stats.saved == 3  # both boundaries and the prompt's end
        for end in boundaries:  # a prompt edited after a boundary restores it, and continues as a whole prefill
            edited = prompt[:end] + _ids(12, end)
            fresh = engine.step.new_state()
            assert generator.prefix_cache.restore_longest(edited, fresh) == end
            found = engine.step.forward(torch.tensor(edited[end:]), fresh).logits[-1]
            expected = forward(torch.tensor(edited), engine.step.new_state()).logits[-1]
            assert float((found - expected).norm() / expected.norm()) < 1e-4
    finally:
        generator.prefix_cache, generator.checkpoints_in_one_step = None, False


def test_without_one_step_checkpoints_a_prompt_is_prefilled_a_step_a_segment(engine, monkeypatch):
    generator = engine.generator
    generator.prefix_cache = PrefixCache(1 << 30)
    steps = []
    forward = engine.step.forward
    monkeypatch.setattr(engine.step, "forward", lambda tokens, *a, **k: steps.append(len(tokens)) or forward(tokens, *a, **k))
    try:
        generator.generate(_ids(90, 11), SamplingParams(max_tokens=1), checkpoints=[40, 70])
        assert steps == [40, 30, 20]
    finally:
        generator.prefix_cache = None


@pytest.mark.parametrize("setting, store, expected", [
    (None, False, False),  # a CPU engine without a store: a step a segment, a restore bit for bit
    (None, True, True),  # through a tiered store: each layer's experts fetched once
    (True, False, True),
    (False, True, False),
])
def test_checkpoints_in_one_step_follows_the_engine_config(tiny_pack, setting, store, expected):
    """EngineConfig.checkpoints_in_one_step reaches the generator; unset, the engine decides (a GPU
    engine takes one step too: tests/runtime/test_prefix_cache.py's GPU cases)."""
    store_config = StoreConfig(ram_budget="64MiB") if store else StoreConfig()
    engine = load_engine(tiny_pack, EngineConfig(dtype="float32", prompt_cache_ram=0, speculate="off",
                                                 checkpoints_in_one_step=setting, store=store_config))
    assert engine.generator.checkpoints_in_one_step is expected


def test_checkpoints_saved_while_the_mtp_head_runs_carry_its_part(tiny_pack):
    """The MTP head fills in its cache and pending input at each mark: a follow-up restoring an
    inner checkpoint gets MTP drafts (the head lines up with the state) and the plain output."""
    engine = load_engine(tiny_pack, EngineConfig(dtype="float32", prompt_cache_ram="64MiB", speculate="mtp"))
    engine.generator.speculation.policy, engine.generator.checkpoints_in_one_step = False, True
    system, question = _ids(40, 8), _ids(20, 9)
    engine.generator.generate(system + question, SamplingParams(max_tokens=2), checkpoints=[len(system)])
    fresh = engine.step.new_state()
    assert engine.generator.prefix_cache.restore_longest(system + _ids(10, 10), fresh) == len(system)
    head = engine.generator.speculation.drafters[0]
    assert fresh.mtp_input is not None and fresh.attention[head.layer].length == len(system) - 1
    follow_up = system + _ids(10, 10)
    steps_before = engine.generator.speculation.stats.by_drafter.get("mtp", {}).get("steps", 0)
    again = engine.generator.generate(follow_up, SamplingParams(max_tokens=12))
    assert again.cached_tokens == len(system)
    assert engine.generator.speculation.stats.by_drafter["mtp"]["steps"] > steps_before
    plain = load_engine(tiny_pack, EngineConfig(dtype="float32", prompt_cache_ram=0, speculate="off"))
    assert again.token_ids == plain.generator.generate(follow_up, SamplingParams(max_tokens=12)).token_ids
