"""How replies are read, end to end through both APIs: an engine that says a fixed text stands in for a
model that wrote tool calls or thinking of its own accord (no grammar involved)."""

from __future__ import annotations

import json

import pytest
from server_harness import KEY, MODEL, serving
from server_fakes import scripted_engine

from flashpack.runtime.server import ServerSettings

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
ANTHROPIC_TOOLS = [{"name": "lookup", "input_schema": {"type": "object"}}]
ASK = [{"role": "user", "content": "Look it up."}]


@pytest.fixture
def saying(tiny_tokenizer):
    def serve(text: str):
        return serving(scripted_engine(tiny_tokenizer, text), ServerSettings(model_name=MODEL, api_key=KEY))

    return serve


def test_free_form_tool_calls_are_parsed_in_both_apis_streamed_or_not(saying):
    text = 'Let me check.\n<tool_call>\n{"name": "lookup", "arguments": {"q": "tides", "n": 2}}\n</tool_call>'
    with saying(text) as served:
        reply = served.openai().chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200)
        (call,) = reply.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("lookup", {"q": "tides", "n": 2})
        assert reply.choices[0].message.content == "Let me check."
        assert reply.choices[0].finish_reason == "tool_calls"

        chunks = list(served.openai().chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200,
                                                              stream=True))
        deltas = [c.choices[0].delta for c in chunks]
        (streamed,) = [call for d in deltas for call in d.tool_calls or []]
        assert streamed.index == 0 and streamed.function.name == "lookup"
        assert json.loads(streamed.function.arguments) == {"q": "tides", "n": 2}
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        with served.anthropic().messages.stream(model=MODEL, max_tokens=200, messages=ASK, tools=ANTHROPIC_TOOLS) as s:
            message = s.get_final_message()
        assert [b.type for b in message.content] == ["text", "tool_use"]
        assert message.content[1].input == {"q": "tides", "n": 2} and message.stop_reason == "tool_use"


@pytest.mark.parametrize("body", ['{"name": "lookup", "arguments": {"q": ', '{"arguments": {}}', "not json at all"])
def test_a_malformed_tool_call_comes_back_as_text_with_a_normal_finish(saying, body):
    text = f"<tool_call>\n{body}\n</tool_call>"
    with saying(text) as served:
        reply = served.openai().chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=200)
        assert reply.choices[0].message.tool_calls is None
        assert reply.choices[0].message.content == text
        assert reply.choices[0].finish_reason == "stop"
        message = served.anthropic().messages.create(model=MODEL, max_tokens=200, messages=ASK, tools=ANTHROPIC_TOOLS)
        assert [b.type for b in message.content] == ["text"] and message.stop_reason == "end_turn"


def test_an_unclosed_tool_call_cut_by_max_tokens_is_text(saying, tiny_tokenizer):
    text = '<tool_call>\n{"name": "lookup", "arguments": {"q": "a long query"}}\n</tool_call>'
    with saying(text) as served:
        reply = served.openai().chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=6)
        assert reply.choices[0].finish_reason == "length"
        assert reply.choices[0].message.content == tiny_tokenizer.tokenizer.decode(tiny_tokenizer.encode(text)[:6])


def test_thinking_is_reasoning_content_and_thinking_blocks(saying):
    with saying("<think>\nFirst, the tides.\n</think>\n\nHigh tide at noon.") as served:
        reply = served.openai().chat.completions.create(model=MODEL, messages=ASK, max_tokens=200)
        assert reply.choices[0].message.reasoning_content == "First, the tides."
        assert reply.choices[0].message.content == "High tide at noon."
        with served.anthropic().messages.stream(model=MODEL, max_tokens=200, messages=ASK,
                                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
            kinds = [event.type for event in stream]
            message = stream.get_final_message()
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == "First, the tides." and message.content[0].signature
        assert message.content[1].text == "High tide at noon."
        assert kinds.count("content_block_start") == 2 and "thinking" in kinds
        omitted = served.anthropic().messages.create(model=MODEL, max_tokens=200, messages=ASK,
                                                     thinking={"type": "adaptive", "display": "omitted"})
        assert omitted.content[0].thinking == "" and omitted.content[0].signature == message.content[0].signature
