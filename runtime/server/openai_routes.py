"""OpenAI routes: /v1/chat/completions, /v1/models (/v1/completions: openai_completions.py).

Streaming sends `chat.completion.chunk` objects as `data:` lines and ends with `data: [DONE]`;
reasoning goes in `reasoning_content`, tool calls in `tool_calls` deltas (each call whole, in one
delta, once its closing tag has been generated). With `logprobs: true` each generated token's
log-probability (and its `top_logprobs` most likely alternatives) comes in `logprobs.content`,
reasoning and tool-call tokens included, the end-of-turn token not; streamed, a chunk carries those
of the tokens generated since the chunk before.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from flashpack.runtime.logprobs import LogprobRequest, TokenLogprob
from flashpack.runtime.server.chat_format import from_openai
from flashpack.runtime.server.context import ServerContext, context_of
from flashpack.runtime.server.errors import ApiError, openai_error_body
from flashpack.runtime.server.openai_logprobs import chat_entry, chat_logprobs
from flashpack.runtime.server.openai_schemas import ChatCompletionRequest, CompletionRequest
from flashpack.runtime.server.replies import ChatOptions, ReplyEnd, ReplyItem, Sampling, plan_chat, run_reply
from flashpack.runtime.server.sse import data_event, sse_response
from flashpack.runtime.server.tool_calls import Piece

router = APIRouter()
FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "cancelled": "stop"}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(context_of(request))]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    ctx = context_of(request)
    ctx.check_model(model_id)
    return _model_card(ctx)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    ctx = context_of(request)
    ctx.check_model(body.model)
    conversation = from_openai(body)
    options = _chat_options(body, set(conversation.tool_parameters()))
    logprobs = _chat_logprobs(body)
    plan = await run_in_threadpool(plan_chat, ctx, conversation, options, sampling_of(body), logprobs)
    reply = run_reply(ctx, plan, None if body.stream else request)
    meta = response_meta("chatcmpl", ctx)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_chat_chunks(ctx, reply, meta, include_usage))
    reasoning, text, calls, scored, end = [], [], [], [], None
    async for item in reply:
        if isinstance(item, ReplyEnd):
            end = item
        elif isinstance(item, TokenLogprob):
            scored.append(chat_entry(item, ctx.grammars.token_bytes))
        elif item.kind == "tool_call":
            calls.append(_tool_call(item))
        else:
            (reasoning if item.kind == "reasoning" else text).append(item.text)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    choice = {"index": 0, "message": message, "logprobs": chat_logprobs(scored) if logprobs else None,
              "finish_reason": FINISH_REASONS[end.finish]}
    return {**meta, "object": "chat.completion", "choices": [choice], "usage": usage_of(end)}


async def _chat_chunks(ctx: ServerContext, reply: AsyncIterator[ReplyItem], meta: dict,
                       include_usage: bool) -> AsyncIterator[str]:
    scored: list[dict[str, Any]] = []  # logprobs of tokens not yet sent

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        logprobs = chat_logprobs(scored[:]) if scored else None
        scored.clear()
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return data_event({**meta, "object": "chat.completion.chunk", "choices": [choice]})

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    try:
        async for item in reply:
            if isinstance(item, TokenLogprob):
                scored.append(chat_entry(item, ctx.grammars.token_bytes))
            elif isinstance(item, ReplyEnd):
                if scored:  # tokens whose text never showed (held back, then cut): their own chunk
                    yield chunk({})
                yield chunk({}, FINISH_REASONS[item.finish])
                if include_usage:
                    yield data_event({**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage_of(item)})
            elif item.kind == "tool_call":
                yield chunk({"tool_calls": [{"index": calls, **_tool_call(item)}]})
                calls += 1
            elif item.kind == "reasoning":
                yield chunk({"reasoning_content": item.text})
            else:
                yield chunk({"content": item.text})
    except ApiError as error:
        yield data_event(openai_error_body(error))
    yield "data: [DONE]\n\n"


def _chat_options(body: ChatCompletionRequest, tool_names: set[str]) -> ChatOptions:
    kwargs = body.chat_template_kwargs or {}
    enable_thinking = kwargs.get("enable_thinking")
    if enable_thinking is not None and not isinstance(enable_thinking, bool):
        raise ApiError(400, "chat_template_kwargs.enable_thinking must be a boolean", param="chat_template_kwargs")
    options = ChatOptions(enable_thinking=enable_thinking, thinking_budget=body.max_thinking_tokens)
    choice = body.tool_choice if tool_names else None
    if body.tool_choice not in (None, "none", "auto") and not tool_names:
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    if choice == "required":
        options.forced_tools = sorted(tool_names)
    elif choice is not None and not isinstance(choice, str):
        if choice.function.name not in tool_names:
            raise ApiError(400, f"tool_choice names `{choice.function.name}`, which is not among the tools",
                           param="tool_choice")
        options.forced_tools = [choice.function.name]
    options.several_calls = body.parallel_tool_calls and choice == "required"
    options.parse_tools = bool(tool_names) and choice != "none"
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ApiError(400, "response_format.json_schema is required for type json_schema", param="response_format")
        options.json_schema = fmt.json_schema.schema_
    elif fmt is not None and fmt.type == "json_object":
        options.json_schema = {"type": "object"}
    return options


def _chat_logprobs(body: ChatCompletionRequest) -> LogprobRequest | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    return LogprobRequest(body.top_logprobs or 0) if body.logprobs else None


def sampling_of(body: ChatCompletionRequest | CompletionRequest) -> Sampling:
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    return Sampling(max_tokens, body.temperature, body.top_p, body.top_k, body.seed, body.stop_strings())


def _tool_call(piece: Piece) -> dict[str, Any]:
    call = piece.call
    return {"id": f"call_{call.id}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json}}


def usage_of(end: ReplyEnd) -> dict:
    return {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": end.cached_tokens}}


def response_meta(prefix: str, ctx: ServerContext) -> dict[str, Any]:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": ctx.settings.model_name}


def _model_card(ctx: ServerContext) -> dict[str, Any]:
    return {"id": ctx.settings.model_name, "object": "model", "created": int(ctx.started), "owned_by": "flashpack",
            "max_model_len": ctx.context_limit}

