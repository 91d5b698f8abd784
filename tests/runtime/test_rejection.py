"""The rejection rule (runtime/engine/rejection.py) draws each position's token from the model's
distribution p whatever the draft: checked by frequency on a vocabulary of six tokens, for a
drafter with a distribution q of its own and for deterministic drafts (q one-hot). The control, a
rule that accepts every draft, gives q's frequencies and fails the same check."""

from __future__ import annotations

import pytest
import torch

from flashpack.runtime.engine.rejection import accept_or_resample

DRAWS = 30_000
SIGMAS = 5  # a frequency may stray this many standard errors from p and still pass


def _frequencies(rule, p: torch.Tensor, q: torch.Tensor | None, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    draft_source = torch.Generator().manual_seed(seed + 1)
    counts = torch.zeros_like(p)
    for _ in range(DRAWS):
        draft = int(torch.multinomial(q, 1, generator=draft_source)) if q is not None else 2
        _, token = rule(p, draft, q, generator)
        counts[token] += 1
    return counts / DRAWS


def _matches(frequencies: torch.Tensor, p: torch.Tensor) -> bool:
    error = (p * (1 - p) / DRAWS).sqrt().clamp_min(1e-4)
    return bool(((frequencies - p).abs() <= SIGMAS * error).all())


P = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
Q = torch.tensor([0.40, 0.05, 0.25, 0.10, 0.10, 0.10])


@pytest.mark.parametrize("q", [Q, None], ids=["draft-distribution", "one-hot-draft"])
def test_the_rule_gives_the_models_distribution(q):
    assert _matches(_frequencies(accept_or_resample, P, q, seed=0), P)


def test_control_accepting_every_draft_gives_the_drafters_distribution():
    def accept_all(p, draft, q, generator):
        return True, draft

    frequencies = _frequencies(accept_all, P, Q, seed=0)
    assert not _matches(frequencies, P) and _matches(frequencies, Q)


def test_a_draft_the_model_rules_out_is_never_kept():
    p = torch.tensor([0.5, 0.5, 0.0])
    generator = torch.Generator().manual_seed(0)
    assert all(accept_or_resample(p, 2, None, generator)[1] != 2 for _ in range(200))
