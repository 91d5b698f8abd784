"""/health's states (loading, ok, error) and a pack found damaged while serving a request."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import openai
import pytest
from server_fakes import FakeEngine, FakeModel, fake_engine
from server_harness import KEY, MODEL, serving

from flashpack.errors import FlashpackError, PackDamageError
from flashpack.runtime.engine.generate import Generator
from flashpack.runtime.server import ServerSettings

SETTINGS = ServerSettings(model_name=MODEL, api_key=KEY, retry_after_seconds=7)
HEADERS = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


@dataclass
class GatedWarmUp(FakeEngine):
    """An engine whose warm_up waits for `go` (and raises `failure`, if set)."""

    go: threading.Event = None
    failure: Exception | None = None

    def warm_up(self) -> None:
        assert self.go.wait(30)
        if self.failure is not None:
            raise self.failure


def gated(tokenizer, failure: Exception | None = None) -> GatedWarmUp:
    engine = fake_engine(tokenizer)
    return GatedWarmUp(engine.model, engine.tokenizer, engine.generator, go=threading.Event(), failure=failure)


def refusal(url: str, body: bytes) -> urllib.error.HTTPError:
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(url, data=body, headers=HEADERS), timeout=10)
    return refused.value


def wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_health_says_loading_until_warm_up_is_done(tiny_tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="flashpack.server")
    engine = gated(tiny_tokenizer)
    with serving(engine, SETTINGS, wait_ready=False) as served:
        assert served.raw("GET", "/health") == (503, {"status": "loading"})
        for path in ("/v1/chat/completions", "/v1/messages"):
            refused = refusal(served.base_url + path, CHAT)
            assert refused.code == 503 and refused.headers["retry-after"] == "7"
        assert served.raw("GET", "/v1/models", headers=HEADERS)[0] == 503
        assert served.raw("GET", "/metrics", headers=HEADERS)[0] == 200
        assert served.raw("GET", "/v1/models")[0] == 401  # the key is still asked for first
        engine.go.set()
        wait_for(lambda: served.raw("GET", "/health")[0] == 200)
        assert served.raw("GET", "/health")[1] == {"status": "ok", "model": MODEL, "queue_depth": 0}
        reply = served.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=2)
        assert reply.choices[0].finish_reason == "length"
    assert any(record.getMessage().startswith("ready in ") and "(warm-up " in record.getMessage()
               for record in caplog.records)


@dataclass
class SaysMemory(FakeEngine):
    def memory(self) -> str:
        return "experts: 9 records; live prompt states: 1.00 GiB"


def test_the_memory_split_is_logged_before_ready(tiny_tokenizer, caplog):
    caplog.set_level(logging.INFO, logger="flashpack")
    fake = fake_engine(tiny_tokenizer)
    with serving(SaysMemory(fake.model, fake.tokenizer, fake.generator), SETTINGS):
        pass
    lines = [record.getMessage() for record in caplog.records]
    said = lines.index("memory: experts: 9 records; live prompt states: 1.00 GiB")
    assert lines[said + 1].startswith("ready in ")


def test_a_failed_warm_up_is_an_error_on_health(tiny_tokenizer):
    engine = gated(tiny_tokenizer, failure=RuntimeError("no device"))
    engine.go.set()
    with serving(engine, SETTINGS, wait_ready=False) as served:
        wait_for(lambda: served.raw("GET", "/health")[1] != {"status": "loading"})
        assert served.raw("GET", "/health") == (503, {"status": "error",
                                                      "reason": "warm-up failed: RuntimeError: no device"})


@dataclass
class DamagedModel(FakeModel):
    """Raises `error` on its first `failures` forward calls, as the engine does when a record fails its hash."""

    error: Exception = None
    failures: int = 1

    def forward(self, tokens, state, last_only=False):
        if self.failures > 0:
            self.failures -= 1
            raise self.error
        return super().forward(tokens, state, last_only)


def damaged_engine(tokenizer, error: Exception, failures: int = 1) -> FakeEngine:
    model = DamagedModel(len(tokenizer.tokenizer), never=tuple(tokenizer.stop_token_ids), error=error,
                         failures=failures)
    return FakeEngine(model, tokenizer, Generator(model, tokenizer))


DAMAGE = "corrupt expert record: layer 3 expert 17 fails its xxh64 check"


def test_pack_damage_is_a_500_naming_it_and_turns_health_to_error(tiny_tokenizer):
    with serving(damaged_engine(tiny_tokenizer, PackDamageError(DAMAGE)), SETTINGS) as served:
        assert served.raw("GET", "/health")[0] == 200
        with pytest.raises(openai.InternalServerError) as failed:
            served.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2)
        error = failed.value.body
        assert (error["code"], error["type"]) == ("pack_damaged", "server_error")
        assert DAMAGE in error["message"]
        status, health = served.raw("GET", "/health")
        assert status == 503 and health == {"status": "error", "reason": f"the pack is damaged: {DAMAGE}"}
        # Requests that do not touch the damage are still answered; /health stays an error.
        reply = served.anthropic().messages.create(model=MODEL, max_tokens=2,
                                                   messages=[{"role": "user", "content": "hi"}])
        assert reply.stop_reason == "max_tokens"
        assert served.raw("GET", "/health")[0] == 503


def test_pack_damage_while_streaming_is_an_error_event(tiny_tokenizer):
    with serving(damaged_engine(tiny_tokenizer, PackDamageError(DAMAGE)), SETTINGS) as served:
        status, body = served.raw("POST", "/v1/messages", json.dumps({
            "model": MODEL, "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode(),
            HEADERS)
        assert status == 200 and "event: error" in body and DAMAGE in body
        assert served.raw("GET", "/health")[1]["status"] == "error"


def test_a_request_error_is_still_a_400_and_health_stays_ok(tiny_tokenizer):
    """The control: an ordinary FlashpackError is the request's fault, not the pack's."""
    with serving(damaged_engine(tiny_tokenizer, FlashpackError("prompt too long for the tier")), SETTINGS) as served:
        with pytest.raises(openai.BadRequestError):
            served.openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2)
        assert served.raw("GET", "/health")[0] == 200
