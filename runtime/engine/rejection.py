"""Speculative sampling's rejection rule: drafted tokens accepted so that what comes out is
distributed exactly as the model's own sampling (Leviathan et al. 2023, Chen et al. 2023).

For a drafted token d with draft distribution q and the model's (filtered) distribution p at that
position: accept d with probability min(1, p(d) / q(d)); otherwise draw the token from the residual
max(0, p - q), renormalised, and stop checking. A drafter that proposes d deterministically (prompt
lookup, the MTP head's argmax) has q one-hot at d: d is accepted with probability p(d), and a
rejection draws from p with d taken out. Either way a position's token is distributed as p.
"""

from __future__ import annotations

import torch


def accept_or_resample(p: torch.Tensor, draft: int, q: torch.Tensor | None, generator: torch.Generator
                       ) -> tuple[bool, int]:
    """p [vocab] the model's probabilities, q [vocab] the drafter's (None: one-hot at `draft`).
    Returns (accepted, the position's token): `draft` itself when accepted, else the residual's draw."""
    draft_probability = 1.0 if q is None else float(q[draft])
    uniform = float(torch.rand((), generator=generator, device=generator.device))
    if draft_probability > 0 and uniform * draft_probability < float(p[draft]):  # u < p(d) / q(d)
        return True, draft
    if q is None:
        residual = p.clone()
        residual[draft] = 0
    else:
        residual = (p - q).clamp_min(0)
    total = float(residual.sum())
    if total <= 0:  # p == q (or p one-hot at the rejected draft): rejection had probability zero
        residual, total = p, float(p.sum())
    return False, int(torch.multinomial(residual / total, 1, generator=generator))
