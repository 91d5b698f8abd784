"""runtime/prompt_lookup.py: the n-gram proposer on hand-made contexts and against a brute-force
reference written from its definition (every earlier occurrence listed, the latest taken)."""

from __future__ import annotations

import random

import pytest

from flashpack.runtime.prompt_lookup import NgramIndex, propose


def _reference(tokens: list[int], n_max: int, k: int, n_min: int = 1) -> list[int]:
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == suffix]
        if starts:
            start = max(starts)
            return tokens[start + n:start + n + k]
    return []


def test_proposes_what_followed_the_earlier_occurrence():
    assert propose([1, 2, 3, 4, 5, 9, 1, 2, 3], n_max=3, k=4) == [4, 5, 9, 1]
    assert propose([1, 2, 3, 4, 5, 9, 1, 2, 3], n_max=3, k=1) == [4]


def test_a_longer_match_beats_a_more_recent_shorter_one():
    context = [7, 8, 9, 10, 5, 8, 9, 11, 6, 7, 8, 9]
    assert propose(context, n_max=3, k=2) == [10, 5]  # the 3-gram 7 8 9 at the start
    assert propose(context, n_max=2, k=2) == [11, 6]  # capped at 2: the latest 8 9


def test_the_most_recent_occurrence_of_the_longest_match_wins():
    assert propose([1, 2, 3, 10, 1, 2, 3, 20, 1, 2, 3], n_max=3, k=4) == [20, 1, 2, 3]


def test_falls_back_to_shorter_n_grams():
    assert propose([4, 5, 6, 1, 6], n_max=3, k=4) == [1, 6]
    assert propose([4, 5, 6, 1, 6], n_max=3, k=4, n_min=2) == []


def test_a_match_near_the_end_proposes_fewer_than_k():
    assert propose([1, 2, 1, 2], n_max=3, k=4) == [1, 2]
    assert propose([3, 3, 3, 3], n_max=3, k=4) == [3]  # a run: the match overlaps the suffix


def test_control_a_context_without_repeats_proposes_nothing():
    assert propose(list(range(200)), n_max=3, k=4) == []
    assert propose([], n_max=3, k=4) == [] and propose([5], n_max=3, k=4) == []


def test_agrees_with_the_brute_force_reference():
    rng = random.Random(0)
    for _ in range(500):
        vocab = rng.choice([3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        n_max, k = rng.randrange(1, 5), rng.randrange(1, 6)
        assert propose(tokens, n_max, k) == _reference(tokens, n_max, k), (tokens, n_max, k)


def test_takes_any_sequence_of_ints():
    import torch

    assert propose(torch.tensor([1, 2, 3, 1, 2]), n_max=2, k=2) == [3, 1]
    assert propose((1, 2, 3, 1, 2), n_max=2, k=2) == [3, 1]


@pytest.mark.parametrize("n_max, k, n_min", [(0, 4, 1), (3, 0, 1), (3, 4, 0), (2, 4, 3)])
def test_bad_arguments_raise(n_max, k, n_min):
    with pytest.raises(ValueError):
        propose([1, 2, 1], n_max=n_max, k=k, n_min=n_min)


def test_the_index_proposes_what_the_scan_does():
    """NgramIndex, grown token by token, proposes exactly what `propose` finds scanning the context."""
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 50))]
        index = NgramIndex(3)
        for end in range(1, len(tokens) + 1):
            index.extend(tokens[end - 1:end])
            assert index.propose(4) == propose(tokens[:end], 3, 4)
