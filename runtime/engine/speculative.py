"""Speculative decoding, lossless: drafts checked in one step of the model.

After a token is chosen, a drafter (drafters.py) proposes up to k tokens that may follow it; the
token and its drafts go through the model as one step of k + 1 positions, whose logits say at each
position what decoding would choose. A step reads the dense weights once and each layer fetches
the union of the positions' experts once, where one-token steps read them k + 1 times.

Acceptance: greedy, drafts are accepted while they equal the argmax, and the first argmax that
differs (or the one after the last draft) is the next token, exactly as one-token steps would have
chosen it. Sampling, each draft passes the rejection rule (rejection.py) against the request's
filtered distribution, and the first rejection draws the next token from the residual: the output
is distributed as the model's own sampling. Speculation runs for requests without a constraint or
log-probabilities, greedy or sampled without a seed (a seeded request repeats exactly only if its
random draws do not depend on which steps were checked); others decode one token a step.

Rollback without recompute: the state is tracked through a checked step (SequenceState.track:
DeltaNet's recurrent state after each position and its conv window, PLE's history and conv window,
the attention lengths), and `rewind` puts every part just after the last accepted token. No copy
of the whole state is taken and nothing runs again.

Policy: a drafter is used while its checked steps yield more tokens a second than plain steps.
Each step's cost is the time from one choice of the next token to the next (drafting, the step,
rollback and emitting its tokens included). A kind of step (plain, or each drafter's) is judged by
the median time of its last PACE_WINDOW steps and, for a drafter, the mean yield of its last
YIELD_WINDOW steps. The median time, so that one step stalled by something else (a garbage
collection, a page fault, another process on the GPU), which can take several checked steps' time,
does not rest a drafter that pays; the mean yield, because a step's yield is bounded (1 .. k + 1)
and falls mostly at its ends: at acceptance 0.9 a step yields k + 1 tokens two times in three and
one or two one time in five, so the median of five yields is two or less about one step in twenty
and rested a drafter that paid 1.8x through much of a request (bench/policy_simulation.py at the
H200's step times). A drafter is judged once it has MIN_JUDGED yields, or once even the faster of
two of its steps takes longer than k + 1 plain steps (no yield could pay for it, and a stall, which
only lengthens a step, cannot make one of two look so). Drafters are asked in order
(prompt lookup where the context repeats itself, then the MTP head); one that loses to plain steps
rests BACKOFF_TOKENS tokens, twice as long after each further loss (up to MAX_BACKOFF_TOKENS), and at
least so long that the time its MIN_JUDGED trial steps cost beyond plain steps is TRY_SHARE of the
plain time of its rest: where speculation never pays, trying it costs at most about that share. Its
yields are forgotten as it rests, so that it is judged again on the steps it takes after. Keeping a
drafter caught up (the MTP head's layer on every step) is that drafter's cost, not a plain step's:
it is charged to its next checked step, and a drafter kept up through IDLE_TOKENS steps without
drafting, at more than TRY_SHARE of their time, rests too. The paces outlive a request (the engine
keeps one decoder), so what one request learnt the next need not pay for.
A drafter whose proposals cost next to nothing (`cheap`: prompt lookup) is still asked while it
rests, and each proposal is scored in hindsight against the tokens then chosen (the tokens a checked
step would have yielded): those scores join its yields as checked steps' do, and its rest ends once
they say it pays again. Resting then costs it no lost chances, and a drafter judged on a burst of
misses (an edit's renamed names) comes back when its drafts match again.
Until a plain step has been timed, none is checked. A checked step that compiles or captures its
graphs (the first two of each length, Step.warming) costs seconds once, not what such steps cost, and
one whose drafts the request's end cut short yields less than the drafter would: neither is
measured, lest one warm-up rest a drafter for thousands of tokens or each request's last steps
judge it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from flashpack.runtime.engine.drafters import Drafter
from flashpack.runtime.engine.rejection import accept_or_resample
from flashpack.runtime.state import SequenceState

BACKOFF_TOKENS = 32  # tokens a drafter rests after its checked steps lost to plain ones
MAX_BACKOFF_TOKENS = 1024
TRY_SHARE = 0.02  # of plain decoding's time that trying a losing drafter may cost
IDLE_TOKENS = 32  # plain steps a drafter may be kept caught up without drafting before it is judged
PACE_WINDOW = 5  # steps of each kind whose median time judges it: two stalled ones among them change nothing
MIN_JUDGED = 4  # a drafter's yields the policy waits for before judging it (and again after each rest)
YIELD_WINDOW = 16  # steps of each kind whose mean yield judges it (bench/policy_simulation.py)
PLAIN = "plain"


@dataclass
class SpeculationStats:
    steps: int = 0  # checked steps
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # checked steps whose draft i was accepted, by i
    drafted_at: list[int] = field(default_factory=list)  # checked steps with a draft i, by i
    rollbacks: int = 0  # checked steps with a rejected draft
    plain_steps: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    rollback_seconds: float = 0.0
    by_drafter: dict[str, dict[str, int]] = field(default_factory=dict)  # name -> steps, drafted, accepted

    def to_dict(self) -> dict:
        found = dict(self.__dict__)
        found["tokens_per_step"] = (self.steps + self.accepted) / self.steps if self.steps else 0.0
        found["acceptance"] = self.accepted / self.drafted if self.drafted else 0.0
        found["acceptance_at"] = [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]
        return found

    def count(self, drafter: str, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.rollbacks += accepted < drafted
        for name, positions in (("drafted_at", drafted), ("accepted_at", accepted)):
            counts = getattr(self, name)
            counts.extend([0] * (drafted - len(counts)))
            for position in range(positions):
                counts[position] += 1
        mine = self.by_drafter.setdefault(drafter, {"steps": 0, "drafted": 0, "accepted": 0})
        mine["steps"] += 1
        mine["drafted"] += drafted
        mine["accepted"] += accepted


@dataclass
class _Pace:
    """The seconds of the last PACE_WINDOW steps of one kind and the tokens of the last YIELD_WINDOW."""
    recent_seconds: deque = field(default_factory=lambda: deque(maxlen=PACE_WINDOW))
    recent_tokens: deque = field(default_factory=lambda: deque(maxlen=YIELD_WINDOW))
    resting: int = 0  # tokens still to go before this drafter is asked again
    backoff: int = BACKOFF_TOKENS
    idle: int = 0  # plain steps since the drafter's catching up was last charged

    @property
    def seconds(self) -> float | None:
        return statistics.median(self.recent_seconds) if self.recent_seconds else None

    @property
    def tokens(self) -> float | None:
        return statistics.fmean(self.recent_tokens) if self.recent_tokens else None

    def add(self, seconds: float, tokens: int) -> None:
        self.recent_seconds.append(seconds)
        self.recent_tokens.append(tokens)

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("inf")


@dataclass
class Draft:
    tokens: list[int]
    drafter: str


@dataclass
class SpeculativeDecoder:
    step: object  # runtime.engine.step.Step
    drafters: Sequence[Drafter]  # asked in this order
    draft_tokens: int = 4  # k: drafts a step checks at most
    policy: bool = True  # False: every proposal is checked (benchmarks, tests)
    clock: Callable[[], float] = time.perf_counter  # the policy's seconds (bench/policy_simulation.py's are simulated)
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    _paces: dict[str, _Pace] = field(default_factory=dict)
    _upkeep: dict[str, float] = field(default_factory=dict)  # catching-up seconds not charged yet, by drafter
    _upkeep_in_step: float = 0.0  # catching-up seconds within the step under way
    _since: tuple[str, float] | None = None  # the kind of the step under way, and when it was chosen
    _yielded: int = 1  # tokens the step under way yields
    _measured: bool = True  # False: the step under way warmed graphs up, or the request's end cut its
    # drafts short, and what it cost or yielded says nothing of the drafter's steps
    _hindsight: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)  # resting cheap drafter -> (its
    # proposal, the tokens chosen since)

    def start(self, prompt_ids: Sequence[int]) -> None:
        """A new sequence, its first token chosen: drafters index its prompt. The prompt's catching
        up is a part of its prefill, not charged to any drafter."""
        for drafter in self.drafters:
            drafter.start(prompt_ids)
        self._since, self._upkeep, self._upkeep_in_step, self._hindsight = None, {}, 0.0, {}

    def observe(self, tokens: Sequence[int], streams: torch.Tensor, state: SequenceState,
                marked: Sequence[tuple[int, SequenceState]] = ()) -> None:
        """The backbone consumed `tokens` (a prompt's or a plain step) with these streams; `marked`:
        the states saved within the step, (tokens before, state) (Drafter.observe)."""
        for drafter in self._awake():
            self._kept_up(drafter, tokens, streams, state, marked)

    def _kept_up(self, drafter: Drafter, tokens, streams, state, marked=()) -> None:
        """drafter.observe, its time kept as the drafter's upkeep."""
        start = self.clock()
        drafter.observe(tokens, streams, state, marked)
        seconds = self.clock() - start
        self._upkeep[drafter.name] = self._upkeep.get(drafter.name, 0.0) + seconds
        self._upkeep_in_step += seconds

    def _awake(self) -> list[Drafter]:
        """The drafters not resting. A resting one is not kept caught up either (the MTP head's
        catching up is a layer's work a step): it falls out of line with the sequence and drafts
        again from the next one's prompt."""
        return [d for d in self.drafters if not (self.policy and d.name in self._paces and self._paces[d.name].resting)]

    def draft(self, token: int, state: SequenceState, room: int) -> Draft | None:
        """`token` was chosen and is next to be consumed: up to min(k, room) drafts to check with it,
        or None (a plain step) where nothing is proposed or the policy says it does not pay."""
        now = self.clock()
        self._settle_pace(now)
        self._extend([token])
        kind, found = PLAIN, None
        if room >= 1 and (not self.policy or PLAIN in self._paces):  # a plain step is timed first
            for drafter in self.drafters:
                pace = self._paces.setdefault(drafter.name, _Pace())
                if self.policy and pace.resting > 0:
                    pace.resting -= 1
                    if drafter.cheap and drafter.name not in self._hindsight:
                        proposal = drafter.propose(token, state, min(self.draft_tokens, room))
                        if proposal:
                            self._hindsight[drafter.name] = (proposal, [])
                    continue
                tokens = drafter.propose(token, state, min(self.draft_tokens, room))
                if tokens:
                    kind, found = drafter.name, Draft(tokens, drafter.name)
                    break
        self.stats.draft_seconds += self.clock() - now
        self._since, self._yielded = (kind, now), 1
        self._measured = kind == PLAIN or room >= self.draft_tokens
        if kind == PLAIN:
            self.stats.plain_steps += 1
        return found

    def verify(self, token: int, draft: Draft, state: SequenceState, sampler) -> tuple[list[int], int]:
        """Run `token` and the drafts as one step on `state`; returns the accepted drafts and the token
        that follows them (chosen by `sampler`'s rule). `state` then holds token + accepted drafts."""
        start = self.clock()
        drafts = draft.tokens
        warming = getattr(self.step, "warming", None)
        self._measured = self._measured and not (warming is not None and warming(1 + len(drafts), state))
        state.track()
        out = self.step.forward(torch.tensor([token, *drafts]), state)
        accepted, following = self._accept(out.logits, drafts, sampler)
        checked = self.clock()
        self.stats.verify_seconds += checked - start
        kept = 1 + accepted
        state.rewind(kept)
        self.stats.rollback_seconds += self.clock() - checked
        for drafter in self._awake():
            self._kept_up(drafter, [token, *drafts[:accepted]], out.streams[:kept], state)
        self.checked(draft, accepted)
        return drafts[:accepted], following

    def checked(self, draft: Draft, accepted: int) -> None:
        """A checked step of `draft` kept its first `accepted` drafts: counted, the drafters' context
        extended, and its yield (accepted + 1 tokens) left for the policy to judge when the next
        step is chosen. `verify` calls it; bench/policy_simulation.py, which runs no model, too."""
        self.stats.count(draft.drafter, len(draft.tokens), accepted)
        self._extend(draft.tokens[:accepted])
        self._yielded = 1 + accepted

    @staticmethod
    def _accept(logits: torch.Tensor, drafts: list[int], sampler) -> tuple[int, int]:
        """(drafts accepted, the token after them) from the step's logits [k + 1, vocab]."""
        if sampler.params.greedy:
            choices = logits.argmax(dim=-1).tolist()  # the step's one read-back
            accepted = 0
            while accepted < len(drafts) and choices[accepted] == drafts[accepted]:
                accepted += 1
            return accepted, choices[accepted]
        for position, drafted in enumerate(drafts):
            ok, token = accept_or_resample(sampler.probabilities(logits[position]), drafted, None, sampler.generator)
            if not ok:
                return position, token
        return len(drafts), sampler.draw(sampler.probabilities(logits[len(drafts)]))

    def _extend(self, tokens: Sequence[int]) -> None:
        """Tokens chosen for the sequence, in order: the drafters' context grows, and the proposals
        held for hindsight are scored as far as the tokens reach."""
        for drafter in self.drafters:
            drafter.extend(tokens)
        for token in tokens:
            for name, (proposal, chosen) in list(self._hindsight.items()):
                matched = token == proposal[len(chosen)]
                chosen.append(token)
                if not matched or len(chosen) == len(proposal):
                    del self._hindsight[name]
                    self._score_in_hindsight(name, len(chosen) - (not matched))

    def _score_in_hindsight(self, name: str, accepted: int) -> None:
        """A resting drafter's proposal would have had `accepted` drafts accepted: its median yield
        moves as a checked step's would, and it rests no longer once that says it pays."""
        pace, plain = self._paces[name], self._paces.get(PLAIN)
        pace.recent_tokens.append(1 + accepted)
        if plain is not None and pace.seconds is not None and pace.rate() > plain.rate():
            pace.resting = 0

    def pace(self, name: str) -> dict:
        """What the policy knows of drafter `name` (or PLAIN) now: the median seconds and mean tokens
        of a step it judges by (None before a step of that kind was measured) and the tokens it
        still rests."""
        pace = self._paces.get(name)
        if pace is None:
            return {"seconds": None, "tokens": None, "resting": 0}
        return {"seconds": pace.seconds, "tokens": pace.tokens, "resting": pace.resting}

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` the caller spent on other work since the step under way was chosen (a
        benchmark's untimed reference decode) out of that step's cost."""
        if self._since is not None:
            kind, began = self._since
            self._since = (kind, began + seconds)

    def _settle_pace(self, now: float) -> None:
        """Charge the step under way (chosen at `self._since`) with the time until now. Catching a
        drafter up is not a plain step's cost but that drafter's: a drafter's checked step is
        charged with all the catching up it took since its last one, and one that is kept caught up
        through IDLE_TOKENS steps without drafting, at more than TRY_SHARE of their time, rests."""
        if self._since is None:
            return
        kind, began = self._since
        seconds = now - began - self._upkeep_in_step
        self._upkeep_in_step = 0.0
        if not self._measured:
            self._measured = True
            return
        pace = self._paces.setdefault(kind, _Pace())
        if kind != PLAIN:
            seconds += self._upkeep.pop(kind, 0.0)
            pace.idle = 0
        pace.add(seconds, self._yielded)
        plain = self._paces.get(PLAIN)
        if plain is None or not self.policy:
            return
        if kind == PLAIN:
            self._rest_idle(plain)
            return
        # even its fastest recent step slower than its most tokens' plain steps: a stall only lengthens a
        # step, so with two steps one stalled one cannot make a drafter look so
        hopeless = (len(pace.recent_seconds) > 1
                    and min(pace.recent_seconds) > (self.draft_tokens + 1) * plain.seconds)
        if len(pace.recent_tokens) < MIN_JUDGED and not hopeless:
            return
        if pace.rate() < plain.rate():
            lost = pace.seconds - pace.tokens * plain.seconds  # a step's time beyond plain steps'
            paid_back = math.ceil(MIN_JUDGED * lost / (TRY_SHARE * plain.seconds)) if lost > 0 else 0  # its trials'
            pace.resting = max(pace.backoff, paid_back)
            pace.backoff = min(2 * pace.backoff, MAX_BACKOFF_TOKENS)
            pace.recent_tokens.clear()  # judged again on the steps after its rest
        else:
            pace.backoff = BACKOFF_TOKENS

    def _rest_idle(self, plain: _Pace) -> None:
        for name, upkeep in list(self._upkeep.items()):
            pace = self._paces.setdefault(name, _Pace())
            pace.idle += 1
            if pace.idle >= IDLE_TOKENS:
                if upkeep > TRY_SHARE * pace.idle * plain.seconds:
                    pace.resting, pace.backoff = pace.backoff, min(2 * pace.backoff, MAX_BACKOFF_TOKENS)
                self._upkeep[name], pace.idle = 0.0, 0

