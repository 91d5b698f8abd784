"""Our side: flashpack's engine run from the pack (PackWeights + PackExperts), instrumented.

Forward hooks on the engine's decoder layers capture every layer's hc streams; the sequence goes
through the engine exactly as generation would send it: the prefill chunk in one call, then each
decode token in its own call with the state carried over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from flashpack.layout.pack import Pack
from flashpack.runtime.model import Qwen4ExpModel
from flashpack.runtime.pack_source import PackExperts, PackWeights
from flashpack.verify.inputs import Sequence


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
    model = Qwen4ExpModel(PackWeights(pack), PackExperts(pack), dtype=dtype, device=device)
    with tqdm(total=sum(len(seq.steps) for seq in sequences), unit="call", desc="engine", disable=not progress) as bar:
        traces = [_trace(model, seq, bar) for seq in sequences]
    del model
    return traces


def _trace(model: Qwen4ExpModel, seq: Sequence, bar: tqdm) -> Trace:
    captured: list[list[torch.Tensor]] = [[] for _ in model.layers]
    hooks = [
        layer.register_forward_hook(lambda _module, _args, out, chunks=chunks: chunks.append(out.float().cpu()))
        for layer, chunks in zip(model.layers, captured)
    ]
    try:
        state, logits = model.new_state(), []
        for step in seq.steps:
            logits.append(model(torch.tensor(step, dtype=torch.long), state).logits.float().cpu())
            bar.update()
    finally:
        for hook in hooks:
            hook.remove()
    return Trace([torch.cat(chunks) for chunks in captured], torch.cat(logits))
