"""Prompt lookup: draft tokens for speculative decoding by copying from the context itself.

The n-gram proposer of vLLM (`method: ngram`) and of transformers' `prompt_lookup_num_tokens`
("prompt lookup decoding"): take the last n tokens of the context, find where the same n tokens
occurred earlier in it, and propose the k tokens that followed that occurrence. n runs from n_max
down to n_min and the first n that matches wins, so a longer match is always preferred; among the
occurrences of that n-gram the most recent one is taken (the nearest copy of what is being
rewritten). Edits, refactors and quoted code repeat their context, so the draft is often right
there; on fresh text there may be nothing to propose.

Plain Python over token ids: a draft costs a scan of the context, small beside a model step.
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
