"""Anthropic routes: /v1/messages (and /v1/messages/count_tokens).

Streaming follows the Messages API event sequence:
    message_start, ping, (content_block_start, content_block_delta*, content_block_stop)*,
    message_delta (stop_reason, usage), message_stop
Thinking comes as `thinking` blocks (thinking_delta, then a signature_delta), tool calls as
`tool_use` blocks whose input arrives in one input_json_delta.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from flashpack.runtime.server.anthropic_schemas import CountTokensRequest, MessagesRequest
from flashpack.runtime.server.chat_format import from_anthropic
from flashpack.runtime.server.context import context_of
from flashpack.runtime.server.errors import ApiError, anthropic_error_body
from flashpack.runtime.server.replies import ChatOptions, ReplyEnd, Sampling, encode_prompt, plan_chat, run_reply
from flashpack.runtime.server.sse import named_event, sse_response
from flashpack.runtime.server.tool_calls import Piece

router = APIRouter()


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    ctx = context_of(request)
    ctx.check_model(body.model)
    conversation = from_anthropic(body)
    sampling = Sampling(body.max_tokens, body.temperature, body.top_p, body.top_k, None, tuple(body.stop_sequences or ()))
    options = _options(body, set(conversation.tool_parameters()))
    plan = await run_in_threadpool(plan_chat, ctx, conversation, options, sampling)
    reply = run_reply(ctx, plan, None if body.stream else request)
    message = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": body.model}
    show_thinking = body.thinking is None or body.thinking.display != "omitted"
    if body.stream:
        return sse_response(_events(reply, message, len(plan.prompt_ids), show_thinking))
    blocks: list[dict[str, Any]] = []
    end = None
    async for item in reply:
        if isinstance(item, ReplyEnd):
            end = item
        elif item.kind == "tool_call":
            blocks.append(_tool_use(item))
        else:
            kind, field = ("thinking", "thinking") if item.kind == "reasoning" else ("text", "text")
            if blocks and blocks[-1]["type"] == kind:
                blocks[-1][field] += item.text
            else:
                blocks.append({"type": kind, field: item.text})
    for block in blocks:
        if block["type"] == "thinking":
            block["signature"] = _signature(block["thinking"])
            block["thinking"] = block["thinking"] if show_thinking else ""
    # input_tokens counts the whole prompt; cache_read_input_tokens the part restored from saved state
    usage = {"input_tokens": end.prompt_tokens, "output_tokens": end.completion_tokens,
             "cache_read_input_tokens": end.cached_tokens, "cache_creation_input_tokens": 0}
    return {**message, "content": blocks, "stop_reason": _stop_reason(end), "stop_sequence": end.stop_sequence,
            "usage": usage}


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    ctx = context_of(request)
    ctx.check_model(body.model)
    thinking = body.thinking is not None and body.thinking.type != "disabled"
    prompt_ids = await run_in_threadpool(encode_prompt, ctx, from_anthropic(body), thinking)
    return {"input_tokens": len(prompt_ids)}


async def _events(
    reply: AsyncIterator[Piece | ReplyEnd], message: dict[str, Any], input_tokens: int, show_thinking: bool,
) -> AsyncIterator[str]:
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
    yield named_event("message_start", {"type": "message_start", "message": start})
    yield named_event("ping", {"type": "ping"})
    index, open_kind, thought = -1, None, []

    def close() -> list[str]:
        out = []
        if open_kind == "reasoning":
            delta = {"type": "signature_delta", "signature": _signature("".join(thought))}
            out.append(named_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
        if open_kind is not None:
            out.append(named_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        return out

    try:
        async for item in reply:
            if isinstance(item, ReplyEnd):
                for event in close():
                    yield event
                delta = {"stop_reason": _stop_reason(item), "stop_sequence": item.stop_sequence}
                yield named_event("message_delta", {"type": "message_delta", "delta": delta,
                                                    "usage": {"output_tokens": item.completion_tokens}})
                yield named_event("message_stop", {"type": "message_stop"})
                continue
            if item.kind != open_kind or item.kind == "tool_call":
                for event in close():
                    yield event
                index, open_kind, thought = index + 1, item.kind, []
                yield named_event("content_block_start", {"type": "content_block_start", "index": index,
                                                          "content_block": _empty_block(item)})
            if item.kind == "tool_call":
                delta = {"type": "input_json_delta", "partial_json": item.call.arguments_json}
            elif item.kind == "reasoning":
                thought.append(item.text)
                if not show_thinking:
                    continue  # display "omitted": the block and its signature, no text
                delta = {"type": "thinking_delta", "thinking": item.text}
            else:
                delta = {"type": "text_delta", "text": item.text}
            yield named_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
    except ApiError as error:
        yield named_event("error", anthropic_error_body(error))


def _options(body: MessagesRequest, tool_names: set[str]) -> ChatOptions:
    thinking = body.thinking
    enabled = thinking is not None and thinking.type != "disabled"
    options = ChatOptions(enable_thinking=enabled, thinking_budget=thinking.budget_tokens if enabled else None)
    if body.output_config is not None and body.output_config.format is not None:
        options.json_schema = body.output_config.format.schema_
    choice = body.tool_choice
    if choice is not None and choice.type in ("any", "tool") and not tool_names:
        raise ApiError(400, f"tool_choice.type `{choice.type}` needs tools", param="tool_choice")
    if choice is not None and choice.type == "any":
        options.forced_tools = sorted(tool_names)
    elif choice is not None and choice.type == "tool":
        if choice.name not in tool_names:
            raise ApiError(400, f"tool_choice names `{choice.name}`, which is not among the tools", param="tool_choice")
        options.forced_tools = [choice.name]
    options.several_calls = choice is not None and choice.type == "any" and not choice.disable_parallel_tool_use
    options.parse_tools = bool(tool_names) and (choice is None or choice.type != "none")
    return options


def _empty_block(piece: Piece) -> dict[str, Any]:
    if piece.kind == "tool_call":
        return {"type": "tool_use", "id": f"toolu_{piece.call.id}", "name": piece.call.name, "input": {}}
    if piece.kind == "reasoning":
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


def _tool_use(piece: Piece) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{piece.call.id}", "name": piece.call.name, "input": piece.call.arguments}


def _stop_reason(end: ReplyEnd) -> str:
    if end.finish == "tool_calls":
        return "tool_use"
    if end.finish == "length":
        return "max_tokens"
    return "stop_sequence" if end.stop_sequence is not None else "end_turn"


def _signature(thinking: str) -> str:
    """Stands in for Anthropic's signature: a digest of the thinking text (clients send it back)."""
    return hashlib.sha256(thinking.encode()).hexdigest()
