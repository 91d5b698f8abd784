"""Speculative decoding, greedy and lossless: drafts checked in one step of the model.

After a token is chosen, a drafter proposes up to k tokens that may follow it; the token and its
drafts go through the model as one step of k + 1 positions, whose logits say at each position what
greedy decoding would choose. Drafts are accepted while they equal those choices; the first choice
that differs (or the one after the last draft) is the next token, exactly as one-token steps would
have chosen it. A step reads the dense weights once and each layer fetches the union of the
positions' experts once, where one-token steps read them k + 1 times.

Drafter: prompt lookup (runtime/prompt_lookup.py), the continuation of the most recent earlier
occurrence of the context's last n-gram: edits, refactors and quoted code repeat their context.
Where nothing matches no step is speculative.

Rollback: the state is copied before a step with drafts (SequenceState.snapshot: DeltaNet recurrent
and conv states, QSA keys, PLE context and conv tails); where a draft is rejected the copy is
restored and the accepted tokens run again as one step. (Keeping per-position states in the step,
so a rejection costs no second run, is the next change; its cost has to be measured first.)
Speculation runs for greedy requests without a constraint or log-probabilities; other requests
decode one token a step.

Policy: speculation pays where a step of k + 1 positions costs little more than a step of one (on a
GPU a step reads the dense weights once either way), and not where every position brings its own
experts' work (on a CPU, or a budget that streams experts from disk). So the decoder keeps running
means of a one-token step's time, of a checked step's time (its rollback included) and of the
tokens a checked step yields, and drafts only while tokens per second checked beat tokens per
second plain; after a loss it waits BACKOFF_TOKENS plain tokens before trying again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from flashpack.runtime.prompt_lookup import propose

DRAFTERS = ("off", "lookup")
BACKOFF_TOKENS = 32  # plain tokens before speculation is tried again after it lost
_WEIGHT = 0.2  # of the newest measurement in each running mean


@dataclass
class SpeculationStats:
    steps: int = 0  # steps with drafts
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # steps whose draft i was accepted, by i
    rollbacks: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    rollback_seconds: float = 0.0

    def to_dict(self) -> dict:
        found = dict(self.__dict__)
        found["tokens_per_step"] = (self.steps + self.accepted) / self.steps if self.steps else 0.0
        found["acceptance"] = self.accepted / self.drafted if self.drafted else 0.0
        return found


@dataclass
class SpeculativeDecoder:
    step: object  # runtime.engine.step.Step
    draft_tokens: int = 4  # k: drafts a step checks at most
    ngram: int = 3  # the longest context suffix prompt lookup matches (down to 1 token)
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    _plain_seconds: float | None = None  # running means: a one-token step,
    _checked_seconds: float | None = None  # a checked step (its rollback included),
    _checked_tokens: float | None = None  # the tokens a checked step yields
    _waiting: int = 0  # plain tokens still to go before drafting again

    def draft(self, context: list[int], room: int) -> list[int]:
        """Up to min(k, room) tokens that may follow `context`, or none while the policy says
        drafting does not pay."""
        if room < 1 or self._waiting > 0:
            self._waiting = max(self._waiting - 1, 0)
            return []
        start = time.perf_counter()
        drafts = propose(context, self.ngram, min(self.draft_tokens, room))
        self.stats.draft_seconds += time.perf_counter() - start
        return drafts

    def verify(self, token: int, drafts: list[int], state) -> tuple[torch.Tensor, list[int]]:
        """Run `token` and its `drafts` as one step on `state`; returns the logits after the last
        accepted token and the accepted drafts. `state` then holds token + accepted drafts."""
        start = time.perf_counter()
        saved = state.snapshot()
        out = self.step.forward(torch.tensor([token, *drafts]), state)
        choices = out.logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < len(drafts) and choices[accepted] == drafts[accepted]:
            accepted += 1
        self.stats.verify_seconds += time.perf_counter() - start
        self._count(len(drafts), accepted)
        logits = out.logits[-1]
        if accepted < len(drafts):
            rolled = time.perf_counter()
            state.restore(saved)  # back to before the step, then the accepted part again
            logits = self.step.forward(torch.tensor([token, *drafts[:accepted]]), state, last_only=True).logits[-1]
            self.stats.rollbacks += 1
            self.stats.rollback_seconds += time.perf_counter() - rolled
        self._judge(time.perf_counter() - start, 1 + accepted)
        return logits, drafts[:accepted]

    def plain_step(self, forward):
        """Run a one-token step (`forward()`), timing it for the policy."""
        start = time.perf_counter()
        out = forward()
        self._plain_seconds = _mean(self._plain_seconds, time.perf_counter() - start)
        return out

    def _judge(self, seconds: float, tokens: int) -> None:
        self._checked_seconds = _mean(self._checked_seconds, seconds)
        self._checked_tokens = _mean(self._checked_tokens, tokens)
        if self._plain_seconds is not None and self._checked_tokens / self._checked_seconds < 1 / self._plain_seconds:
            self._waiting = BACKOFF_TOKENS

    def _count(self, drafted: int, accepted: int) -> None:
        stats = self.stats
        stats.steps += 1
        stats.drafted += drafted
        stats.accepted += accepted
        while len(stats.accepted_at) < drafted:
            stats.accepted_at.append(0)
        for position in range(accepted):
            stats.accepted_at[position] += 1


def _mean(mean: float | None, value: float) -> float:
    return value if mean is None else (1 - _WEIGHT) * mean + _WEIGHT * value
