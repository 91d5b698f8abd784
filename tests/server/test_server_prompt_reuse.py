"""Prompt-state reuse through the server, driven by the official clients: a follow-up turn reports
the tokens it restored (OpenAI `prompt_tokens_details.cached_tokens`, Anthropic
`cache_read_input_tokens`), its reply is the one a cold engine gives for the same conversation
(with speculative decoding on in the server, off in the cold engine), and /metrics counts the hits."""

from __future__ import annotations

import re

import pytest
from server_harness import KEY, MODEL, serving

from flashpack.runtime.server import ServerSettings

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def served(tiny_pack, tmp_path_factory):
    from flashpack.runtime.engine.build import load_engine
    from flashpack.runtime.engine.config import EngineConfig

    engine = load_engine(tiny_pack, EngineConfig(prompt_cache_ram="256MiB", speculate="lookup",
                                                 prompt_cache_dir=str(tmp_path_factory.mktemp("states"))))
    settings = ServerSettings(model_name=MODEL, api_key=KEY, max_context=1024)
    with serving(engine, settings) as served:
        yield served
    engine.close()


def _conversation(turn: str) -> list[dict]:
    return [{"role": "system", "content": "You answer in one word, always, whatever the question is."},
            {"role": "user", "content": turn}]


def test_an_openai_follow_up_reports_the_tokens_it_restored(served, tiny_pack):
    from flashpack.runtime.engine.build import load_engine
    from flashpack.runtime.engine.config import EngineConfig

    client = served.openai()
    messages = _conversation("Name a colour that a clear sky has at noon in summer.")
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                           extra_body=NO_THINKING)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And one for grass?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            extra_body=NO_THINKING)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    # the same conversation on an engine with no saved state at all gives the same greedy reply
    cold = load_engine(tiny_pack, EngineConfig(prompt_cache_ram=0))
    ids = cold.tokenizer.encode_chat(messages, enable_thinking=False)
    from flashpack.runtime.sampling import SamplingParams

    assert cold.generator.generate(ids, SamplingParams(max_tokens=6)).text == second.choices[0].message.content
    _, metrics = served.raw("GET", "/metrics", headers={"authorization": f"Bearer {KEY}"})
    hits = re.search(r"^flashpack_prompt_cache_hits (\S+)$", metrics, re.MULTILINE)
    assert hits and float(hits.group(1)) >= 1
    assert re.search(r"^flashpack_prompt_cache_live_bytes \d+", metrics, re.MULTILINE)
    assert re.search(r"^flashpack_prompt_cache_stored_entries \d+", metrics, re.MULTILINE)
    assert re.search(r"^flashpack_speculation_steps \d+", metrics, re.MULTILINE)
    assert re.search(r"^flashpack_gc_full_collections \d+", metrics, re.MULTILINE)  # the engine's collector


def test_an_anthropic_follow_up_reports_cache_reads(served):
    client = served.anthropic()
    messages = [{"role": "user", "content": "Say a word about rivers and the sea, and nothing else at all."}]
    first = client.messages.create(model=MODEL, max_tokens=5, messages=messages, extra_body={"temperature": 0})
    assert first.usage.cache_read_input_tokens == 0
    messages += [{"role": "assistant", "content": first.content[0].text if first.content else "ok"},
                 {"role": "user", "content": "Another?"}]
    second = client.messages.create(model=MODEL, max_tokens=5, messages=messages, extra_body={"temperature": 0})
    assert 0 < second.usage.cache_read_input_tokens < second.usage.input_tokens
