"""Speculative decoding (runtime/engine/speculative.py) is lossless: greedy output with drafts checked
in one step equals one-token decoding, with prompt lookup's own drafts, with a drafter that is always
wrong (every step rolled back) and with one that is always right (every draft accepted); a rollback
that skips part of the state (the control) changes the output. The policy stops drafting where a
checked step yields fewer tokens a second than plain steps."""

from __future__ import annotations

import pytest
import torch
from state_controls import restore_without

from flashpack.runtime.engine import speculative
from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.speculative import SpeculativeDecoder
from flashpack.runtime.sampling import SamplingParams

TOKENS = 40


@pytest.fixture(scope="module")
def engine(tiny_pack):
    return load_engine(tiny_pack, EngineConfig(dtype="float32", prompt_cache_ram=0))


@pytest.fixture
def always_drafting(monkeypatch):
    """The policy never backs off: every step with drafts is checked."""
    monkeypatch.setattr(speculative, "BACKOFF_TOKENS", 0)


def _prompt() -> list[int]:
    phrase = torch.randint(5, 1000, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    return phrase * 4  # repeated: prompt lookup has something to propose


def _generate(engine, decoder: SpeculativeDecoder | None) -> list[int]:
    engine.generator.speculation = decoder
    try:
        return engine.generator.generate(_prompt(), SamplingParams(max_tokens=TOKENS)).token_ids
    finally:
        engine.generator.speculation = None


def test_lookup_drafts_give_the_plain_greedy_output(engine, always_drafting):
    plain = _generate(engine, None)
    decoder = SpeculativeDecoder(engine.step)
    assert _generate(engine, decoder) == plain
    assert decoder.stats.steps > 0


def test_a_drafter_always_wrong_or_always_right_gives_the_plain_output(engine, always_drafting, monkeypatch):
    plain = _generate(engine, None)
    context_length = len(_prompt())
    monkeypatch.setattr(speculative, "propose", lambda context, n, k: [(plain[len(context) - context_length] + 1) % 997] * k)
    wrong = SpeculativeDecoder(engine.step)
    assert _generate(engine, wrong) == plain
    assert wrong.stats.accepted == 0 and wrong.stats.rollbacks == wrong.stats.steps > 0
    monkeypatch.setattr(speculative, "propose", lambda context, n, k: plain[len(context) - context_length:][:k])
    right = SpeculativeDecoder(engine.step)
    assert _generate(engine, right) == plain
    assert right.stats.accepted == right.stats.drafted > 0 and right.stats.rollbacks == 0
    assert right.stats.to_dict()["tokens_per_step"] > 3


@pytest.mark.parametrize("skipped", ["ple", "deltanet"])
def test_control_a_rollback_that_skips_part_of_the_state_changes_the_output(engine, always_drafting, monkeypatch,
                                                                          skipped):
    plain = _generate(engine, None)
    context_length = len(_prompt())
    monkeypatch.setattr(speculative, "propose", lambda context, n, k: [(plain[len(context) - context_length] + 1) % 997] * k)
    restore_without(monkeypatch, skipped)
    assert _generate(engine, SpeculativeDecoder(engine.step)) != plain


def test_the_policy_stops_drafting_where_checking_costs_more_than_it_yields(engine, monkeypatch):
    decoder = SpeculativeDecoder(engine.step)
    decoder._plain_seconds = 0.01
    decoder._judge(1.0, 2)  # two tokens a second checked against a hundred plain
    assert decoder.draft(_prompt(), 4) == [] and decoder._waiting == speculative.BACKOFF_TOKENS - 1
    fast = SpeculativeDecoder(engine.step)
    fast._plain_seconds = 1.0
    fast._judge(1.0, 3)
    assert fast.draft(_prompt(), 4)


def test_speculation_is_a_setting(tiny_pack):
    from flashpack.errors import FlashpackError

    assert load_engine(tiny_pack, EngineConfig(speculate="lookup")).generator.speculation is not None
    assert load_engine(tiny_pack, EngineConfig()).generator.speculation is None
    with pytest.raises(FlashpackError, match="unknown drafter"):
        EngineConfig(speculate="mtp")
