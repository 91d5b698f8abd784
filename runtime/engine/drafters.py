"""Drafters for speculative decoding: who proposes the tokens a step checks.

    start(prompt)                  a new sequence
    extend(tokens)                 tokens chosen for the sequence (the context grew)
    observe(tokens, streams, state)  the backbone consumed `tokens`; `streams` are theirs
    propose(token, state, k)       up to k tokens to follow `token` (chosen, not yet consumed)

LookupDrafter: prompt lookup (runtime/prompt_lookup.py), the continuation of the latest earlier
occurrence of the context's last n-gram, from an index grown with the context. Edits, refactors
and quoted code repeat their context; fresh text often has nothing to propose.

MTPDrafter: the pack's MTP head (runtime/model/mtp.py), drafting recursively: (streams of the last
consumed position, the chosen token) -> the token after it, then its own output streams and that
draft -> the next, k times, each the argmax. The head's layer keeps a KV cache of its own (layer
num_hidden_layers in the SequenceState), one entry per backbone position q pairing q's streams
with token q + 1. `observe` keeps it caught up after every backbone step (prefill segments, plain
steps, lookup steps, the accepted part of a checked step), so whichever drafter ran last, the
head attends over the whole context; the last position's streams wait in `state.mtp_input` until
its token is chosen. Draft entries past the chosen token are speculative and are cut again after
proposing. A state whose MTP cache does not line up with it (one saved before the head ran) gets
no MTP drafts; it is never wrong, only undrafted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from flashpack.runtime.model.mtp import MTPHead
from flashpack.runtime.prompt_lookup import NgramIndex
from flashpack.runtime.state import SequenceState


class Drafter(Protocol):
    name: str
    cheap: bool  # proposing costs next to nothing: the policy scores its proposals while it rests

    def start(self, prompt_ids: Sequence[int]) -> None: ...

    def extend(self, tokens: Sequence[int]) -> None: ...

    def observe(self, tokens: Sequence[int], streams: torch.Tensor, state: SequenceState,
                marked: Sequence[tuple[int, SequenceState]] = ()) -> None: ...

    def propose(self, token: int, state: SequenceState, k: int) -> list[int]: ...


class LookupDrafter:
    name = "lookup"
    cheap = True  # a proposal is a few dictionary lookups

    def __init__(self, ngram: int = 3):
        self.ngram = ngram  # the longest context suffix matched (down to one token)
        self.index = NgramIndex(ngram)

    def start(self, prompt_ids: Sequence[int]) -> None:
        self.index = NgramIndex(self.ngram)
        self.index.extend(prompt_ids)

    def extend(self, tokens: Sequence[int]) -> None:
        self.index.extend(tokens)

    def observe(self, tokens, streams, state, marked=()) -> None:
        pass

    def propose(self, token: int, state: SequenceState, k: int) -> list[int]:
        return self.index.propose(k)  # the index holds `token` already (extend)


class MTPDrafter:
    name = "mtp"
    cheap = False  # a proposal runs the head's layer k times

    def __init__(self, head: MTPHead):
        self.head = head
        self.layer = head.layers[0].layer  # drafts recurse through the first MTP layer (the model has one)

    def start(self, prompt_ids) -> None:
        pass

    def extend(self, tokens) -> None:
        pass

    def observe(self, tokens: Sequence[int], streams: torch.Tensor, state: SequenceState,
                marked: Sequence[tuple[int, SequenceState]] = ()) -> None:
        """After the backbone consumed `tokens` (streams [T, hc*H]): write the head's entries for
        every pair now complete, and keep the last position's streams for the next. `marked`: (m,
        the state after the step's first m tokens) pairs of the same step (prompt checkpoints),
        given the head's part as it stood there."""
        cache = state.attention[self.layer]
        first = state.position - len(tokens)  # the step's first position
        if cache.length == first - 1 and state.mtp_input is not None:  # the pair (first - 1, tokens[0]) waits
            rows, following = torch.cat([state.mtp_input, streams[:-1]]), list(tokens)
        elif cache.length == first:  # proposing wrote it already (or nothing came before)
            rows, following = streams[:-1], list(tokens[1:])
        else:  # out of line with this state: no MTP drafts for it
            state.mtp_input = None
            return
        if following:
            self.head(rows, torch.tensor(following), state, logits=False)
        state.mtp_input = streams[-1:].clone()
        for mark, at in marked:  # a state at position p: the entries of pairs 0..p - 2, p - 1's streams waiting
            at.attention[self.layer] = cache.prefix(at.position - 1)
            at.mtp_input = streams[mark - 1:mark].clone()

    def propose(self, token: int, state: SequenceState, k: int) -> list[int]:
        cache = state.attention[self.layer]
        if state.mtp_input is None or cache.length != state.position - 1:
            return []
        drafts, streams, chosen = [], state.mtp_input, token
        for _ in range(k):
            out = self.head(streams, torch.tensor([chosen]), state)
            chosen = int(out.logits[-1].argmax())
            drafts.append(chosen)
            streams = out.streams
        cache.truncate(state.position)  # the entry pairing the last streams with `token` stays
        state.mtp_input = None  # consumed by that entry
        return drafts
