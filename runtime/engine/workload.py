"""Run a workload file through the engine and record its routing: the input of `profile` and
`trace record`.

Workload (JSON lines): one request per line, {"prompt": "text"} or {"messages": [...]} (rendered
with the pack's chat template), optionally "max_tokens". Each is decoded greedily; every forward
of the model is one trace step (the prompt, then one step per generated token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import xxhash
from tqdm import tqdm

from flashpack.errors import FlashpackError
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.store.trace import Trace, TraceRecorder


@dataclass
class WorkloadItem:
    text: str | None
    messages: list[dict[str, Any]] | None
    max_tokens: int | None


def load_workload(path: Path | str) -> tuple[list[WorkloadItem], str]:
    """(requests, xxh64 of the file)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise FlashpackError(f"cannot read workload {path}: {error.strerror}") from None
    items = []
    for number, line in enumerate(raw.decode().splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError as error:
            raise FlashpackError(f"{path}:{number}: not JSON ({error})") from None
        if not isinstance(doc, dict) or ("prompt" in doc) == ("messages" in doc):
            raise FlashpackError(f'{path}:{number}: give exactly one of "prompt" or "messages"')
        items.append(WorkloadItem(doc.get("prompt"), doc.get("messages"), doc.get("max_tokens")))
    if not items:
        raise FlashpackError(f"workload {path} has no requests")
    return items, xxhash.xxh64(raw).hexdigest()


class _SteppingModel:
    """The engine's step with a trace step opened before every forward (what Generator calls)."""

    def __init__(self, step, recorder: TraceRecorder):
        self._step, self._recorder = step, recorder

    def __getattr__(self, name):
        return getattr(self._step, name)

    def forward(self, tokens, state, last_only: bool = False, **kwargs):
        self._recorder.begin_step(int(tokens.shape[0]))
        return self._step.forward(tokens, state, last_only=last_only, **kwargs)


def run_workload(
    pack_path: Path | str, workload_path: Path | str, config: EngineConfig = EngineConfig(), *,
    max_tokens: int = 32, progress: bool = True,
) -> Trace:
    """Greedy-decode every request of the workload; return the routing trace (meta: workload).
    The engine loads as `flashpack run` would from `config` (through the store on a GPU, where the
    NVFP4 kernels read the records in place), but decodes eagerly, so every layer's routing is
    observed."""
    from flashpack.layout.pack import Pack
    from flashpack.runtime.engine.build import load_engine
    from flashpack.runtime.engine.generate import Generator
    from flashpack.runtime.sampling import SamplingParams

    items, digest = load_workload(workload_path)
    pack = Pack.open(pack_path)
    cfg, manifest = pack.manifest.config, pack.manifest
    layers = list(range(cfg.num_hidden_layers))  # the engine runs the decoder layers, not the MTP head
    trace = Trace(cfg.num_experts, cfg.num_experts_per_tok, layers, manifest.document["experts"]["record_stride"])
    recorder = TraceRecorder(trace)
    # every prompt prefilled whole: a restored prefix would be missing from the trace
    engine = load_engine(pack_path, replace(config, cuda_graphs=False, prompt_cache_ram=0))
    try:
        engine.model.observe_routing(recorder)
        generator = Generator(_SteppingModel(engine.step, recorder), engine.tokenizer)
        prompt_tokens = generated = 0
        for item in tqdm(items, desc="workload", unit="request", leave=False, disable=not progress):
            text = item.text if item.messages is None else engine.tokenizer.render_chat(item.messages)
            ids = engine.tokenizer.encode(text)
            result = generator.generate(ids, SamplingParams(max_tokens=item.max_tokens or max_tokens))
            prompt_tokens += len(ids)
            generated += result.completion_tokens
    finally:
        engine.close()
    trace.meta = {"workload": {"file": Path(workload_path).name, "xxh64": digest, "prompts": len(items),
                               "prompt_tokens": prompt_tokens, "generated_tokens": generated,
                               "max_tokens": max_tokens}}
    return trace
