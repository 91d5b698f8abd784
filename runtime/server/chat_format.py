"""Both APIs' conversations -> the chat template's messages and tools (Qwen / transformers layout).

    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "reasoning_content": str (assistant), "tool_calls": [{"name", "arguments": dict}] (assistant)}
    tools: [{"type": "function", "function": {"name", "description", "parameters"}}]

Tool results go back as role=tool messages, which the template wraps in <tool_response> tags. An
OpenAI assistant message that carries its reasoning inline (`<think>...</think>answer`, as some
clients send a reply back) is split into reasoning_content and content, as the reply parser reads a
reply: the template then places both, and neither holds a tag the chat encoder would keep as text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from flashpack.runtime.server import anthropic_schemas as anth
from flashpack.runtime.server import openai_schemas as oai
from flashpack.runtime.server.errors import ApiError
from flashpack.runtime.server.markers import THINK_CLOSE, THINK_OPEN


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)  # template layout

    def tool_parameters(self) -> dict[str, dict[str, Any] | None]:
        return {t["function"]["name"]: t["function"].get("parameters") for t in self.tools}

    def text_length(self) -> int:
        """Characters in every string of the messages and tools (keys included): what the client
        sent, before the template adds to it."""
        total, stack = 0, [self.messages, self.tools]
        while stack:
            value = stack.pop()
            if isinstance(value, str):
                total += len(value)
            elif isinstance(value, dict):
                total += sum(len(key) for key in value if isinstance(key, str))
                stack.extend(value.values())
            elif isinstance(value, list):
                stack.extend(value)
        return total


def from_openai(request: oai.ChatCompletionRequest) -> Conversation:
    messages = []
    for index, message in enumerate(request.messages):
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": _openai_text(message.content, f"messages.{index}.content")}
        if role == "assistant":
            if not message.reasoning_content and THINK_CLOSE in entry["content"]:
                entry["reasoning_content"], entry["content"] = _inline_reasoning(entry["content"])
            elif message.reasoning_content:
                entry["reasoning_content"] = message.reasoning_content
            if message.tool_calls:
                entry["tool_calls"] = [
                    {"name": call.function.name, "arguments": _arguments(call.function.arguments)}
                    for call in message.tool_calls
                ]
        messages.append(entry)
    tools = [
        {"type": "function", "function": tool.function.model_dump(exclude_none=True, exclude={"strict"})}
        for tool in request.tools or []
    ]
    return Conversation(messages, tools)


def from_anthropic(request: anth.MessagesRequest | anth.CountTokensRequest) -> Conversation:
    messages: list[dict[str, Any]] = []
    if request.system:
        system = request.system if isinstance(request.system, str) else "\n\n".join(b.text for b in request.system)
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(request.messages):
        blocks = [anth.TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        messages += _anthropic_turn(message.role, blocks, f"messages.{index}.content")
    tools = [
        {"type": "function", "function": {"name": t.name, **({"description": t.description} if t.description else {}),
                                          "parameters": t.input_schema}}
        for t in request.tools or []
    ]
    return Conversation(messages, tools)


def _anthropic_turn(role: str, blocks: list[Any], where: str) -> list[dict[str, Any]]:
    texts, thinking, calls, results = [], [], [], []
    for block in blocks:
        if isinstance(block, anth.TextBlock):
            texts.append(block.text)
        elif isinstance(block, anth.ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, anth.ToolUseBlock):
            calls.append({"name": block.name, "arguments": block.input})
        elif isinstance(block, anth.ToolResultBlock):
            results.append({"role": "tool", "content": _tool_result_text(block, where)})
        elif block.type != "redacted_thinking":
            raise ApiError(400, f"{where}: {block.type} content is not supported by this server", param=where)
    if role == "assistant":
        if results:
            raise ApiError(400, f"{where}: tool_result blocks belong in user messages", param=where)
        entry: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if thinking:
            entry["reasoning_content"] = "\n".join(thinking)
        if calls:
            entry["tool_calls"] = calls
        return [entry]
    if calls or thinking:
        raise ApiError(400, f"{where}: tool_use and thinking blocks belong in assistant messages", param=where)
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _tool_result_text(block: anth.ToolResultBlock, where: str) -> str:
    if isinstance(block.content, str):
        text = block.content
    else:
        parts = []
        for part in block.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}: tool_result content must be text", param=where)
            parts.append(part["text"])
        text = "".join(parts)
    return f"Error: {text}" if block.is_error else text


def _openai_text(content: str | list[oai.ContentPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, f"{where}: {part.type} content is not supported by this server", param=where)
        texts.append(part.text)
    return "".join(texts)


def _inline_reasoning(content: str) -> tuple[str, str]:
    """`<think>reasoning</think>answer` -> (reasoning, answer), at the last </think>."""
    reasoning, _, answer = content.rpartition(THINK_CLOSE)
    reasoning = reasoning.strip("\n")
    if reasoning.startswith(THINK_OPEN):
        reasoning = reasoning[len(THINK_OPEN):]
    return reasoning.strip("\n"), answer.lstrip("\n")


def _arguments(arguments: str | dict[str, Any]) -> dict[str, Any] | str:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments  # the template prints a string as it is
    return parsed if isinstance(parsed, dict) else arguments
