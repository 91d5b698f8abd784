"""The Generator's log-probabilities on the real tiny model: what they report, and that asking for
them changes nothing else."""

from __future__ import annotations

import pytest
import torch

from flashpack.errors import FlashpackError
from flashpack.runtime import logprobs as logprobs_module
from flashpack.runtime.logprobs import LogprobRequest
from flashpack.runtime.sampling import SamplingParams

PROMPT = "def add(a, b):\n    return a + b\n"


def _reference(engine, ids):
    state = engine.model.new_state()
    state.reserve(len(ids) + 1)
    return torch.log_softmax(engine.model.forward(torch.tensor(ids), state).logits.float(), dim=-1)


class _OnlyThese:
    """A TokenConstraint allowing only `allowed`: the choice is constrained, the report must not be."""

    def __init__(self, allowed: list[int]):
        self.allowed = allowed

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        keep = torch.full_like(logits, float("-inf"))
        keep[self.allowed] = 0.0
        return logits + keep

    def accept(self, token_id: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False


def test_asking_for_logprobs_changes_no_token_and_not_asking_reports_none(tiny_engine):
    ids = tiny_engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=5)
    plain = list(tiny_engine.generator.stream(ids, params))
    asked = [e for e in tiny_engine.generator.stream(ids, params, logprobs=LogprobRequest(4, prompt=True))
             if e.prompt_logprobs is None]
    assert [(e.text, e.token_id, e.finish_reason) for e in plain] == [(e.text, e.token_id, e.finish_reason) for e in asked]
    assert all(e.logprob is None and e.prompt_logprobs is None for e in plain)
    assert all(e.logprob is not None for e in asked if e.token_id is not None)


def test_a_constrained_choice_reports_the_unconstrained_distribution(tiny_engine):
    ids = tiny_engine.tokenizer.encode(PROMPT)
    expected = _reference(tiny_engine, ids)[-1]
    allowed = torch.topk(expected, 40).indices[-2:].tolist()  # two unlikely tokens
    events = tiny_engine.generator.stream(ids, SamplingParams(max_tokens=1), _OnlyThese(allowed), logprobs=LogprobRequest(1))
    first = next(events)
    assert first.token_id in allowed
    assert abs(first.logprob.logprob - expected[first.token_id].item()) <= 1e-5 * abs(expected[first.token_id].item())
    assert first.logprob.top[0][0] == int(expected.argmax())  # the model's favourite, though not allowed


def test_score_equals_the_prompt_part_of_a_stream_and_slices_change_nothing(tiny_engine, monkeypatch):
    ids = tiny_engine.tokenizer.encode(PROMPT * 3)
    (scored,) = list(tiny_engine.generator.score(ids, top_n=2))
    assert scored.finish_reason == "length" and scored.token_id is None
    first = next(tiny_engine.generator.stream(ids, SamplingParams(max_tokens=1), logprobs=LogprobRequest(2, prompt=True)))
    assert first.prompt_logprobs == scored.prompt_logprobs
    # three rows a slice instead of all of them at once: the same numbers
    monkeypatch.setattr(logprobs_module, "SLICE_VALUES", 3 * tiny_engine.model.config.vocab_size)
    (sliced,) = list(tiny_engine.generator.score(ids, top_n=2))
    assert [e.token_id for e in sliced.prompt_logprobs] == ids[1:]
    for a, b in zip(sliced.prompt_logprobs, scored.prompt_logprobs):
        # float32 log-softmax rows computed in other batches: a few ulps apart (2 ulps at -13.4 is 1.9e-6)
        assert abs(a.logprob - b.logprob) <= 1e-6 * (1 + abs(b.logprob)) and [t for t, _ in a.top] == [t for t, _ in b.top]


def test_score_takes_a_prompt_that_fills_the_context_which_generation_refuses(tiny_engine):
    limit = tiny_engine.model.config.max_position_embeddings
    generator = type(tiny_engine.generator)(tiny_engine.model, tiny_engine.tokenizer, max_context=16)
    ids = tiny_engine.tokenizer.encode(PROMPT * 4)[:16]
    assert len(ids) == 16 < limit
    (scored,) = list(generator.score(ids))
    assert len(scored.prompt_logprobs) == 15
    with pytest.raises(FlashpackError):
        next(generator.stream(ids, SamplingParams(max_tokens=1)))
    with pytest.raises(FlashpackError):
        next(generator.score(ids + ids[:1]))
