"""`flashpack demo`: the main job end to end on the embedded default, a tiny generated model.

    synth tiny -> convert -> inspect --check -> verify against transformers -> run -> serve + one
    chat request through the official openai client -> stop

Each step calls the same keyword function as its CLI command, so the demo exercises the real path.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import click

from flashpack.errors import FlashpackError


def _step(title: str) -> None:
    click.secho(f"\n== {title}", bold=True)


def run_demo(workdir: Path, keep: bool = False, echo: Callable[[str], None] = click.echo) -> None:
    from flashpack.convert.pipeline import convert
    from flashpack.convert.synth import synthesize
    from flashpack.layout.inspect import find_corrupt_records, summarize
    from flashpack.layout.pack import Pack
    from flashpack.runtime.loader import load_engine
    from flashpack.runtime.sampling import SamplingParams

    created = not workdir.exists()
    snapshot, pack_path = workdir / "tiny-snapshot", workdir / "tiny.pack"
    for path in (snapshot, pack_path):
        if path.exists():
            raise FlashpackError(f"{path} already exists: remove it or give the demo another --workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    _step("synth: a random tiny qwen4_exp snapshot in the real checkpoint layout")
    synthesize("tiny", snapshot, format="bf16", seed=0, force=True)
    echo(f"snapshot at {snapshot}")
    _step("convert: snapshot -> pack")
    convert(str(snapshot), pack_path, force=True, progress=False)
    echo(f"pack at {pack_path}")
    _step("inspect --check")
    pack = Pack.open(pack_path)
    for line in summarize(pack).lines():
        echo(line)
    corrupt = find_corrupt_records(pack, progress=False)
    echo(f"{len(pack.manifest.expert_records()) - len(corrupt)} records intact, {len(corrupt)} corrupt")
    _step("verify: every layer against the transformers reference, FP32")
    _verify(pack_path, snapshot, echo)
    _step("run: greedy generation from the pack")
    engine = load_engine(pack_path)
    prompt = engine.tokenizer.render_chat([{"role": "user", "content": "Write a haiku about experts."}])
    result = engine.generator.generate(engine.tokenizer.encode(prompt), SamplingParams(max_tokens=24))
    echo(f"{result.text!r}  ({result.completion_tokens} tokens, {result.decode_tokens_per_second:.1f} tok/s)")
    _step("serve: OpenAI-compatible server on 127.0.0.1, one chat request with the openai client")
    _serve_once(engine, echo)
    if not keep:  # only what the demo wrote: the workdir goes too if the demo made it and it is now empty
        shutil.rmtree(snapshot, ignore_errors=True)
        shutil.rmtree(pack_path, ignore_errors=True)
        if created and not any(workdir.iterdir()):
            workdir.rmdir()
    click.secho("\ndemo finished: synth, convert, inspect, verify, run and serve all worked", fg="green")


def _verify(pack_path: Path, snapshot: Path, echo: Callable[[str], None]) -> None:
    from flashpack.verify import verify_pack

    report = verify_pack(pack_path, snapshot, dtype="float32")
    echo(report.table())
    if not report.passed:
        raise click.ClickException("verify failed")


def _serve_once(engine, echo: Callable[[str], None]) -> None:
    import socket
    import threading
    import time

    import uvicorn
    from openai import OpenAI

    from flashpack.runtime.server import ServerSettings, create_app

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = create_app(engine, ServerSettings(model_name="tiny", api_key="demo-key"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while (not server.started or app.state.flashpack.health.loading) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the warm-up is done: /v1 routes answer 503 before
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="demo-key")
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=16, temperature=0
        )
        echo(f"http://127.0.0.1:{port} answered: {reply.choices[0].message.content!r} "
             f"({reply.usage.completion_tokens} tokens)")
    finally:
        server.should_exit = True
        thread.join(timeout=10)
