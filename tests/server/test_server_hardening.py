"""Hostile and extreme requests get a 4xx or a correct answer, never a 500; $defs/$ref schemas work.

Hand-made bodies go through the harness's raw urllib requests (the official clients would refuse
to send them); well-formed ones through the openai and anthropic clients. A fake model (random
logits) stands in where only the server's handling matters; grammars make structure valid anyway.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from server_fakes import fake_engine
from server_harness import KEY, MODEL, serving

from flashpack.runtime.sampling import Sampler, SamplingParams, filtered_probabilities
from flashpack.runtime.server import ServerSettings
from flashpack.runtime.server.constraints import _rerooted

HEADERS = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
CITY_SCHEMA = {
    "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                         "unit": {"anyOf": [{"$ref": "#/$defs/Unit"}, {"type": "null"}]}},
                       "required": ["name", "unit"], "additionalProperties": False},
              "Unit": {"enum": ["c", "f"]}},
    "type": "object",
    "properties": {"city": {"$ref": "#/$defs/City"}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city", "unit"], "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served(tiny_tokenizer):
    settings = ServerSettings(model_name=MODEL, api_key=KEY, max_request_bytes=1 << 20)
    with serving(fake_engine(tiny_tokenizer), settings) as served:
        yield served


def chat(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                       **fields}).encode()


def message(**fields) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                       **fields}).encode()


DEEP = {"type": "object", "properties": {"a": {}}}
for _ in range(300):
    DEEP = {"type": "object", "properties": {"a": DEEP}}
EXTREME_CHAT = {
    "lone surrogate escape": b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a\\ud800b"}]}',
    "raw surrogate bytes": b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a\xed\xa0\x80"}]}',
    "raw invalid byte": b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a\xffb"}]}',
    "surrogate in a key": b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a"}], '
                          b'"metadata": {"\\udfff": 1}}',
    "temperature 1e-300": chat(temperature=1e-300),
    "top_p 1e-300": chat(temperature=1.0, top_p=1e-300),
    "top_p 5e-324": chat(temperature=2.0, top_p=5e-324),
    "temperature NaN": b'{"model": "tiny", "max_tokens": 2, "temperature": NaN, "messages": [{"role": "user", "content": "a"}]}',
    "temperature Infinity": b'{"model": "tiny", "max_tokens": 2, "temperature": Infinity, "messages": []}',
    "temperature 1e999": b'{"model": "tiny", "max_tokens": 2, "temperature": 1e999, "messages": [{"role": "user", "content": "a"}]}',
    "seed 2^64": chat(temperature=1.0, seed=2**64),
    "seed -2^63 - 1": chat(temperature=1.0, seed=-(2**63) - 1),
    "seed 10^30": chat(temperature=1.0, seed=10**30),
    "seed of 5000 digits": b'{"model": "tiny", "max_tokens": 2, "seed": ' + b"9" * 5000 + b', "messages": []}',
    "max_tokens 10^30": chat(max_tokens=10**30),
    "top_k 2^70": chat(temperature=1.0, top_k=2**70),
    "max_thinking_tokens 10^30": chat(max_thinking_tokens=10**30),
    "schema nested 300 deep": chat(response_format={"type": "json_schema", "json_schema": {"schema": DEEP}}),
    "body nested 5000 deep": b'{"model": "tiny", "messages": [], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "schema with a dangling $ref": chat(response_format={"type": "json_schema", "json_schema": {"schema": {
        "$ref": "#/$defs/Nowhere"}}}),
    "tool schema not an object": chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}],
                                      tool_choice="required"),
    "tool schema with a bad type": chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "wibble"}}}], tool_choice="required"),
    "stop of an empty string": chat(stop=[""]),
    "empty body": b"",
    "json null": b"null",
}
EXTREME_MESSAGES = {
    "lone surrogate escape": b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "\\udbff"}]}',
    "surrogate in the system prompt": b'{"model": "tiny", "max_tokens": 2, "system": "\\ud800", "messages": '
                                      b'[{"role": "user", "content": "a"}]}',
    "surrogate in tool input": b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "a"}, '
                               b'{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", '
                               b'"input": {"q": "\\ud800"}}]}]}',
    "temperature 1e-300": message(temperature=1e-300),
    "top_p 1e-300": message(temperature=1.0, top_p=1e-300),
    "top_k 10^30": message(temperature=1.0, top_k=10**30),
    "max_tokens 10^30": message(max_tokens=10**30),
    "thinking budget 10^30": message(thinking={"type": "enabled", "budget_tokens": 10**30}),
    "tool input nested 5000 deep": b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "assistant", "content": '
                                   b'[{"type": "tool_use", "id": "t", "name": "f", "input": {"a": ' + b"[" * 5000 +
                                   b"]" * 5000 + b"}}]}]}",
    "raw invalid byte": b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "\xc0\xaf"}]}',
}
EXTREME_COMPLETIONS = {
    "token id 2^70": json.dumps({"model": MODEL, "prompt": [2**70], "max_tokens": 2}).encode(),
    "negative token id": json.dumps({"model": MODEL, "prompt": [-1], "max_tokens": 2}).encode(),
    "temperature 1e-300": json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 2, "temperature": 1e-300}).encode(),
    "lone surrogate": b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}',
    "seed 2^64": json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 2, "seed": 2**64}).encode(),
}
SWEEP = ([("/v1/chat/completions", name, body) for name, body in EXTREME_CHAT.items()]
         + [("/v1/messages", name, body) for name, body in EXTREME_MESSAGES.items()]
         + [("/v1/messages/count_tokens", name, body) for name, body in EXTREME_MESSAGES.items()]
         + [("/v1/completions", name, body) for name, body in EXTREME_COMPLETIONS.items()])


@pytest.mark.parametrize("path, name, body", SWEEP, ids=[f"{path} {name}" for path, name, _ in SWEEP])
def test_extreme_requests_never_get_a_500(served, path, name, body):
    status, payload = served.raw("POST", path, body, HEADERS)
    assert status < 500, payload
    assert isinstance(payload, dict), payload  # an error in the API's shape, not a bare page


@pytest.mark.parametrize("body, where", [
    (EXTREME_CHAT["lone surrogate escape"], "messages.0.content"),
    (EXTREME_CHAT["raw surrogate bytes"], "messages.0.content"),
    (EXTREME_CHAT["surrogate in a key"], "metadata.?"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(served, body, where):
    status, payload = served.raw("POST", "/v1/chat/completions", body, HEADERS)
    assert status == 400 and payload["error"]["message"].startswith(f"{where}: "), payload
    assert "not valid Unicode" in payload["error"]["message"]


def test_invalid_utf8_is_a_400_saying_so(served):
    status, payload = served.raw("POST", "/v1/chat/completions", EXTREME_CHAT["raw invalid byte"], HEADERS)
    assert status == 400 and "not valid UTF-8" in payload["error"]["message"], payload
    status, payload = served.raw("POST", "/v1/messages", EXTREME_MESSAGES["raw invalid byte"], HEADERS)
    assert status == 400 and payload["type"] == "error" and "not valid UTF-8" in payload["error"]["message"]


def test_a_seed_past_64_bits_is_a_400_on_seed(served):
    status, payload = served.raw("POST", "/v1/chat/completions", EXTREME_CHAT["seed 2^64"], HEADERS)
    assert status == 400 and payload["error"]["param"] == "seed", payload


@pytest.mark.parametrize("fields", [{"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-300},
                                    {"temperature": 2.0, "top_p": 5e-324}])
def test_vanishing_temperature_or_top_p_answer_greedily(served, fields):
    client = served.openai()
    messages = [{"role": "user", "content": "Name a colour."}]
    greedy = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            extra_body=NO_THINKING)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, extra_body=NO_THINKING,
                                           **fields)
    assert reply.choices[0].message.content == greedy.choices[0].message.content


def test_sampling_stays_finite_at_the_extremes():
    logits = torch.tensor([0.5, 3.0, 2.9, -1.0])
    assert SamplingParams(temperature=1e-300).greedy and not SamplingParams(temperature=1e-4).greedy
    for top_p in (1e-300, 5e-324, 1e-45):
        probs = filtered_probabilities(logits, SamplingParams(temperature=1.0, top_p=top_p))
        assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]  # the top token alone
    assert Sampler(SamplingParams(temperature=1e-300, seed=2**64 - 1))(logits) == 1
    with pytest.raises(Exception, match="seed must fit in 64 bits"):
        SamplingParams(seed=2**64)


def test_tool_parameters_with_defs_and_refs_are_enforced(served):
    tools = [{"type": "function", "function": {"name": "trip", "parameters": CITY_SCHEMA}},
             {"type": "function", "function": {"name": "other", "parameters": {
                 "$defs": {"City": {"type": "integer", "minimum": 0, "maximum": 99}}, "type": "object",
                 "properties": {"n": {"$ref": "#/$defs/City"}}, "required": ["n"], "additionalProperties": False}}}]
    client = served.openai()
    for choice, schema in (({"type": "function", "function": {"name": "trip"}}, CITY_SCHEMA),
                           ({"type": "function", "function": {"name": "other"}}, tools[1]["function"]["parameters"])):
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Plan it."}],
                                               tools=tools, tool_choice=choice, max_tokens=120, temperature=0.8,
                                               seed=1, extra_body=NO_THINKING)
        (call,) = reply.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schema)
    several = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Plan."}],
                                             tools=tools, tool_choice="required", max_tokens=120, temperature=0.8,
                                             seed=2, parallel_tool_calls=False, extra_body=NO_THINKING)
    (call,) = several.choices[0].message.tool_calls
    chosen = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), chosen)


def test_anthropic_tool_input_schema_with_defs_is_enforced(served):
    client = served.anthropic()
    reply = client.messages.create(model=MODEL, max_tokens=120, messages=[{"role": "user", "content": "Plan it."}],
                                   tools=[{"name": "trip", "input_schema": CITY_SCHEMA}],
                                   tool_choice={"type": "tool", "name": "trip"})
    (use,) = [block for block in reply.content if block.type == "tool_use"]
    jsonschema.validate(use.input, CITY_SCHEMA)


def test_response_format_with_defs_at_its_root(served):
    client = served.openai()
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Where?"}], max_tokens=120, temperature=0.8, seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": CITY_SCHEMA}},
        extra_body=NO_THINKING)
    jsonschema.validate(json.loads(reply.choices[0].message.content), CITY_SCHEMA)


def test_rerooting_moves_every_local_reference_and_leaves_data_alone():
    schema = {"$defs": {"A": {"$ref": "#"}}, "properties": {"enum": {"$ref": "#/$defs/A"}, "x": {"$ref": "other.json"}},
              "const": {"$ref": "#/data"}, "items": [{"$ref": "#/properties/x"}]}
    assert _rerooted(schema, "#/$defs/tool_0") == {
        "$defs": {"A": {"$ref": "#/$defs/tool_0"}},
        "properties": {"enum": {"$ref": "#/$defs/tool_0/$defs/A"}, "x": {"$ref": "other.json"}},
        "const": {"$ref": "#/data"}, "items": [{"$ref": "#/$defs/tool_0/properties/x"}]}
