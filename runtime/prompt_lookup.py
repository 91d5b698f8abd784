"""Prompt lookup: draft tokens for speculative decoding by copying from the context itself.

The n-gram proposer of vLLM (`method: ngram`) and of transformers' `prompt_lookup_num_tokens`
("prompt lookup decoding"): take the last n tokens of the context, find where the same n tokens
occurred earlier in it, and propose the k tokens that followed that occurrence. n runs from n_max
down to n_min and the first n that matches wins, so a longer match is always preferred; among the
occurrences of that n-gram the most recent one is taken (the nearest copy of what is being
rewritten). Edits, refactors and quoted code repeat their context, so the draft is often right
there; on fresh text there may be nothing to propose.

`propose` is the plain form, a scan of the context; `NgramIndex` gives the same proposals from an
index it grows with the context (what decoding uses: a scan of a 32k-token context per token would
cost milliseconds, as much as a step).
"""

from __future__ import annotations

from collections.abc import Sequence


def propose(context_ids: Sequence[int], n_max: int, k: int, n_min: int = 1) -> list[int]:
    """Up to `k` draft tokens continuing `context_ids`, or [] when no n-gram of n_min..n_max
    tokens at its end occurred earlier. Fewer than k come back when the match lies so close to
    the end that fewer tokens follow it."""
    if k < 1:
        raise ValueError(f"k must be at least 1 draft token, got {k}")
    if not 1 <= n_min <= n_max:
        raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
    tokens = [int(token) for token in context_ids]
    last = tokens[-1] if tokens else None
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        pattern = tokens[-n:]
        # An earlier occurrence starts at most at len - n - 1, so at least one token follows it.
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start + n - 1] == last and tokens[start:start + n] == pattern:
                return tokens[start + n:start + n + k]
    return []


class NgramIndex:
    """`propose` over a growing context without rescanning it: for each n in n_min..n_max, the
    start of the most recent occurrence of every n-gram that a token follows. Appending a token
    records the n-grams it follows, so the context's own last n-gram (nothing follows it yet) is
    never its own match. A proposal is O(n_max + k), where the scan is O(context)."""

    def __init__(self, n_max: int, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_max, self.n_min = n_max, n_min
        self.tokens: list[int] = []
        self._starts: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest followed occurrence

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            end = len(self.tokens)  # the n-grams ending just before the new token are now followed
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self._starts[tuple(self.tokens[end - n:end])] = end - n
            self.tokens.append(int(token))

    def propose(self, k: int) -> list[int]:
        if k < 1:
            raise ValueError(f"k must be at least 1 draft token, got {k}")
        tokens = self.tokens
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            start = self._starts.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n:start + n + k]
        return []
