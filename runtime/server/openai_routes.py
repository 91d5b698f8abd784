"""OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models.

Streaming sends `chat.completion.chunk` (or `text_completion`) objects as `data:` lines and ends
with `data: [DONE]`; reasoning goes in `reasoning_content`, tool calls in `tool_calls` deltas (each
call whole, in one delta, once its closing tag has been generated).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from flashpack.runtime.server.chat_format import from_openai
from flashpack.runtime.server.context import ServerContext, context_of
from flashpack.runtime.server.errors import ApiError, openai_error_body
from flashpack.runtime.server.openai_schemas import ChatCompletionRequest, CompletionRequest
from flashpack.runtime.server.replies import ChatOptions, ReplyEnd, ReplyPlan, Sampling, plan_chat, plan_completion, run_reply
from flashpack.runtime.server.sse import data_event, sse_response
from flashpack.runtime.server.tool_calls import Piece

router = APIRouter()
_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "cancelled": "stop"}


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
    plan = await run_in_threadpool(plan_chat, ctx, conversation, options, _sampling(body))
    reply = run_reply(ctx, plan, None if body.stream else request)
    meta = _meta("chatcmpl", ctx)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_chat_chunks(reply, meta, include_usage))
    reasoning, text, calls, end = [], [], [], None
    async for item in reply:
        if isinstance(item, ReplyEnd):
            end = item
        elif item.kind == "tool_call":
            calls.append(_tool_call(item))
        else:
            (reasoning if item.kind == "reasoning" else text).append(item.text)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": _FINISH[end.finish]}
    return {**meta, "object": "chat.completion", "choices": [choice], "usage": _usage(end)}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    ctx = context_of(request)
    ctx.check_model(body.model)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ApiError(400, "one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    plan = await run_in_threadpool(plan_completion, ctx, prompt, _sampling(body))
    reply = run_reply(ctx, plan, None if body.stream else request)
    echo = _prompt_text(ctx, plan) if body.echo else ""
    meta = _meta("cmpl", ctx)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_completion_chunks(reply, meta, echo, include_usage))
    texts, end = [echo], None
    async for item in reply:
        if isinstance(item, ReplyEnd):
            end = item
        else:
            texts.append(item.text)
    choice = {"text": "".join(texts), "index": 0, "logprobs": None, "finish_reason": _FINISH[end.finish]}
    return {**meta, "object": "text_completion", "choices": [choice], "usage": _usage(end)}


async def _chat_chunks(reply: AsyncIterator[Piece | ReplyEnd], meta: dict, include_usage: bool) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return data_event({**meta, "object": "chat.completion.chunk", "choices": [choice]})

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    try:
        async for item in reply:
            if isinstance(item, ReplyEnd):
                yield chunk({}, _FINISH[item.finish])
                if include_usage:
                    yield data_event({**meta, "object": "chat.completion.chunk", "choices": [], "usage": _usage(item)})
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


async def _completion_chunks(reply: AsyncIterator[Piece | ReplyEnd], meta: dict, echo: str, include_usage: bool) -> AsyncIterator[str]:
    def chunk(text: str, finish: str | None = None) -> str:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}
        return data_event({**meta, "object": "text_completion", "choices": [choice]})

    if echo:
        yield chunk(echo)
    try:
        async for item in reply:
            if isinstance(item, ReplyEnd):
                yield chunk("", _FINISH[item.finish])
                if include_usage:
                    yield data_event({**meta, "object": "text_completion", "choices": [], "usage": _usage(item)})
            else:
                yield chunk(item.text)
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


def _sampling(body: ChatCompletionRequest | CompletionRequest) -> Sampling:
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    return Sampling(max_tokens, body.temperature, body.top_p, body.top_k, body.seed, body.stop_strings())


def _tool_call(piece: Piece) -> dict[str, Any]:
    call = piece.call
    return {"id": f"call_{call.id}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json}}


def _usage(end: ReplyEnd) -> dict[str, int]:
    return {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens}


def _meta(prefix: str, ctx: ServerContext) -> dict[str, Any]:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": ctx.settings.model_name}


def _model_card(ctx: ServerContext) -> dict[str, Any]:
    return {"id": ctx.settings.model_name, "object": "model", "created": int(ctx.started), "owned_by": "flashpack",
            "max_model_len": ctx.context_limit}


def _prompt_text(ctx: ServerContext, plan: ReplyPlan) -> str:
    return ctx.engine.tokenizer.tokenizer.decode(plan.prompt_ids, skip_special_tokens=False)
