"""The server's parts on their own: reply parsing, the thinking gate, grammars, prompts, metrics."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from flashpack.errors import FlashpackError
from flashpack.runtime.server import ServerSettings
from flashpack.runtime.server.anthropic_schemas import MessagesRequest
from flashpack.runtime.server.chat_format import from_anthropic, from_openai
from flashpack.runtime.server.constraints import GrammarCompiler
from flashpack.runtime.server.errors import ApiError
from flashpack.runtime.server.metrics import Metrics
from flashpack.runtime.server.openai_schemas import ChatCompletionRequest
from flashpack.runtime.server.thinking import ThinkingGate
from flashpack.runtime.server.tool_calls import ReplyParser

REPLY = ('<think>\nweigh it\n</think>\n\nSure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
         '<tool_call>\n{"name": "g", "arguments": "{\\"y\\": [2]}"}\n</tool_call>\n<tool_call>\n{oops}\n</tool_call>')


def parse(pieces: list[str], thinking: bool = True, tools: bool = True) -> list[tuple[str, object]]:
    parser = ReplyParser(thinking=thinking, starts_in_thinking=False, tools=tools)
    out = [p for piece in pieces for p in parser.push(piece)] + parser.finish()
    merged: list[tuple[str, object]] = []
    for p in out:
        if p.kind == "tool_call":
            merged.append(("tool_call", (p.call.name, p.call.arguments)))
        elif merged and merged[-1][0] == p.kind:
            merged[-1] = (p.kind, merged[-1][1] + p.text)
        else:
            merged.append((p.kind, p.text))
    return merged


def test_reply_parsing_does_not_depend_on_how_the_text_is_split():
    whole = parse([REPLY])
    assert whole == [("reasoning", "weigh it"), ("text", "Sure."), ("tool_call", ("f", {"x": 1})),
                     ("tool_call", ("g", {"y": [2]})), ("text", "<tool_call>\n{oops}\n</tool_call>")]
    assert parse(list(REPLY)) == whole
    for cut in range(1, len(REPLY)):
        assert parse([REPLY[:cut], REPLY[cut:]]) == whole, cut


def test_without_tools_or_thinking_text_passes_through_unchanged():
    assert parse(list(REPLY), thinking=False, tools=False) == [("text", REPLY)]
    assert parse(["<thin", "king> no"], thinking=True, tools=False) == [("text", "<thinking> no")]


def test_thinking_gate_forces_the_close_at_the_budget_then_hands_over():
    class Inner:
        accepted: list[int] = []

        def mask(self, logits):
            return logits.masked_fill(torch.arange(logits.numel()) != 9, float("-inf"))

        def accept(self, token_id):
            self.accepted.append(token_id)

        def is_terminated(self):
            return len(self.accepted) >= 1

    inner = Inner()
    gate = ThinkingGate(inner, open_ids=[1], close_ids=[2, 3], budget=2, starts_open=False, stop_ids=(0,),
                        opening="forced")
    logits = torch.zeros(10)
    chosen = []
    while not gate.is_terminated():
        token = int(torch.argmax(gate.mask(logits.clone()) + torch.arange(10) * 1e-3))  # prefers high ids
        gate.accept(token)
        chosen.append(token)
    assert chosen == [1, 9, 9, 2, 3, 9]  # <think>, two free tokens, forced </think> (2 tokens), the grammar's
    assert inner.accepted == [9]
    assert torch.isinf(ThinkingGate(inner, [1], [2], None, True, (0,)).mask(torch.zeros(10))[0])  # no ending early


@pytest.fixture(scope="module")
def grammars(tiny_tokenizer):
    return GrammarCompiler(tiny_tokenizer.tokenizer, len(tiny_tokenizer.tokenizer), tiny_tokenizer.stop_token_ids)


def test_forced_tool_calls_are_valid_whatever_the_logits(grammars, tiny_tokenizer):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    stops = set(tiny_tokenizer.stop_token_ids)
    for seed in range(8):
        constraint = grammars.tool_calls([{"name": "forecast", "parameters": schema}, {"name": "now", "parameters": None}],
                                         several=False)
        noise, ids = torch.Generator().manual_seed(seed), []
        while not constraint.is_terminated() and len(ids) < 200:
            token = int(torch.argmax(constraint.mask(torch.randn(len(tiny_tokenizer.tokenizer), generator=noise))))
            if token in stops:
                break
            constraint.accept(token)
            ids.append(token)
        parser = ReplyParser(thinking=False, starts_in_thinking=False, tools=True)
        pieces = parser.push(tiny_tokenizer.tokenizer.decode(ids)) + parser.finish()
        (call,) = [p.call for p in pieces if p.kind == "tool_call"]
        if call.name == "forecast":
            jsonschema.validate(call.arguments, schema)
        else:
            assert call.name == "now" and call.arguments == {}  # no parameters declared: none given


def test_a_schema_llguidance_cannot_compile_is_a_400(grammars):
    with pytest.raises(ApiError) as caught:
        grammars.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]})
    assert caught.value.status == 400


def test_tool_results_and_calls_reach_the_template_from_both_apis(tiny_tokenizer):
    openai_request = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "developer", "content": "Be exact."},
        {"role": "user", "content": [{"type": "text", "text": "Tides?"}]},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "lookup", "arguments": '{"q": "tides"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"}],
        "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]})
    anthropic_request = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "system": "Be exact.", "messages": [
        {"role": "user", "content": "Tides?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "tides"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "noon"}]}]}],
        "tools": [{"name": "lookup", "input_schema": {"type": "object"}}]})
    prompts = []
    for conversation in (from_openai(openai_request), from_anthropic(anthropic_request)):
        prompts.append(tiny_tokenizer.render_chat(conversation.messages, conversation.tools, enable_thinking=False))
    assert prompts[0] == prompts[1]
    assert '<tool_call>\n{"name": "lookup", "arguments": {"q": "tides"}}\n</tool_call>' in prompts[0]
    assert "<tool_response>\nnoon\n</tool_response>" in prompts[0] and "Be exact." in prompts[0]


def test_metrics_read_the_expert_stores_stats():
    from flashpack.runtime.store.stats import StoreStats

    stats = StoreStats()
    stats.bump(0, requests=10, device_hits=6, host_hits=3, disk_reads=1, bytes_disk_to_host=4096)
    stats.tokens = 2
    text = Metrics(stats=stats.to_dict).render()
    assert 'flashpack_store_hit_rate{tier="device"} 0.6' in text
    assert 'flashpack_store_hit_rate{tier="host"} 0.75' in text  # 3 of the 4 device misses
    assert 'flashpack_store_bytes_to_host{tier="disk"} 4096' in text
    assert "flashpack_store_per_token_disk_reads 0.5" in text and "flashpack_store_requests 10" in text


def test_metrics_read_the_prompt_cache_and_speculation_stats():
    from flashpack.runtime.engine.prefix_cache import CacheStats
    from flashpack.runtime.engine.speculative import SpeculationStats

    cache = CacheStats(hits=3, misses=1, tokens_reused=900, live_bytes=1 << 20)
    speculation = SpeculationStats(steps=4, drafted=16, accepted=6, accepted_at=[3, 2, 1, 0],
                                   by_drafter={"lookup": {"steps": 3, "drafted": 12, "accepted": 5}})
    text = Metrics(prompt_cache=lambda: {**cache.to_dict(), "stored": {"entries": 2, "dropped": 1}},
                   speculation=speculation.to_dict).render()
    assert "flashpack_prompt_cache_hits 3" in text and "flashpack_prompt_cache_tokens_reused 900" in text
    assert "flashpack_prompt_cache_stored_entries 2" in text and "flashpack_prompt_cache_stored_dropped 1" in text
    assert "flashpack_speculation_acceptance 0.375" in text and "flashpack_speculation_tokens_per_step 2.5" in text
    assert 'flashpack_speculation_accepted_at{position="1"} 3' in text
    assert "flashpack_speculation_by_drafter_lookup_accepted 5" in text


def test_metrics_survive_a_broken_stats_provider():
    def broken():
        raise OSError("store gone")

    text = Metrics(stats=broken).render()
    assert "flashpack_queue_depth 0" in text and "stats unavailable" in text


@pytest.mark.parametrize("bad", [{"model_name": ""}, {"api_key": " "}, {"max_request_bytes": 10}, {"max_queue": -1},
                                 {"max_context": 1}])
def test_settings_refuse_nonsense(bad):
    with pytest.raises(FlashpackError):
        ServerSettings(**bad)


def test_error_bodies_have_each_apis_shape():
    from flashpack.runtime.server.errors import error_body

    error = ApiError(404, "no such model", param="model", code="model_not_found")
    assert error_body("/v1/chat/completions", error) == {"error": {
        "message": "no such model", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    assert error_body("/v1/messages", error) == {"type": "error", "error": {"type": "not_found_error",
                                                                            "message": "no such model"}}
    assert json.dumps(error_body("/v1/messages/count_tokens", ApiError(529, "busy")))
