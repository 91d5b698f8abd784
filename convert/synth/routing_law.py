"""How popular each expert is: a log-popularity law fitted to the published routing-mass curve.

The real model's top 32 / 64 / 128 / 171 / 256 of 512 experts in a layer carry 37 / 53 / 73 / 82 /
93 % of the routing mass (measured over a 2,496-token probe). A plain Zipf law fits the head but
leaves too much mass in the tail, so each expert of popularity rank r (1-based, E experts) gets a
router logit bias, in units of the router's token-to-token logit noise,

    bias(r) = -alpha * ln(r) - beta * (r - 1) / E        (Zipf with an exponential cut-off)

and (alpha, beta) are fitted by Monte Carlo: logits = tau * (bias + N(0, 1)), softmax, top-k,
renormalised weights summed per expert over as many tokens as the published probe, then the
cumulative mass of the top fractions is compared with all five targets. The fit is a few hundred
cheap evaluations with fixed noise (common random numbers), so it runs in about a second at E=512.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TARGET_FRACTIONS = (32 / 512, 64 / 512, 128 / 512, 171 / 512, 256 / 512)
TARGET_MASS = (0.37, 0.53, 0.73, 0.82, 0.93)
PROBE_TOKENS = 2496  # the published probe's length: finite-sample noise is part of the measured curve


@dataclass(frozen=True)
class PopularityLaw:
    alpha: float  # Zipf exponent on the logit scale
    beta: float  # exponential cut-off across the ranks

    def biases(self, num_experts: int) -> torch.Tensor:
        """float32 [E]: bias of the expert at each popularity rank, best first, in noise units."""
        rank = torch.arange(1, num_experts + 1, dtype=torch.float64)
        return (-self.alpha * rank.log() - self.beta * (rank - 1) / num_experts).float()


def routing_mass(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """float32 [T, E] logits -> float32 [E]: renormalised top-k weight each expert receives, summed."""
    # Softmax over all experts then renormalising the top k equals a softmax over the top-k logits.
    top_logits, experts = router_logits.float().topk(top_k, dim=-1)
    weights = torch.softmax(top_logits, dim=-1)
    mass = torch.zeros(router_logits.shape[-1], dtype=torch.float64)
    mass.index_add_(0, experts.flatten(), weights.flatten().double())
    return mass.float()


def mass_curve(mass: torch.Tensor, fractions: tuple[float, ...] = TARGET_FRACTIONS) -> list[float]:
    """Share of the total mass carried by the hottest `fraction * E` experts (interpolated between
    whole expert counts, since 171/512 of a small expert count is fractional)."""
    ordered = mass.double().sort(descending=True).values
    cumulative = torch.cat([torch.zeros(1, dtype=torch.float64), ordered.cumsum(0)]) / ordered.sum()
    curve = []
    for fraction in fractions:
        position = fraction * mass.numel()
        low = min(math.floor(position), mass.numel())
        high = min(low + 1, mass.numel())
        share = cumulative[low] + (cumulative[high] - cumulative[low]) * (position - low)
        curve.append(float(share))
    return curve


def simulate_curve(law: PopularityLaw, num_experts: int, top_k: int, tau: float, noise: torch.Tensor) -> list[float]:
    """Expected measured curve for `noise` [T, E] of standard normals (reused across calls)."""
    logits = tau * (law.biases(num_experts) + noise)
    return mass_curve(routing_mass(logits, top_k))


def fit_law(num_experts: int, top_k: int, tau: float, seed: int = 0) -> PopularityLaw:
    """Damped Gauss-Newton on (alpha, beta) >= 0 over the five residuals: ~30 simulations."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(PROBE_TOKENS, num_experts, generator=generator)
    target = torch.tensor(TARGET_MASS, dtype=torch.float64)

    def residuals(params: torch.Tensor) -> torch.Tensor:
        law = PopularityLaw(float(params[0]), float(params[1]))
        return torch.tensor(simulate_curve(law, num_experts, top_k, tau, noise), dtype=torch.float64) - target

    params = torch.tensor([0.5, 1.0], dtype=torch.float64)
    current = residuals(params)
    damping, step = 1e-3, 1e-2
    for _ in range(_FIT_ITERATIONS):
        jacobian = torch.stack(
            [(residuals(params + step * unit) - current) / step for unit in torch.eye(2, dtype=torch.float64)], dim=1
        )
        normal = jacobian.T @ jacobian
        gradient = jacobian.T @ current
        while damping < 1e6:
            candidate = (
                params - torch.linalg.solve(normal + damping * torch.eye(2, dtype=torch.float64), gradient)
            ).clamp(min=0)
            trial = residuals(candidate)
            if trial.square().sum() < current.square().sum():
                params, current, damping = candidate, trial, damping / 10
                break
            damping *= 10
        else:
            break
    return PopularityLaw(alpha=float(params[0]), beta=float(params[1]))


_FIT_ITERATIONS = 8
