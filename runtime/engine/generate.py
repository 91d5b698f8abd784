"""Generation: prompt ids in, a stream of text pieces out, until a stop condition.

    prefill(prompt) -> loop { sample -> stop? -> decode(token) }

Stops: a stop token (end of turn), a stop string (cut before it), `max_tokens`, a constraint that
has terminated, or the caller cancelling. The step function is the engine's `forward`; a
`TokenConstraint` (grammar-constrained decoding) may mask logits before each choice.

With a PrefixCache (prefix_cache.py), a prompt restores the longest saved state of its own first
tokens and prefills the rest; the prompt is prefilled in segments ending at the `checkpoints` it
is given (the chat template's message boundaries) and at its end, each end saved, and the end of
the reply is saved too, so a follow-up turn restores everything before its new tokens. The last
event's timings say how many prompt tokens were restored (`cached_tokens`).

With a SpeculativeDecoder (speculative.py), a request without a grammar, log-probabilities or a
seed has its drafters propose tokens after each chosen one and checks them in one step; every
backbone step (prefill segments included) is shown to the drafters first, so the MTP head stays
caught up and a saved state carries what it needs.

Asked for (a LogprobRequest), events also carry the model's own log-probabilities (runtime/logprobs.py):
of each sampled token, of the stop token that ended the reply, and of the prompt's tokens; `score`
reports a prompt's alone, sampling nothing. Not asked for, nothing of that is computed.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from flashpack.errors import FlashpackError
from flashpack.runtime.detokenize import IncrementalDetokenizer, StopStringFilter
from flashpack.runtime.engine.arriving_state import StoredStateLost
from flashpack.runtime.engine.checked_graphs import PROMPT_CHUNKS
from flashpack.runtime.engine.prefix_cache import PrefixCache
from flashpack.runtime.engine.speculative import SpeculativeDecoder
from flashpack.runtime.logprobs import LogprobRequest, TokenLogprob, prompt_logprobs, token_logprobs
from flashpack.runtime.sampling import Sampler, SamplingParams


class TokenConstraint(Protocol):
    """Restricts the next token (e.g. to a JSON schema's grammar)."""

    def mask(self, logits: torch.Tensor) -> torch.Tensor: ...

    def accept(self, token_id: int) -> None: ...

    def is_terminated(self) -> bool: ...


@dataclass
class GenerationEvent:
    text: str  # new text (may be empty while a character or stop string is pending)
    token_id: int | None = None
    finish_reason: str | None = None  # "stop", "length", "cancelled" on the last event
    timings: dict[str, float] | None = None  # on the last event: first_token_seconds, total_seconds, cached_tokens
    logprob: TokenLogprob | None = None  # token_id's; on the last event, the stop token's that ended it
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1..T-1, on an event of its own


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str
    first_token_seconds: float
    total_seconds: float
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache, not prefilled

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_tokens_per_second(self) -> float:
        decode_time = self.total_seconds - self.first_token_seconds
        return (self.completion_tokens - 1) / decode_time if self.completion_tokens > 1 and decode_time > 0 else 0.0


# A checkpoint within this many tokens of the last one (or of the prompt's end) is skipped, but for
# the prompt's last: each costs a copy of the whole state and one more call of every layer's mixer,
# more than the few tokens it would save.
MIN_SEGMENT = 16

# Attention room reserved up front for this many generated tokens at most (9 MB per QSA layer at
# full size); a longer generation grows the caches by doubling.
RESERVE_MAX_TOKENS = 4096


@dataclass
class Generator:
    step: object  # runtime.engine.step.Step (forward, new_state, logits, config), or a model alike
    tokenizer: object  # runtime.tokenizer.PackTokenizer
    max_context: int = 0  # 0: the model's max_position_embeddings
    prefix_cache: PrefixCache | None = None
    speculation: SpeculativeDecoder | None = None  # greedy requests check drafts in one step
    # a prompt's checkpoints taken as one step passes them (Qwen4ExpModel.forward's marks), not a
    # step a segment: each layer's experts fetched once, the rest rounded otherwise than a restore's
    checkpoints_in_one_step: bool = False
    _state: object = field(default=None, init=False, repr=False)  # runtime.state.SequenceState, reused

    def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        constraint: TokenConstraint | None = None,
        cancelled: Callable[[], bool] = lambda: False,
        logprobs: LogprobRequest | None = None,
        checkpoints: Sequence[int] = (),
    ) -> Iterator[GenerationEvent]:
        """Yield text pieces; the last event carries the finish reason. With `logprobs.prompt`, the
        first event carries the prompt's log-probabilities and no text (the whole prompt is then
        prefilled: its every position's streams are needed). `checkpoints`: prompt lengths after
        which to save the state (message boundaries)."""
        limit = self._checked_limit(prompt_ids, room=1)
        stop_ids = set(params.stop_token_ids) | set(self.tokenizer.stop_token_ids)
        detok = IncrementalDetokenizer(self.tokenizer.tokenizer)
        stops = StopStringFilter(params.stop_strings)
        state_room = min(limit, len(prompt_ids) + min(params.max_tokens, RESERVE_MAX_TOKENS) + 1)
        state = self._fresh_state(state_room)
        start = time.perf_counter()
        whole_prompt = logprobs is not None and logprobs.prompt
        cached = 0
        if self.prefix_cache is not None and not whole_prompt:
            cached = self.prefix_cache.restore_longest(prompt_ids, state)
        # a seeded sampled request repeats exactly only if its draws do not depend on which steps the
        # policy checked: it decodes one token a step
        speculative = constraint is None and logprobs is None and (params.greedy or params.seed is None)
        speculation = self.speculation if speculative else None
        # drafters start once the first token is out: prompt lookup's index of a 32k-token prompt would
        # add ~70 ms to the time to first token
        drafting = False
        observe = None if speculation is None else speculation.observe
        try:
            logits, streams = self._prefill(prompt_ids, state, cached, checkpoints, whole_prompt, observe)
        except StoredStateLost:  # a stored state failed partway through its read: prefill it all
            state, cached = self._fresh_state(state_room), 0
            logits, streams = self._prefill(prompt_ids, state, cached, checkpoints, whole_prompt, observe)
        if whole_prompt:
            yield GenerationEvent("", prompt_logprobs=prompt_logprobs(self.step, streams, prompt_ids, logprobs.top_n))
        # sampled where the logits are: on a GPU only the token id comes back (a top-p cut sorts the
        # whole vocabulary: 41 ms a token on a 2-core CPU for 248k entries, bench/sampling.py)
        sampler = Sampler(params, device=logits.device)
        generated, first_token_seconds = 0, 0.0
        finish, stop_logprob = "length", None
        fed: list[int] = []  # generated tokens the state has consumed
        # tokens a checked step chose: its accepted drafts (consumed by the state) and the token after
        # them (not consumed), still to be emitted
        chosen: deque[tuple[int, bool]] = deque()
        while True:
            raw, consumed = None, False
            if chosen:
                token, consumed = chosen.popleft()
            else:
                raw = logits  # the unmodified model's: what logprobs report
                if constraint is not None:
                    logits = constraint.mask(logits.float())
                token = sampler(logits.float())
            generated += 1
            if generated == 1:
                first_token_seconds = time.perf_counter() - start
            reported = None if logprobs is None else token_logprobs(raw[None], torch.tensor([token]), logprobs.top_n)[0]
            if token in stop_ids:
                finish, stop_logprob = "stop", reported
                break
            if constraint is not None:
                constraint.accept(token)
            text = stops.push(detok.push(token))
            if stops.stopped:
                yield GenerationEvent(text, token, logprob=reported)
                finish = "stop"
                break
            yield GenerationEvent(text, token, logprob=reported)
            if constraint is not None and constraint.is_terminated():
                finish = "stop"
                break
            if generated >= params.max_tokens or len(prompt_ids) + generated >= limit:
                break
            if cancelled():
                finish = "cancelled"
                break
            if consumed:  # an accepted draft: the state has it
                continue
            room = min(params.max_tokens - generated, limit - len(prompt_ids) - generated - 1)
            if speculation is not None and not drafting:
                speculation.start(prompt_ids)
                drafting = True
            draft = speculation.draft(token, state, room) if speculation is not None else None
            if draft is not None:
                accepted, following = speculation.verify(token, draft, state, sampler)
                chosen.extend([(t, True) for t in accepted] + [(following, False)])
                fed += [token, *accepted]
                continue
            out = self.step.forward(torch.tensor([token]), state, last_only=True)
            if speculation is not None:
                speculation.observe([token], out.streams, state)
            logits = out.logits[-1]
            fed.append(token)
        if self.prefix_cache is not None and fed:
            self.prefix_cache.save(prompt_ids + fed, state)
        self._warm_prompt_chunks(state)
        timings = {"first_token_seconds": first_token_seconds, "total_seconds": time.perf_counter() - start,
                   "cached_tokens": cached}
        yield GenerationEvent(stops.flush(), None, finish, timings, logprob=stop_logprob)

    def _prefill(self, prompt_ids: list[int], state, start: int, checkpoints: Sequence[int], keep_streams: bool,
                 observe: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prefill prompt_ids[start:], saving the state (with a prefix cache) after each checkpoint
        and at the prompt's end: a step a segment, or one step for all (`checkpoints_in_one_step`).
        `observe(tokens, streams, state, marked)` sees each step first: the MTP head catches up,
        its part of the checkpoints too. Returns the last position's logits and, with
        `keep_streams`, the streams of the prefilled positions."""
        ends, last = [], start
        if self.prefix_cache is not None:  # a checkpoint, each worth its copy of the state
            inner = sorted(end for end in set(checkpoints) if start < end < len(prompt_ids))
            for end in inner:
                # the last boundary (where the reply's turn opens) is always kept: a follow-up shares
                # it even where the template renders the reply otherwise than it was generated
                # (a thinking model's history drops its reasoning)
                if end == inner[-1] or last + MIN_SEGMENT <= end <= len(prompt_ids) - MIN_SEGMENT:
                    ends.append(end)
                    last = end
        ends.append(len(prompt_ids))
        streams = []
        for group in [ends] if self.checkpoints_in_one_step else [[end] for end in ends]:
            # one step to the group's last end, the states at the others taken as the layers pass them
            marks, tokens = [end - start for end in group[:-1]], prompt_ids[start:group[-1]]
            if marks:
                out = self.step.forward(torch.tensor(tokens), state, last_only=True, marks=marks)
            else:  # called as any step: a step function alike need not take marks
                out = self.step.forward(torch.tensor(tokens), state, last_only=True)
            marked = out.marked if marks else []
            if observe is not None:
                observe(tokens, out.streams, state, list(zip(marks, marked)))
            if keep_streams:
                streams.append(out.streams)
            if self.prefix_cache is not None:
                for end, at in zip(group, [*marked, state]):
                    self.prefix_cache.save(prompt_ids[:end], at, owned=at is not state)
            start = group[-1]
        return out.logits[-1], (torch.cat(streams) if streams else None)

    def score(self, prompt_ids: list[int], top_n: int = 0) -> Iterator[GenerationEvent]:
        """The prompt's own log-probabilities, nothing sampled (`echo` with `max_tokens` 0): one
        event, finish reason "length", carrying them."""
        self._checked_limit(prompt_ids, room=0)
        state = self._fresh_state(len(prompt_ids))
        start = time.perf_counter()
        prefill = self.step.forward(torch.tensor(prompt_ids), state, last_only=True)
        found = prompt_logprobs(self.step, prefill.streams, prompt_ids, top_n)
        timings = {"first_token_seconds": 0.0, "total_seconds": time.perf_counter() - start}
        yield GenerationEvent("", None, "length", timings, prompt_logprobs=found)

    def _prompt_chunk_lengths(self) -> list[int]:
        """The step lengths short prompts are cut into, where they run as checked steps
        (Step.prompt_graphs_max_tokens), else none."""
        return [length for length in PROMPT_CHUNKS if length <= getattr(self.step, "prompt_graphs_max_tokens", 0)]

    def _warm_prompt_chunks(self, state) -> None:
        """At a request's end (its state saved), where short prompts run as checked steps and their
        graphs would be made again for this state (its attention caches grew and moved): make them
        now, each length run twice on what is left of the state, so that the next follow-up's first
        token does not wait for it. Only where the caches have room for those tokens as they are
        (growing them would move the buffers again)."""
        lengths = self._prompt_chunk_lengths()
        if not lengths or not any(self.step.warming(length, state) for length in lengths):
            return
        if state.position + 2 * sum(lengths) <= min(cache.capacity for cache in state.attention.values()):
            self._run_prompt_chunks(state, lengths)

    def _run_prompt_chunks(self, state, lengths: list[int]) -> None:
        """A checked step of each length, twice, on `state` (which they advance): eagerly (compiling
        for its buffers' size), then captured."""
        ids = torch.arange(max(lengths), dtype=torch.int64).mul_(7919).remainder_(self.step.config.vocab_size)
        for length in lengths + lengths:
            state.track()
            self.step.forward(ids[:length], state)
            state.rewind(length)

    def _checked_limit(self, prompt_ids: list[int], room: int) -> int:
        """The context limit, once the prompt is known to fit it with `room` tokens to spare."""
        limit = self.max_context or self.step.config.max_position_embeddings
        if not prompt_ids:
            raise FlashpackError("the prompt is empty")
        if len(prompt_ids) + room > limit:
            raise FlashpackError(f"prompt of {len(prompt_ids)} tokens exceeds the context limit of {limit}")
        return limit

    def _fresh_state(self, tokens: int):
        """The one sequence state, reset in place with room for `tokens`: the engine runs one
        sequence at a time, and decode graphs captured against its buffers stay valid."""
        if self._state is None:
            self._state = self.step.new_state()
        else:
            self._state.restore(self.step.new_state())
        self._state.reserve(tokens)
        return self._state

    def warm_up(self, prompt_lengths: list[int], decode_steps: int = 3,
                prompt_depth: int | None = None) -> dict[str, float]:
        """Run once what the first requests would otherwise compile, tune and capture: a prompt of
        each length through the first `prompt_depth` layers (on a GPU the prompt kernels are built
        per shape class, and layers of a kind share them), then a short prompt and `decode_steps`
        one-token steps through every layer (a decode graph runs eagerly, is captured, then
        replayed; where short prompts run as checked steps, a prompt of each chunk length twice
        before them), twice: first on a state of its own whose attention caches have another size than
        the generator's, then on the generator's (the graphs are left bound to it; the next request
        resets it). TorchInductor builds a decode graph for the caches' size it first sees and
        again, for every size, at the second; without that second size here, the first request
        whose context outgrows the caches would pay for the build after its first token.
        Returns the seconds each part took."""
        seconds: dict[str, float] = {}
        vocab = self.step.config.vocab_size

        def prompt(length: int, depth: int | None, state) -> int:
            ids = torch.arange(length, dtype=torch.int64).mul_(7919).remainder_(vocab)  # any ids will do
            return int(self.step.forward(ids, state, last_only=True, depth=depth).logits[-1].argmax())  # waits

        chunks = self._prompt_chunk_lengths()  # where prompts run as checked steps

        def decode(name: str, state) -> None:
            start = time.perf_counter()
            token = prompt(16, None, state)
            if chunks:
                self._run_prompt_chunks(state, chunks)
            for _ in range(decode_steps):
                token = int(self.step.forward(torch.tensor([token]), state, last_only=True).logits[-1].argmax())
            seconds[name] = time.perf_counter() - start

        for length in prompt_lengths:
            start = time.perf_counter()
            prompt(length, prompt_depth, self._fresh_state(length + decode_steps + 1))
            seconds[f"prompt_{length}"] = time.perf_counter() - start
        own = self._fresh_state(16 + 2 * sum(chunks) + decode_steps + 1)
        room = max((cache.capacity for cache in own.attention.values()), default=0)
        # the other size: half, where decode still scores the indexer's blocks there (the branch a
        # long context takes), else twice (room for tokens costs device memory: half costs less)
        other = self.step.new_state()
        other.reserve(room // 2 if room // 2 > self.step.config.indexer_budget else 2 * room)
        decode("decode_other_size", other)
        del other
        decode("decode", own)
        return seconds

    def generate(self, prompt_ids: list[int], params: SamplingParams, **kwargs) -> GenerationResult:
        pieces, token_ids, last = [], [], None
        for event in self.stream(prompt_ids, params, **kwargs):
            pieces.append(event.text)
            if event.token_id is not None:
                token_ids.append(event.token_id)
            last = event
        return GenerationResult(
            "".join(pieces), token_ids, len(prompt_ids), last.finish_reason,
            last.timings["first_token_seconds"], last.timings["total_seconds"], last.timings.get("cached_tokens", 0),
        )
