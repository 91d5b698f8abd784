"""Limits that hold against hostile clients: connections (cap, head deadline, open files) and sizes.

Connection tests use raw sockets against uvicorn in a thread, with a small cap and short timeouts;
the open-file and memory tests run `serve` in a process of its own (server_process.py) so that its
descriptors and memory can be watched from outside.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from server_fakes import fake_engine
from server_harness import KEY, MODEL, serving

from flashpack.runtime.server import ServerSettings
from flashpack.runtime.server.connections import BACKLOGS_IN_FLIGHT, connection_budget, raise_open_file_limit

HEADERS = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
PROCESS = Path(__file__).parent / "server_process.py"


def address(served) -> tuple[str, int]:
    host, port = served.base_url.removeprefix("http://").split(":")
    return host, int(port)


def closed_by_server(connection: socket.socket) -> bool:
    connection.setblocking(False)
    try:
        return connection.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def read_response(connection: socket.socket) -> bytes:
    """One whole HTTP response (head and content-length body) from a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
        chunk = connection.recv(1 << 16)
        if not chunk:
            break
        data += chunk
    return data


def _content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def timed_health(base_url: str) -> tuple[int, float]:
    start = time.monotonic()
    with urllib.request.urlopen(base_url + "/health", timeout=5) as response:
        return response.status, time.monotonic() - start


def test_idle_connections_cannot_starve_health(tiny_tokenizer):
    settings = ServerSettings(model_name=MODEL, api_key=KEY, max_connections=8, header_timeout=1.0)
    with serving(fake_engine(tiny_tokenizer), settings) as served:
        idle = [socket.create_connection(address(served)) for _ in range(30)]
        try:
            status, seconds = timed_health(served.base_url)
            assert status == 200 and seconds < 1.0
            time.sleep(0.2)
            assert sum(not closed_by_server(c) for c in idle) < 8  # the oldest were evicted at once
            time.sleep(1.3)
            assert all(closed_by_server(c) for c in idle)  # the rest at their head deadline
        finally:
            for connection in idle:
                connection.close()


def test_a_head_sent_byte_by_byte_is_cut_off_at_its_deadline(tiny_tokenizer):
    settings = ServerSettings(model_name=MODEL, api_key=KEY, header_timeout=1.0)
    with serving(fake_engine(tiny_tokenizer), settings) as served, \
            socket.create_connection(address(served)) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        start = time.monotonic()
        while time.monotonic() - start < 5 and not closed_by_server(slow):
            slow.setblocking(True)
            try:
                slow.sendall(b"x-drip: 1\r\n")  # activity, never a whole head
            except OSError:
                break
            time.sleep(0.1)
        assert 0.9 < time.monotonic() - start < 1.8


def test_with_every_connection_busy_a_new_one_is_refused_at_once(tiny_tokenizer):
    settings = ServerSettings(model_name=MODEL, api_key=KEY, max_connections=2)
    engine = fake_engine(tiny_tokenizer, seconds_per_step=0.05)
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 40}).encode()
    with serving(engine, settings) as served:
        answers: list[int] = []

        def complete() -> None:
            answers.append(served.raw("POST", "/v1/completions", body, HEADERS)[0])

        busy = [threading.Thread(target=complete) for _ in range(2)]
        for thread in busy:
            thread.start()
        scheduler = served.app.state.flashpack.scheduler
        deadline = time.monotonic() + 10
        while scheduler.queue_depth < 1 and time.monotonic() < deadline:  # one running, one waiting
            time.sleep(0.01)
        with socket.create_connection(address(served), timeout=5) as third:
            start = time.monotonic()
            reply = read_response(third)
            assert time.monotonic() - start < 0.5
        assert reply.startswith(b"HTTP/1.1 503 ") and b"too many open connections" in reply
        for thread in busy:
            thread.join(30)
        assert answers == [200, 200]  # the busy connections were never evicted


def test_the_cap_and_backlog_fit_under_the_open_file_limit():
    assert connection_budget(512, 20000).max_connections == 512
    for limit in (64, 256, 1024, 4096, 20000):
        budget = connection_budget(10**6, limit)
        assert budget.max_connections + BACKLOGS_IN_FLIGHT * budget.backlog < limit
        assert budget.max_connections >= 1 and 8 <= budget.backlog <= 2048
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512), hard))
        raised = raise_open_file_limit()
        assert raised == resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= min(soft, 512)
        if hard != resource.RLIM_INFINITY:
            assert raised == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextmanager
def server_process(pack: Path, settings: dict, tmp_path: Path, open_files: int | None = None):
    """`serve` in a child process; yields (process, base_url, its stderr file) once /health says ok."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def limit_files() -> None:
        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    log = tmp_path / "server.log"
    with open(log, "wb") as stderr:
        process = subprocess.Popen([sys.executable, str(PROCESS), str(pack), str(port), json.dumps(settings)],
                                   stdout=stderr, stderr=stderr, preexec_fn=limit_files, env=os.environ.copy())
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if timed_health(base_url)[0] == 200:
                    break
            except (OSError, urllib.error.URLError):
                time.sleep(0.1)
        yield process, base_url, log
    finally:
        process.terminate()
        process.wait(30)


def open_in_full_backlogs(port: int, count: int, backlog: int) -> list[socket.socket]:
    """`count` connections, a full listen backlog at a time with a pause between: each of the
    server's turns accepts a whole backlog (the case its descriptor budget is cut for), while a
    client that never pauses overflows the queue and waits out a dropped SYN's 1 s retry every
    backlog (~50 s for 1,100)."""
    opened = []
    while len(opened) < count:
        opened += [socket.create_connection(("127.0.0.1", port)) for _ in range(min(backlog, count - len(opened)))]
        time.sleep(0.02)
    return opened


def test_accept_never_runs_out_of_files(tiny_pack, tmp_path):
    """Under a 256-file limit (cap 97, backlog 19) 1,100 idle sockets are evicted, never an EMFILE."""
    settings = {"model_name": MODEL, "api_key": KEY}
    budget = connection_budget(512, 256)
    assert (budget.max_connections, budget.backlog) == (97, 19)
    with server_process(tiny_pack, settings, tmp_path, open_files=256) as (process, base_url, log):
        idle = open_in_full_backlogs(int(base_url.rsplit(":", 1)[1]), 1100, budget.backlog)
        try:
            time.sleep(0.5)
            status, seconds = timed_health(base_url)
            assert status == 200 and seconds < 1.0
        finally:
            for connection in idle:
                connection.close()
        time.sleep(0.2)
    text = log.read_text()
    assert "Too many open files" not in text and "out of system resource" not in text, text[-2000:]
    assert "ready in " in text and "(warm-up " in text


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(tiny_tokenizer, monkeypatch):
    engine = fake_engine(tiny_tokenizer)
    big = "word " * (3 * 2**20)  # 15 MiB
    with serving(engine, ServerSettings(model_name=MODEL, api_key=KEY, max_request_bytes=16 * 2**20)) as served:
        def never(*args, **kwargs):
            raise AssertionError("the tokenizer was called on a prompt that cannot fit")

        monkeypatch.setattr(engine.tokenizer, "encode_chat", never)
        monkeypatch.setattr(engine.tokenizer, "encode", never)
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}),
                           ("/v1/messages", {"messages": [{"role": "user", "content": big}], "max_tokens": 4}),
                           ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": big}]}),
                           ("/v1/completions", {"prompt": big})):
            status, payload = served.raw("POST", path, json.dumps({"model": MODEL, **body}).encode(), HEADERS)
            error = payload["error"]
            assert status == 400 and "maximum context length" in error["message"], payload
    monkeypatch.undo()
    with serving(engine, ServerSettings(model_name=MODEL, api_key=KEY)) as served:  # the default body limit
        limit = served.app.state.flashpack.max_request_bytes
        assert limit == 2**20 + 8 * 4096
        with socket.create_connection(address(served), timeout=5) as client:  # the head alone: refused unread
            client.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
                           f"content-type: application/json\r\ncontent-length: {15 * 2**20}\r\n\r\n".encode())
            reply = read_response(client)
        assert reply.startswith(b"HTTP/1.1 413 ") and str(limit).encode() in reply


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-RSS reset")
def test_four_huge_prompts_at_once_stay_within_a_memory_bound(tiny_pack, tmp_path):
    """Four 15 MiB prompts at once, with the body limit raised to let them in: refused after parsing,
    before tokenizing; the server's peak RSS grows by less than 300 MB."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * (3 * 2**20)}]}).encode()
    settings = {"model_name": MODEL, "api_key": KEY, "max_request_bytes": 16 * 2**20}
    with server_process(tiny_pack, settings, tmp_path) as (process, base_url, log):
        Path(f"/proc/{process.pid}/clear_refs").write_text("5")  # peak RSS := current RSS
        before = rss_kib(process.pid, "VmRSS")
        statuses: list[int] = []

        def send() -> None:
            request = urllib.request.Request(base_url + "/v1/chat/completions", data=body, headers=HEADERS)
            try:
                urllib.request.urlopen(request, timeout=120)
            except urllib.error.HTTPError as error:
                statuses.append(error.code)

        senders = [threading.Thread(target=send) for _ in range(4)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join(120)
        growth_mb = (rss_kib(process.pid, "VmHWM") - before) / 1024
    print(f"peak RSS growth for 4 concurrent 15 MiB prompts: {growth_mb:.0f} MB")
    assert statuses == [400] * 4
    assert growth_mb < 300


def test_a_body_that_stalls_is_a_408(tiny_tokenizer):
    settings = ServerSettings(model_name=MODEL, api_key=KEY, body_timeout=0.5)
    with serving(fake_engine(tiny_tokenizer, seconds_per_step=0.05), settings) as served, \
            socket.create_connection(address(served), timeout=5) as stalled:
        stalled.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\n"
                        f"content-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"model\": ".encode())
        start = time.monotonic()
        reply = read_response(stalled)
        assert reply.startswith(b"HTTP/1.1 408 ") and b"paused for more than 0.5 s" in reply
        assert 0.4 < time.monotonic() - start < 2.0
        # Once the body is whole, waiting on the client (for a disconnect) is not timed: replies that
        # take longer than body_timeout, streamed or not, finish.
        client = served.openai()
        streamed = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=20, stream=True))
        assert [chunk.choices[0].finish_reason for chunk in streamed if chunk.choices][-1] == "length"
        whole = client.completions.create(model=MODEL, prompt="hi", max_tokens=20)
        assert whole.usage.completion_tokens == 20


def test_a_head_over_the_limit_is_refused_whole_or_in_pieces(tiny_tokenizer):
    settings = ServerSettings(model_name=MODEL, api_key=KEY, max_header_bytes=2048)
    with serving(fake_engine(tiny_tokenizer), settings) as served:
        with socket.create_connection(address(served), timeout=5) as whole:
            whole.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 5000 + b"\r\n\r\n")
            assert read_response(whole).startswith(b"HTTP/1.1 431 ")
        with socket.create_connection(address(served), timeout=5) as pieces:
            pieces.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
            for _ in range(10):
                try:
                    pieces.sendall(b"x-big: " + b"a" * 500 + b"\r\n")
                except OSError:
                    break
                time.sleep(0.02)
            assert read_response(pieces).startswith(b"HTTP/1.1 400 ")
        assert served.raw("GET", "/health")[0] == 200
