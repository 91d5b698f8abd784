"""The server end to end on the real tiny model, driven by the official openai and anthropic clients.

One server for the module (loopback, free port, uvicorn in a thread). Outputs of a random model are
gibberish, so text is checked against the Generator run directly on the same prompt, and structure
(tool calls, JSON) against its schema: the grammar, not luck, makes it valid.
"""

from __future__ import annotations

import json
import threading

import anthropic
import jsonschema
import openai
import pytest
from server_harness import KEY, MODEL, serving

from flashpack.runtime.sampling import SamplingParams
from flashpack.runtime.server import ServerSettings

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now in a city",
                                                  "parameters": WEATHER_PARAMETERS}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather now in a city", "input_schema": WEATHER_PARAMETERS}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
GREEDY = {"temperature": 0}  # the 2026 anthropic client has no sampling arguments: they go in the body


@pytest.fixture(scope="module")
def served(tiny_engine):
    settings = ServerSettings(model_name=MODEL, api_key=KEY, max_context=1024, max_request_bytes=256 * 1024)
    with serving(tiny_engine, settings) as served:
        yield served


def direct(engine, messages, max_tokens, enable_thinking=False, tools=None):
    """What the Generator says, greedily, for the same chat: the reference for the server's text."""
    prompt = engine.tokenizer.render_chat(messages, tools=tools, enable_thinking=enable_thinking)
    ids = engine.tokenizer.encode(prompt)
    return engine.generator.generate(ids, SamplingParams(max_tokens=max_tokens)), len(ids)


def test_openai_chat_greedy_equals_generator_streaming_or_not(served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    expected, prompt_tokens = direct(served.engine, messages, 8)
    client = served.openai()
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=NO_THINKING)
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == {"length": "length", "stop": "stop"}[expected.finish_reason]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, expected.completion_tokens)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=NO_THINKING))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reply.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == expected.completion_tokens


def test_openai_completions_equal_generator(served):
    engine = served.engine
    ids = engine.tokenizer.encode("The weather today")
    expected = engine.generator.generate(ids, SamplingParams(max_tokens=6))
    client = served.openai()
    reply = client.completions.create(model=MODEL, prompt="The weather today", max_tokens=6, temperature=0)
    assert reply.choices[0].text == expected.text
    assert reply.usage.prompt_tokens == len(ids)
    streamed = client.completions.create(model=MODEL, prompt="The weather today", max_tokens=6, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected.text


def test_openai_tool_call_round_trip(served):
    client = served.openai()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, tools=OPENAI_TOOLS, max_tokens=48, temperature=0.9, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body=NO_THINKING,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_PARAMETERS)

    follow_up = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, tools=OPENAI_TOOLS, tool_choice="none",
                                            max_tokens=3, temperature=0, extra_body=NO_THINKING)
    template_messages = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
        {"name": "get_weather", "arguments": arguments}]}, {"role": "tool", "content": "18 degrees and sunny"}]
    expected, prompt_tokens = direct(served.engine, template_messages, 3, tools=OPENAI_TOOLS)
    assert answer.usage.prompt_tokens == prompt_tokens  # the tool result went in through the template
    assert answer.choices[0].message.content == expected.text


def test_anthropic_streamed_tool_use_round_trip(served):
    client = served.anthropic()
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    with client.messages.stream(model=MODEL, max_tokens=48, messages=messages, tools=ANTHROPIC_TOOLS,
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_stop", "message_delta"} <= set(kinds)
    assert message.stop_reason == "tool_use"
    (tool_use,) = [block for block in message.content if block.type == "tool_use"]
    assert tool_use.name == "get_weather" and tool_use.id.startswith("toolu_")
    jsonschema.validate(tool_use.input, WEATHER_PARAMETERS)

    follow_up = messages + [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "-3 and snowing"}]},
    ]
    answer = client.messages.create(model=MODEL, max_tokens=3, messages=follow_up, tools=ANTHROPIC_TOOLS,
                                    extra_body={"temperature": 0})
    template_messages = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
        {"name": "get_weather", "arguments": tool_use.input}]}, {"role": "tool", "content": "-3 and snowing"}]
    openai_style_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                            "parameters": t["input_schema"]}} for t in ANTHROPIC_TOOLS]
    expected, prompt_tokens = direct(served.engine, template_messages, 3, tools=openai_style_tools)
    assert answer.usage.input_tokens == prompt_tokens
    assert "".join(b.text for b in answer.content if b.type == "text") == expected.text


def test_json_schema_response_validates(served):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 999}, "sure": {"type": "boolean"},
                       "label": {"enum": ["cat", "dog"]}},
        "required": ["answer", "sure", "label"],
        "additionalProperties": False,
    }
    reply = served.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=40, temperature=1.0, seed=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_anthropic_text_greedy_stop_sequence_and_stream(served):
    messages = [{"role": "user", "content": "Say something."}]
    expected, prompt_tokens = direct(served.engine, messages, 10)
    client = served.anthropic()
    reply = client.messages.create(model=MODEL, max_tokens=10, messages=messages, extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant"
    assert "".join(b.text for b in reply.content) == expected.text
    assert reply.usage.input_tokens == prompt_tokens and reply.usage.output_tokens == expected.completion_tokens
    assert reply.stop_reason == ("max_tokens" if expected.finish_reason == "length" else "end_turn")

    text = expected.text
    cut = next(i for i in range(2, len(text) - 1) if text.find(text[i:i + 2]) == i and text[i:i + 2].strip())
    stop = text[cut:cut + 2]  # first seen mid-reply: the reply must end just before it
    with client.messages.stream(model=MODEL, max_tokens=10, messages=messages, extra_body=GREEDY,
                                stop_sequences=[stop]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text[:cut]
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_thinking_budget_forces_the_end_of_thinking(served):
    client = served.anthropic()
    reply = client.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "Think."}],
                                   thinking={"type": "enabled", "budget_tokens": 3}, extra_body=GREEDY)
    assert reply.content[0].type == "thinking" and reply.content[0].signature
    assert len(served.engine.tokenizer.encode(reply.content[0].thinking)) <= 3
    chunks = list(served.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Think."}], max_tokens=10, temperature=0, stream=True,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}, "max_thinking_tokens": 3}))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert reasoning and reasoning == reply.content[0].thinking  # the same greedy thoughts, cut at the same place


def test_concurrent_clients_each_get_their_own_answer(served):
    prompts = ["One.", "Two, please.", "Three is a crowd."]
    results: dict[str, str] = {}

    def ask(prompt: str) -> None:
        reply = served.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                                        max_tokens=4, temperature=0, extra_body=NO_THINKING)
        results[prompt] = reply.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for prompt in prompts:
        assert results[prompt] == direct(served.engine, [{"role": "user", "content": prompt}], 4)[0].text


def test_bad_requests_get_4xx_in_each_apis_shape_and_the_server_keeps_serving(served):
    client, messages = served.openai(), [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError):
        served.openai(api_key="wrong").models.list()
    with pytest.raises(anthropic.AuthenticationError) as caught:
        served.anthropic(api_key="wrong").messages.create(model=MODEL, max_tokens=2, messages=messages)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-5", messages=messages, max_tokens=2)
    assert caught.value.code == "model_not_found"
    with pytest.raises(anthropic.NotFoundError):
        served.anthropic().messages.create(model="claude", max_tokens=2, messages=messages)
    for bad in ({"temperature": 3.0}, {"top_p": 1.5}, {"max_tokens": 0}, {"n": 2}, {"max_tokens": "many"},
                {"messages": "hi"}, {"tool_choice": "required"}, {"response_format": {"type": "xml"}}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(**{"model": MODEL, "messages": messages, "max_tokens": 2, **bad})
        assert caught.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 1100}], max_tokens=2)
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as caught:
        served.anthropic().messages.create(model=MODEL, max_tokens=2, messages=messages, extra_body={"temperature": 1.5})
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        served.anthropic().messages.create(model=MODEL, max_tokens=2, messages=messages, tools=ANTHROPIC_TOOLS,
                                           tool_choice={"type": "tool", "name": "missing"})
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 300_000}], max_tokens=2)
    assert caught.value.status_code == 413
    status, body = served.raw("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [',
                              {"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = served.raw("POST", "/v1/messages", b"{not json", {"x-api-key": KEY, "content-type": "application/json"})
    assert status == 400 and body["type"] == "error"
    status, _ = served.raw("GET", "/v1/models")
    assert status == 401
    assert served.raw("GET", "/health")[0] == 200
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).choices[0].finish_reason
