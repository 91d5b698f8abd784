"""OpenAI's legacy `/v1/completions`: text or token-id prompts, batches, `echo` and `logprobs`.

What an evaluation harness sends (lm-eval's `local-completions`: a batch of token-id prompts, `echo`,
`logprobs: 1`, `max_tokens` 0 or 1, `temperature` 0) comes back as OpenAI's legacy API and vLLM
answer it: one choice per prompt, in order (`index`), each with its prompt echoed and the log-
probabilities of every token (the prompt's first has none), a generated stop token's included.
Every prompt of a batch is planned (encoded, checked against the context) before any runs; then they
run one after another, the engine running one sequence at a time. Streaming sends each prompt's
chunks in turn, every chunk naming its choice's index.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from flashpack.runtime.logprobs import LogprobRequest, TokenLogprob
from flashpack.runtime.server.context import ServerContext, context_of
from flashpack.runtime.server.errors import ApiError, openai_error_body
from flashpack.runtime.server.openai_logprobs import CompletionLogprobs
from flashpack.runtime.server.openai_routes import FINISH_REASONS, response_meta, sampling_of, usage_of
from flashpack.runtime.server.openai_schemas import CompletionRequest
from flashpack.runtime.server.replies import PromptLogprobs, ReplyEnd, ReplyItem, ReplyPlan, plan_completion, run_reply
from flashpack.runtime.server.sse import data_event, sse_response

router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    ctx = context_of(request)
    ctx.check_model(body.model)
    if body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens 0 generates nothing: it needs echo (to score the prompt)", param="max_tokens",
                       code="invalid_value")
    logprobs = None if body.logprobs is None else LogprobRequest(body.logprobs, prompt=body.echo)
    sampling = sampling_of(body)
    plans = await run_in_threadpool(lambda: [plan_completion(ctx, p, sampling, logprobs) for p in body.prompts()])
    meta = response_meta("cmpl", ctx)
    # the first prompt is queued now: a full queue is a 429 before any response starts
    replies = _replies(ctx, plans, None if body.stream else request)
    first = await anext(replies)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_streamed(ctx, first, replies, body.echo, meta, include_usage))
    choices, ends = [], []
    async for index, plan, reply in _chained(first, replies):
        choice = _Choice(ctx, plan, index, body.echo)
        async for item in reply:
            choice.take(item)
        choices.append(choice.whole())
        ends.append(choice.end)
    return {**meta, "object": "text_completion", "choices": choices, "usage": _total_usage(ends)}


class _Choice:
    """One prompt's reply as it arrives: its text and logprobs, whole or a streamed chunk at a time."""

    def __init__(self, ctx: ServerContext, plan: ReplyPlan, index: int, echo: bool):
        self.plan, self.index = plan, index
        self.logprobs = CompletionLogprobs(ctx.grammars.token_bytes) if plan.logprobs is not None else None
        self.echo = _prompt_text(ctx, plan) if echo else ""
        self.special_ids = frozenset(ctx.engine.tokenizer.tokenizer.all_special_ids)  # not in generated text
        self.text: list[str] = []
        self.end: ReplyEnd | None = None

    def take(self, item: ReplyItem) -> str | None:
        """Note one item of the reply; return the text it adds to the choice (None: nothing yet)."""
        if isinstance(item, PromptLogprobs):
            if self.logprobs is not None:  # echo with max_tokens 0 scores the prompt, asked for logprobs or not
                self.logprobs.add_prompt(self.plan.prompt_ids, item.entries)
            return None
        if isinstance(item, TokenLogprob):
            self.logprobs.add(item.token_id, item, shows=item.token_id not in self.special_ids)
            return None
        if isinstance(item, ReplyEnd):
            self.end = item
            if self.logprobs is not None and item.stop_logprob is not None:
                self.logprobs.add(item.stop_logprob.token_id, item.stop_logprob, shows=False)
            return None
        self.text.append(item.text)
        return item.text

    def chunk(self, text: str, finish: str | None = None) -> dict[str, Any]:
        logprobs = self.logprobs.take() if self.logprobs is not None else None
        return {"text": text, "index": self.index, "logprobs": logprobs, "finish_reason": finish}

    def whole(self) -> dict[str, Any]:
        return self.chunk(self.echo + "".join(self.text), FINISH_REASONS[self.end.finish])


Replies = AsyncIterator[tuple[int, ReplyPlan, AsyncIterator[ReplyItem]]]


async def _replies(ctx: ServerContext, plans: list[ReplyPlan], request: Request | None) -> Replies:
    """Each prompt's reply in turn, each queued once the one before it has been read."""
    for index, plan in enumerate(plans):
        yield index, plan, run_reply(ctx, plan, request)


async def _chained(first: tuple, rest: Replies) -> Replies:
    yield first
    async for reply in rest:
        yield reply


async def _streamed(ctx: ServerContext, first: tuple, rest: Replies, echo: bool, meta: dict,
                    include_usage: bool) -> AsyncIterator[str]:
    def event(choice: dict[str, Any]) -> str:
        return data_event({**meta, "object": "text_completion", "choices": [choice]})

    ends: list[ReplyEnd] = []
    try:
        async for index, plan, reply in _chained(first, rest):
            choice = _Choice(ctx, plan, index, echo)
            opened = not echo
            async for item in reply:
                # the echo opens the choice, carrying the prompt's logprobs (which come first)
                if not opened and not isinstance(item, PromptLogprobs):
                    opened = True
                    yield event(choice.chunk(choice.echo))
                text = choice.take(item)
                if isinstance(item, ReplyEnd):
                    yield event(choice.chunk("", FINISH_REASONS[item.finish]))
                elif text is not None:
                    yield event(choice.chunk(text))
            ends.append(choice.end)
        if include_usage:
            yield data_event({**meta, "object": "text_completion", "choices": [], "usage": _total_usage(ends)})
    except ApiError as error:
        yield data_event(openai_error_body(error))
    yield "data: [DONE]\n\n"


def _total_usage(ends: list[ReplyEnd]) -> dict:
    totals = [usage_of(end) for end in ends]
    summed = {key: sum(usage[key] for usage in totals) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return {**summed, "prompt_tokens_details": {"cached_tokens": sum(end.cached_tokens for end in ends)}}


def _prompt_text(ctx: ServerContext, plan: ReplyPlan) -> str:
    return ctx.engine.tokenizer.tokenizer.decode(plan.prompt_ids, skip_special_tokens=False)
