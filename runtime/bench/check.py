"""Do the two engines compute the same model? Logits of the prefill's last position, ours against
the baseline's, with both running the same first K decoder layers on the same prompt.

Our side runs the engine with its layer list cut to the first K (embedding, those layers, final
mixer, lm_head: exactly the model transformers builds with num_hidden_layers = K). The gate is
FP32's: relative error (Frobenius, float64) <= 1e-4 and the same argmax; in BF16 the numbers are
reported without a gate (the two engines round differently; verify measures that floor).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from flashpack.runtime.tensor_errors import errors

FP32_REL_TOLERANCE = 1e-4


@contextmanager
def first_layers(model, count: int) -> Iterator[None]:
    """`model` (a Qwen4ExpModel) runs only its first `count` decoder layers inside the block."""
    layers = model.layers
    model.layers = nn.ModuleList(list(layers)[:count])
    try:
        yield
    finally:
        model.layers = layers


@torch.no_grad()
def prefix_logits(model, prompt: list[int], count: int) -> torch.Tensor:
    """float32 [vocab] logits of the last prompt position through the first `count` layers."""
    with first_layers(model, count):
        out = model.forward(torch.tensor(prompt, dtype=torch.long), model.new_state(), last_only=True)
    return out.logits[-1].float().cpu()


def compare_logits(ours: torch.Tensor, baseline: torch.Tensor, dtype: torch.dtype) -> dict:
    measured = errors(ours, baseline)
    same_top1 = int(ours.argmax()) == int(baseline.argmax())
    gated = dtype == torch.float32
    return {
        "rel": measured.rel,
        "max_abs": measured.max_abs,
        "cos": measured.cos,
        "ours_top1": int(ours.argmax()),
        "baseline_top1": int(baseline.argmax()),
        "same_top1": same_top1,
        "tolerance": FP32_REL_TOLERANCE if gated else None,
        "passed": (measured.rel <= FP32_REL_TOLERANCE and same_top1) if gated else None,
    }
