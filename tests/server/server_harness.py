"""Servers on free loopback ports, in this process (uvicorn in a thread), and clients for them."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import uvicorn

from flashpack.runtime.server import ServerSettings, create_app
from flashpack.runtime.server.connections import uvicorn_options

KEY = "test-key-0123"
MODEL = "tiny"


@dataclass
class Served:
    base_url: str
    engine: Any
    app: Any

    def openai(self, api_key: str | None = KEY, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0,
                             **{"timeout": 60.0, **kwargs})

    def anthropic(self, api_key: str | None = KEY, **kwargs) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.base_url, api_key=api_key, max_retries=0, **{"timeout": 60.0, **kwargs})

    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, Any]:
        """A hand-made request, for what the official clients cannot send (malformed JSON)."""
        request = urllib.request.Request(self.base_url + path, data=body, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                status, payload = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, payload = error.code, error.read()
        try:
            return status, json.loads(payload)
        except ValueError:
            return status, payload.decode()


@contextmanager
def serving(engine: Any, settings: ServerSettings, wait_ready: bool = True) -> Iterator[Served]:
    """uvicorn with `settings`'s connection limits, as `serve` runs it; with wait_ready, only once
    /health no longer says "loading" (the warm-up is done)."""
    app = create_app(engine, settings)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                            **uvicorn_options(settings))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started or (wait_ready and app.state.flashpack.health.loading):
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield Served(f"http://127.0.0.1:{port}", engine, app)
    finally:
        server.should_exit = True
        thread.join(timeout=15)
