"""Choosing the next token: greedy, or seeded temperature / top-k / top-p sampling."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashpack.errors import FlashpackError

# Below this temperature sampling is greedy: dividing float32 logits by less would overflow to inf
# (and a Python float under 1e-38 rounds to a float32 zero), while the distribution at 1e-5 is
# already the argmax for any two logits more than ~1e-3 apart.
GREEDY_BELOW_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of decoding; temperature 0 (or below GREEDY_BELOW_TEMPERATURE) means greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise FlashpackError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise FlashpackError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise FlashpackError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise FlashpackError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise FlashpackError(f"seed must fit in 64 bits ([-2^63, 2^64 - 1]), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


class Sampler:
    """Per-request sampler; owns its random generator so seeded runs repeat exactly (on the kind
    of device it was made for: a seed draws one sequence on a CPU and another on a GPU)."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    def __call__(self, logits: torch.Tensor) -> int:
        """float [vocab] -> token id."""
        if self.params.greedy:
            return int(torch.argmax(logits))
        return self.draw(self.probabilities(logits))

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """float [vocab] -> the distribution a token is drawn from (temperature, top-k, top-p)."""
        return filtered_probabilities(logits.float(), self.params)

    def draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))


def filtered_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float [vocab] -> probabilities after temperature, top-k and top-p (nucleus) filtering."""
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p; the first token always survives (a
        # top_p under float32's smallest value compares as 0, which would drop it too).
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        outside[..., 0] = False
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs
