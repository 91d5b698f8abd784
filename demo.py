"""`flashpack demo`: the main job end to end on the embedded model, a small qwen4_exp trained on code.

    demo_model/snapshot (BF16) -> convert (NVFP4 experts) -> inspect --check -> verify against
    transformers -> run a code prompt -> serve, and complete the same prompt with the official
    openai client -> stop

Each step calls the same keyword function as its CLI command, so the demo exercises the real path.
The model was trained on the Python sources of transformers (demo_model/TRAINING.md): it continues
code; it was never taught to chat.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import click

from flashpack.errors import FlashpackError

CODE_PROMPT = "import torch\nfrom torch import nn\n\n\nclass"
CODE_TOKENS = 64


def _step(title: str) -> None:
    click.secho(f"\n== {title}", bold=True)


def run_demo(workdir: Path, keep: bool = False, echo: Callable[[str], None] = click.echo) -> None:
    from flashpack.convert.pipeline import convert
    from flashpack.demo_model import snapshot_path, training_record
    from flashpack.layout.inspect import summarize
    from flashpack.layout.integrity import check_pack
    from flashpack.runtime.engine.build import load_engine
    from flashpack.runtime.sampling import SamplingParams

    created = not workdir.exists()
    pack_path = workdir / "demo.pack"
    if pack_path.exists():
        raise FlashpackError(f"{pack_path} already exists: remove it or give the demo another --workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    snapshot = snapshot_path()
    _step("the embedded model: a small qwen4_exp trained on Python code")
    echo(_describe(training_record()))
    echo(f"snapshot at {snapshot}")
    _step("convert: BF16 snapshot -> pack (routed experts quantised to NVFP4)")
    convert(str(snapshot), pack_path, progress=False)
    echo(f"pack at {pack_path}")
    _step("inspect --check: every byte against its hash")
    report = check_pack(pack_path, progress=False)
    for line in summarize(report.pack).lines() + report.problems + report.checked:
        echo(line)
    if not report.passed:
        raise click.ClickException("the pack failed its checks")
    _step("verify: every layer against the transformers reference, FP32")
    _verify(pack_path, snapshot, echo)
    _step("run: greedy continuation of a code prompt from the pack")
    engine = load_engine(pack_path)
    result = engine.generator.generate(engine.tokenizer.encode(CODE_PROMPT), SamplingParams(max_tokens=CODE_TOKENS))
    echo(CODE_PROMPT + result.text)
    echo(f"[{result.completion_tokens} tokens, {result.decode_tokens_per_second:.1f} tok/s]")
    _step("serve: OpenAI-compatible server on 127.0.0.1, the same prompt through the openai client")
    _serve_once(engine, echo)
    if not keep:  # only what the demo wrote: the workdir goes too if the demo made it and it is now empty
        shutil.rmtree(pack_path, ignore_errors=True)
        if created and not any(workdir.iterdir()):
            workdir.rmdir()
    click.secho("\ndemo finished: convert, inspect, verify, run and serve all worked", fg="green")


def _describe(record: dict) -> str:
    corpus, final = record["corpus"], record["final"]
    return (f"trained on the {corpus['train_files']:,} Python files of {corpus['distribution']} {corpus['version']} "
            f"({record['tokens_seen'] / 1e6:.1f} M tokens in {record['train_wall_s']:.0f} s); on the "
            f"{corpus['held_out_files']} held-out files: {final['loss']:.3f} nats/token (a unigram model: "
            f"{final['unigram_loss']:.3f}), MTP head agreeing with the model's next-next token "
            f"{final['mtp_agreement_with_greedy']:.0%} of the time")


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
    app = create_app(engine, ServerSettings(model_name="demo", api_key="demo-key"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while (not server.started or app.state.flashpack.health.loading) and time.monotonic() < deadline:
            time.sleep(0.05)  # until the warm-up is done: /v1 routes answer 503 before
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="demo-key")
        reply = client.completions.create(model="demo", prompt=CODE_PROMPT, max_tokens=CODE_TOKENS, temperature=0)
        echo(f"http://127.0.0.1:{port}/v1/completions answered ({reply.usage.completion_tokens} tokens):")
        echo(CODE_PROMPT + reply.choices[0].text)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
