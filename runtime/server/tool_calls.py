"""Reading a reply as it streams: reasoning, text, and tool calls.

The model writes `<think>reasoning</think>` (when thinking) and `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` blocks between plain text. `ReplyParser.push(text)` takes pieces as they come and
returns what is certain so far; a possible start of a tag is held back until it is resolved. A tool
call is emitted whole, once its closing tag arrives; a block that is not a valid call (bad JSON, no
name) comes back as ordinary text, tags included, so a malformed call is never an error.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from flashpack.runtime.server.markers import CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass(frozen=True)
class Piece:
    kind: str  # "reasoning", "text" or "tool_call"
    text: str = ""
    call: ToolCall | None = None


def parse_tool_call(body: str) -> ToolCall | None:
    """The JSON between the tags -> a ToolCall, or None if it is not a well-formed call."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str) or not payload["name"]:
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(payload["name"], arguments)


class ReplyParser:
    """States: "start" (a <think> may open), "reasoning", "text", "call" (inside <tool_call>)."""

    def __init__(self, thinking: bool, starts_in_thinking: bool, tools: bool):
        self.tools = tools
        self.state = "reasoning" if starts_in_thinking else ("start" if thinking else "text")
        self.buffer = ""
        self.strip_newlines = starts_in_thinking  # a reasoning block starts after "<think>\n"
        self.calls = 0

    def push(self, text: str) -> list[Piece]:
        self.buffer += text
        pieces: list[Piece] = []
        while self.buffer:
            before = (self.state, len(self.buffer))
            pieces += self._step()
            if (self.state, len(self.buffer)) == before:
                break  # waiting for more text
        return [p for p in pieces if p.text or p.call]

    def finish(self) -> list[Piece]:
        """The rest, at the end of generation: an unclosed tool call is text."""
        rest, self.buffer = self.buffer, ""
        if self.state == "call":
            return [Piece("text", CALL_OPEN + rest)]
        if self.state == "reasoning":
            return [Piece("reasoning", rest.rstrip("\n"))] if rest.rstrip("\n") else []
        return [Piece("text", rest)] if rest else []

    def _step(self) -> list[Piece]:
        if self.strip_newlines:
            self.buffer = self.buffer.lstrip("\n")
            if not self.buffer:
                return []
            self.strip_newlines = False
        if self.state == "start":
            return self._start()
        if self.state == "reasoning":
            return self._until(THINK_CLOSE, "reasoning", "text", rstrip="\n")
        if self.state == "text":
            if not self.tools:
                out, self.buffer = self.buffer, ""
                return [Piece("text", out)]
            return self._until(CALL_OPEN, "text", "call", rstrip="\n")
        return self._call()

    def _start(self) -> list[Piece]:
        stripped = self.buffer.lstrip()
        if stripped.startswith(THINK_OPEN):
            self.buffer = stripped[len(THINK_OPEN):]
            self.state, self.strip_newlines = "reasoning", True
        elif not THINK_OPEN.startswith(stripped):
            self.state = "text"
        return []

    def _until(self, tag: str, kind: str, next_state: str, rstrip: str) -> list[Piece]:
        """Emit `kind` text up to `tag`; at the tag, switch state; hold back a partial tag."""
        at = self.buffer.find(tag)
        if at >= 0:
            out, self.buffer = self.buffer[:at], self.buffer[at + len(tag):]
            self.state, self.strip_newlines = next_state, next_state == "text"
            return [Piece(kind, out.rstrip(rstrip))]
        keep = _partial_tag_length(self.buffer, tag)
        out, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        if rstrip:  # newlines just before a tag are the tag's; hold them until we know what follows
            held = len(out) - len(out.rstrip(rstrip))
            out, self.buffer = out[: len(out) - held], out[len(out) - held:] + self.buffer
        return [Piece(kind, out)]

    def _call(self) -> list[Piece]:
        at = self.buffer.find(CALL_CLOSE)
        if at < 0:
            return []
        body, self.buffer = self.buffer[:at], self.buffer[at + len(CALL_CLOSE):]
        self.state, self.strip_newlines = "text", True
        call = parse_tool_call(body.strip())
        if call is None:
            return [Piece("text", CALL_OPEN + body + CALL_CLOSE)]
        self.calls += 1
        return [Piece("tool_call", call=call)]


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
