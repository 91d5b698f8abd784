"""The one call the MoE block makes to get routed experts: `ExpertFetcher.fetch`.

Per layer and per forward, the MoE block asks for the union of the experts its router picked and
gets their dequantised weights back. Whatever tiers sit behind a fetcher (device slots, pinned host
cache, disk reads) are invisible here. MTP layers use layer index num_hidden_layers + mtp_layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class ExpertWeights:
    """One expert, dequantised, [out, in] like nn.Linear: gate, up [I, H]; down [H, I]."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@runtime_checkable
class ExpertFetcher(Protocol):
    def fetch(self, layer: int, experts: list[int]) -> dict[int, ExpertWeights]:
        """Weights of `experts` (ascending, unique) of decoder `layer`; every id must be in the result."""
        ...
