"""How far one tensor is from another: max abs error, relative error ||a - b|| / ||b|| (Frobenius,
float64) and cosine similarity. `flashpack verify` gates on them (verify/compare.py), and the
bench checks its baseline's logits with them."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Errors:
    max_abs: float
    rel: float
    cos: float

    def to_dict(self) -> dict:
        return asdict(self)


def errors(ours: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 24) -> Errors:
    """Any shapes with equal numel; float64 sums over chunks (a real model's logits are ~0.5G values).
    A NaN anywhere in `ours` makes every field NaN, which fails every gate."""
    a, b = ours.flatten(), ref.flatten()
    max_abs = diff_sq = ref_sq = ours_sq = dot = 0.0
    for start in range(0, a.numel(), chunk):
        x, y = a[start:start + chunk].double(), b[start:start + chunk].double()
        diff = x - y
        max_abs = nan_max([max_abs, diff.abs().max().item()])
        diff_sq += (diff * diff).sum().item()
        ref_sq += (y * y).sum().item()
        ours_sq += (x * x).sum().item()
        dot += (x * y).sum().item()
    if math.isnan(diff_sq):
        return Errors(math.nan, math.nan, math.nan)
    rel = math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else (0.0 if diff_sq == 0 else math.inf)
    cos = dot / math.sqrt(ours_sq * ref_sq) if ours_sq * ref_sq > 0 else float(diff_sq == 0)
    return Errors(max_abs=max_abs, rel=rel, cos=cos)


def worst(*measured: Errors) -> Errors:
    """The worst of several measurements, field by field (NaN is worst of all)."""
    return Errors(
        max_abs=nan_max([e.max_abs for e in measured]),
        rel=nan_max([e.rel for e in measured]),
        cos=-nan_max([-e.cos for e in measured]),
    )


def nan_max(values: list[float]) -> float:
    """max() that keeps NaN (Python's max drops it or not depending on the order)."""
    return math.nan if any(math.isnan(v) for v in values) else max(values)
