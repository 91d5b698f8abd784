"""From an API request to a stream of reply pieces: prompt, limits, sampling, constraints, parsing.

Both APIs go through here; their route modules only translate fields in and events out.

    plan_chat / plan_completion -> ReplyPlan -> run_reply -> Piece ... Piece, ReplyEnd

A plan that asks for log-probabilities also yields, in order among the pieces, PromptLogprobs (the
prompt's, first) and one TokenLogprob per generated token (before that token's pieces); the stop
token that ended the reply, if one did, has its own on the ReplyEnd.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from flashpack.errors import FlashpackError
from flashpack.runtime.engine.generate import GenerationEvent, TokenConstraint
from flashpack.runtime.logprobs import LogprobRequest, TokenLogprob
from flashpack.runtime.sampling import SamplingParams
from flashpack.runtime.server.chat_format import Conversation
from flashpack.runtime.server.context import ServerContext
from flashpack.runtime.server.errors import ApiError
from flashpack.runtime.server.markers import THINK_CLOSE, THINK_OPEN, ids_open_thinking
from flashpack.runtime.server.scheduler import Job
from flashpack.runtime.server.thinking import ThinkingGate
from flashpack.runtime.server.tool_calls import Piece, ReplyParser

DISCONNECT_POLL_SECONDS = 0.25


@dataclass
class Sampling:
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass
class ChatOptions:
    enable_thinking: bool | None = None  # None: the template's default
    thinking_budget: int | None = None  # thinking tokens before </think> is forced
    forced_tools: list[str] | None = None  # the reply must call one of these (grammar-enforced)
    several_calls: bool = True
    json_schema: dict[str, Any] | None = None  # the answer must be JSON valid for this
    parse_tools: bool = False


@dataclass
class ReplyPlan:
    prompt_ids: list[int]
    params: SamplingParams | None  # None: score the prompt only (echo with max_tokens 0)
    constraint: TokenConstraint | None = None
    thinking: bool = False  # read <think> blocks as reasoning
    starts_in_thinking: bool = False
    tools: bool = False  # read <tool_call> blocks as calls
    logprobs: LogprobRequest | None = None
    checkpoints: tuple[int, ...] = ()  # prompt lengths to save the state at (message boundaries)


@dataclass
class ReplyEnd:
    finish: str  # "stop", "length", "tool_calls", "cancelled"
    stop_sequence: str | None
    prompt_tokens: int
    completion_tokens: int
    stop_logprob: TokenLogprob | None = None  # the stop token's that ended the reply (when asked for)
    cached_tokens: int = 0  # prompt tokens restored from saved state, not prefilled


@dataclass
class PromptLogprobs:
    entries: list[TokenLogprob]  # the prompt's tokens 1..T-1, each given those before it


ReplyItem = Piece | TokenLogprob | PromptLogprobs | ReplyEnd


def encode_prompt(ctx: ServerContext, conversation: Conversation, enable_thinking: bool | None) -> list[int]:
    """The conversation's prompt ids, the client's text encoded as text (PackTokenizer.encode_chat);
    a conversation whose text alone cannot fit the context is refused before any of that work."""
    ctx.check_prompt_size(conversation.text_length(), "messages")
    try:
        return ctx.engine.tokenizer.encode_chat(conversation.messages, conversation.tools or None, enable_thinking)
    except FlashpackError as error:
        raise ApiError(400, str(error)) from None
    except Exception as error:  # the template refused the conversation (jinja raise_exception, bad roles)
        raise ApiError(400, f"the chat template could not render these messages: {error}", param="messages") from None


def plan_chat(ctx: ServerContext, conversation: Conversation, options: ChatOptions, sampling: Sampling,
              logprobs: LogprobRequest | None = None) -> ReplyPlan:
    prompt_ids = encode_prompt(ctx, conversation, options.enable_thinking)
    params = sampling_params(ctx, len(prompt_ids), sampling)
    inner: TokenConstraint | None = None
    if options.forced_tools:
        available = conversation.tool_parameters()
        chosen = [{"name": name, "parameters": available[name]} for name in options.forced_tools]
        inner = ctx.grammars.tool_calls(chosen, options.several_calls)
    elif options.json_schema is not None:
        inner = ctx.grammars.json_schema(options.json_schema)
    thinking = options.enable_thinking is not False
    markers = ctx.grammars.markers
    starts_open = thinking and ids_open_thinking(prompt_ids, markers.ids(THINK_OPEN), markers.ids(THINK_CLOSE))
    constraint = inner
    budget = options.thinking_budget
    if inner is not None and budget is None:
        budget = max(1, params.max_tokens // 2)  # leave the enforced answer room to finish
    # Asked for explicitly, thinking starts at once (as Qwen's thinking models do); left to the
    # template's default, it may start, unless a grammar waits for the answer.
    opening = "forced" if options.enable_thinking is True else ("allowed" if inner is None else "never")
    if thinking and (inner is not None or budget is not None or opening == "forced"):
        constraint = ThinkingGate(
            inner, markers.ids(THINK_OPEN), markers.ids(THINK_CLOSE), budget, starts_open,
            tuple(ctx.engine.tokenizer.stop_token_ids), opening,
        )
    return ReplyPlan(prompt_ids, params, constraint, thinking, starts_open, options.parse_tools or bool(options.forced_tools),
                     logprobs, tuple(ctx.engine.tokenizer.message_starts(prompt_ids)))


def plan_completion(ctx: ServerContext, prompt: str | list[int], sampling: Sampling,
                    logprobs: LogprobRequest | None = None) -> ReplyPlan:
    """The caller's raw prompt: text is encoded as written, marker text becoming markers. With
    `max_tokens` 0 the plan only scores the prompt (its caller checks that echo asked for that)."""
    if isinstance(prompt, str):
        ctx.check_prompt_size(len(prompt), "prompt")
    prompt_ids = ctx.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    vocab = len(ctx.engine.tokenizer.tokenizer)
    if not prompt_ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if any(not 0 <= token < vocab for token in prompt_ids):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    if sampling.max_tokens == 0:
        _check_fits(ctx, len(prompt_ids), room=0)
        return ReplyPlan(prompt_ids, None, logprobs=logprobs)
    return ReplyPlan(prompt_ids, sampling_params(ctx, len(prompt_ids), sampling), logprobs=logprobs)


def _check_fits(ctx: ServerContext, prompt_tokens: int, room: int) -> None:
    """Refuse a prompt that leaves less than `room` tokens of the context."""
    limit = ctx.context_limit
    if limit - prompt_tokens < room:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens; the prompt has {prompt_tokens}.",
                       param="messages", code="context_length_exceeded")


def sampling_params(ctx: ServerContext, prompt_tokens: int, sampling: Sampling) -> SamplingParams:
    _check_fits(ctx, prompt_tokens, room=1)
    limit = ctx.context_limit
    room = limit - prompt_tokens
    max_tokens = sampling.max_tokens
    if max_tokens is not None and max_tokens > room:
        raise ApiError(400, f"This model's maximum context length is {limit} tokens; you requested "
                       f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} to generate).",
                       param="max_tokens", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(room, ctx.settings.default_max_tokens or room)
    temperature = 1.0 if sampling.temperature is None else sampling.temperature
    top_p = 1.0 if sampling.top_p is None else sampling.top_p
    if top_p == 0.0:  # the limit of nucleus sampling: only the most likely token
        temperature, top_p = 0.0, 1.0
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=sampling.top_k or 0, top_p=top_p,
                              seed=sampling.seed, stop_strings=sampling.stop)
    except FlashpackError as error:
        raise ApiError(400, str(error), code="invalid_value") from None


def run_reply(ctx: ServerContext, plan: ReplyPlan, request: Request | None = None) -> AsyncIterator[ReplyItem]:
    """Queue the generation now (a full queue raises here, before any response starts); iterate the
    result for its pieces, then one ReplyEnd.

    With `request`, a client that disconnects cancels the generation (non-streaming replies; a
    streaming reply is cancelled by its response closing the iterator).
    """
    job = ctx.scheduler.submit(plan.prompt_ids, plan.params, plan.constraint, plan.logprobs, plan.checkpoints)
    return _reply(ctx, plan, job, request)


async def _reply(ctx: ServerContext, plan: ReplyPlan, job: Job, request: Request | None) -> AsyncIterator[ReplyItem]:
    parser = ReplyParser(plan.thinking, plan.starts_in_thinking, plan.tools)
    token_ids: list[int] = []
    finish, calls, stop_logprob, cached = "stop", 0, None, 0
    try:
        async for event in _events(job, request):
            if event.prompt_logprobs is not None:
                yield PromptLogprobs(event.prompt_logprobs)
            if event.token_id is not None:
                token_ids.append(event.token_id)
                if event.logprob is not None:
                    yield event.logprob
            elif event.logprob is not None:
                stop_logprob = event.logprob
            pieces = parser.push(event.text)
            if event.finish_reason is not None:
                finish = event.finish_reason
                cached = int((event.timings or {}).get("cached_tokens", 0))
                pieces += parser.finish()
            for piece in pieces:
                calls += piece.kind == "tool_call"
                yield piece
    finally:
        job.cancel()  # a no-op once finished; stops the worker if our consumer went away
    stop_sequence = _matched_stop(ctx, token_ids, plan.params.stop_strings) if finish == "stop" and plan.params else None
    if calls and finish == "stop":
        finish = "tool_calls"
    yield ReplyEnd(finish, stop_sequence, len(plan.prompt_ids), len(token_ids), stop_logprob, cached)


async def _events(job: Job, request: Request | None) -> AsyncIterator[GenerationEvent]:
    if request is None:
        async for event in job:
            yield event
        return
    events, checked = job.__aiter__(), time.monotonic()
    while True:
        pending = asyncio.ensure_future(events.__anext__())
        while not pending.done():
            await asyncio.wait({pending}, timeout=DISCONNECT_POLL_SECONDS)
            if time.monotonic() - checked >= DISCONNECT_POLL_SECONDS:  # busy or idle, look every so often
                checked = time.monotonic()
                if await request.is_disconnected():
                    job.cancel()
        try:
            yield pending.result()
        except StopAsyncIteration:
            return


def _matched_stop(ctx: ServerContext, token_ids: list[int], stops: tuple[str, ...]) -> str | None:
    """Which stop string ended the reply (None when an end-of-turn token or a grammar did)."""
    if not stops or not token_ids:
        return None
    text = ctx.engine.tokenizer.tokenizer.decode(token_ids, skip_special_tokens=True)
    found = [(text.find(stop), stop) for stop in stops if stop in text]
    return min(found)[1] if found else None

