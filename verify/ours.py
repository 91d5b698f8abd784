"""Our side: flashpack's engine run from the pack (experts decoded from it, steps eager), instrumented.

Forward hooks on the engine's decoder layers capture every layer's hc streams; the sequence goes
through the engine exactly as generation would send it: the prefill chunk in one call, then each
decode token in its own call with the state carried over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from flashpack.layout.pack import Pack
from flashpack.runtime.engine.build import load_engine
from flashpack.runtime.engine.config import EngineConfig
from flashpack.runtime.engine.step import Step
from flashpack.verify.inputs import Sequence

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@dataclass
class Trace:
    """One sequence through one model, float32 on the CPU (T = prefill + decode tokens)."""

    layers: list[torch.Tensor]  # per decoder layer: hc streams [T, hc * H]
    logits: torch.Tensor  # [T, vocab]


def run_engine(
    pack: Pack, sequences: list[Sequence], dtype: torch.dtype, device: str, progress: bool = False,
) -> list[Trace]:
    """`progress`: a bar over the engine's calls (on a GPU the first ones compile and autotune
    Triton kernels for each new shape, minutes for the tiny preset)."""
    config = EngineConfig(device=device, dtype=_DTYPE_NAMES[dtype], experts="pack", cuda_graphs=False,
                          prompt_cache_ram=0)
    engine = load_engine(pack.root, config)
    with tqdm(total=sum(len(seq.steps) for seq in sequences), unit="call", desc="engine", disable=not progress) as bar:
        traces = [_trace(engine.step, seq, bar) for seq in sequences]
    del engine
    return traces


def _trace(step: Step, seq: Sequence, bar: tqdm) -> Trace:
    model = step.model
    captured: list[list[torch.Tensor]] = [[] for _ in model.layers]
    hooks = [
        layer.register_forward_hook(lambda _module, _args, out, chunks=chunks: chunks.append(out.float().cpu()))
        for layer, chunks in zip(model.layers, captured)
    ]
    try:
        state, logits = step.new_state(), []
        for tokens in seq.steps:
            logits.append(step.forward(torch.tensor(tokens, dtype=torch.long), state).logits.float().cpu())
            bar.update()
    finally:
        for hook in hooks:
            hook.remove()
    return Trace([torch.cat(chunks) for chunks in captured], torch.cat(logits))
