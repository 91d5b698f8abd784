"""Anthropic Messages request bodies as pydantic models.

Content blocks are a union on `type`; images and documents parse (so the error says what is
unsupported rather than that the body is malformed) and are refused when the prompt is built.
Every string in a body must be valid Unicode and nest at most request_text.MAX_DEPTH deep.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flashpack.runtime.server.openai_schemas import TOOL_NAME
from flashpack.runtime.server.request_text import checked_body


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Model):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False


class ThinkingBlock(_Model):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class OtherBlock(_Model):
    type: Literal["image", "document", "redacted_thinking", "search_result", "server_tool_use"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | OtherBlock, Field(discriminator="type")]


class Message(_Model):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Model):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Model):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Model):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted, not applied


class _Body(_Model):
    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        return checked_body(data)


class MessagesRequest(_Body):
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    # Sampling fields: older clients send them (newer ones through extra_body); default temperature 1.
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(_Body):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    thinking: Thinking | None = None
