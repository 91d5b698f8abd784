"""OpenAI request bodies (chat completions, completions) as pydantic models.

Unknown fields are ignored, as clients send new ones first; wrong types and out-of-range values
fail validation and come back as a 400 in OpenAI's error shape. Extensions beyond OpenAI's API:
`chat_template_kwargs` (`enable_thinking`, as vLLM and SGLang take it), `max_thinking_tokens`, `top_k`.
Every string in a body must be valid Unicode and nest at most request_text.MAX_DEPTH deep; a seed
must fit in 64 bits.

Log-probabilities: `/v1/completions` takes `logprobs: N` (the N most likely alternatives per position)
and `echo` (the prompt's own, with `max_tokens` 0 nothing is generated); chat takes `logprobs: true` and
`top_logprobs: N`. N is at most MAX_LOGPROBS on both (OpenAI allows 5 on completions and 20 on chat,
vLLM 20 on both). A completions prompt may be a batch, at most MAX_PROMPTS prompts, run one after another.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator
from pydantic_core import PydanticCustomError

from flashpack.runtime.sampling import SEED_RANGE
from flashpack.runtime.server.request_text import checked_body

TOOL_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"
MAX_LOGPROBS = 20
MAX_PROMPTS = 64


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class FunctionDefinition(_Model):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: FunctionName


class JsonSchemaFormat(_Model):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ContentPart(_Model):
    type: str
    text: str | None = None


class CalledFunction(_Model):
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(_Model):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(_Model):
    include_usage: bool = False


class _Sampling(_Model):
    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # accepted, not applied
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)  # accepted, not applied
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        return checked_body(data)

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return tuple(s for s in stops if s)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_thinking_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(16, ge=0)  # 0: only with echo, the prompt's logprobs and nothing generated
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Literal[""] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_form(cls, value: Any) -> Any:
        """One clear complaint for a prompt of no known form (pydantic would list one per form)."""
        if isinstance(value, str) or (isinstance(value, list) and _is_ids(value) and value):
            return value
        if isinstance(value, list) and value and (all(isinstance(p, str) for p in value)
                                                  or all(isinstance(p, list) and _is_ids(p) for p in value)):
            if len(value) > MAX_PROMPTS:
                raise PydanticCustomError("too_many_prompts", "at most {limit} prompts a request, got {count}",
                                          {"limit": MAX_PROMPTS, "count": len(value)})
            return value
        raise PydanticCustomError("prompt_form", "a prompt is a string, a non-empty list of token ids, or a "
                                  "non-empty list of either (a batch)")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, one a choice, in order."""
        if isinstance(self.prompt, str) or not isinstance(self.prompt[0], (str, list)):
            return [self.prompt]
        return list(self.prompt)


def _is_ids(values: list) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)
