"""Queueing, cancellation, failures and metrics, on a slow stand-in model with the tiny pack's tokenizer."""

from __future__ import annotations

import re
import threading
import time

import anthropic
import openai
import pytest
from server_harness import KEY, MODEL, serving
from server_fakes import fake_engine

from flashpack.runtime.server import ServerSettings

MESSAGES = [{"role": "user", "content": "Go on."}]


@pytest.fixture
def slow(tiny_tokenizer):
    engine = fake_engine(tiny_tokenizer, seconds_per_step=0.02)
    stats = lambda: {"device": {"hits": 3, "misses": 1}, "host": {"hits": 0, "misses": 0}, "evictions": 7}  # noqa: E731
    with serving(engine, ServerSettings(model_name=MODEL, api_key=KEY, max_queue=1, stats=stats)) as served:
        yield served


def metric(served, name: str) -> float:
    status, text = served.raw("GET", "/metrics", headers={"authorization": f"Bearer {KEY}"})
    assert status == 200
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_client_that_leaves_cancels_its_generation(slow):
    cancelled = 'flashpack_generations_total{finish="cancelled"}'
    stream = slow.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2000, stream=True)
    for index, _ in enumerate(stream):
        if index == 3:
            break
    stream.close()
    wait_for(lambda: metric(slow, cancelled) == 1)
    steps = slow.engine.model.steps
    time.sleep(0.2)
    assert slow.engine.model.steps == steps  # the engine stopped, not just the response

    with pytest.raises(openai.APITimeoutError):  # a non-streaming client giving up
        slow.openai(timeout=0.3).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2000)
    wait_for(lambda: metric(slow, cancelled) == 2)


def test_a_full_queue_is_refused_and_the_waiting_request_is_served(slow):
    running = slow.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2000, stream=True)
    next(iter(running))  # generating now
    waited: dict = {}
    waiting = threading.Thread(target=lambda: waited.update(reply=slow.openai().chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5)))
    waiting.start()
    wait_for(lambda: slow.raw("GET", "/health")[1]["queue_depth"] == 1)
    assert metric(slow, "flashpack_queue_depth") == 1
    with pytest.raises(openai.RateLimitError):
        slow.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    with pytest.raises(anthropic.RateLimitError):
        slow.anthropic().messages.create(model=MODEL, max_tokens=5, messages=MESSAGES)
    running.close()
    waiting.join(timeout=30)
    assert waited["reply"].choices[0].finish_reason == "length"
    assert waited["reply"].usage.completion_tokens == 5


def test_a_failing_generation_is_one_error_and_the_server_goes_on(slow):
    slow.engine.model.broken = True
    with pytest.raises(openai.InternalServerError):
        slow.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    with pytest.raises(openai.APIError):
        list(slow.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True))
    with pytest.raises(anthropic.InternalServerError):
        slow.anthropic().messages.create(model=MODEL, max_tokens=3, messages=MESSAGES)
    slow.engine.model.broken = False
    reply = slow.anthropic().messages.create(model=MODEL, max_tokens=3, messages=MESSAGES)
    assert reply.usage.output_tokens == 3


def test_metrics_report_rates_latency_queue_and_store_tiers(slow):
    slow.openai().completions.create(model=MODEL, prompt="Count", max_tokens=4)
    assert slow.raw("GET", "/metrics")[0] == 401  # metrics need the key; /health does not
    assert metric(slow, "flashpack_generated_tokens_total") == 4
    assert metric(slow, "flashpack_time_to_first_token_seconds_count") == 1
    assert metric(slow, "flashpack_decode_tokens_per_second") > 0
    assert metric(slow, 'flashpack_requests_total{route="/v1/completions",status="200"}') == 1
    assert metric(slow, 'flashpack_store_hit_rate{tier="device"}') == 0.75
    assert metric(slow, 'flashpack_store_hit_rate{tier="host"}') == 0.0
    assert metric(slow, "flashpack_store_evictions") == 7
