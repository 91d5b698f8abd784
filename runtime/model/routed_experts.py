"""The one interface through which a MoE block gets its routed experts' output, and its plain form.

    RoutedExperts(layer, x [T, H], weights [T, k], experts [T, k]) -> [T, H]
        sum over k of weights[t, j] * expert_{experts[t, j]}(x[t]), for decoder (or MTP) layer
        `layer`. The block computes the routing; how the experts' weights are found and run (a
        tiered store, a resident bank of NVFP4 records and fused kernels, or dequantised weights)
        is the implementation's. The engine's live in runtime/engine/expert_paths.py.

`DequantisedExperts` is the plain form over an `ExpertFetcher` (dequantised [out, in] weights run as
ordinary linears, in the order transformers accumulates in): the reference every other form is
tested against.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from flashpack.layout.model_config import TextConfig
from flashpack.runtime.experts import ExpertFetcher, ExpertSlots
from flashpack.runtime.model.norms import activation


@runtime_checkable
class RoutedExperts(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        ...


class DequantisedExperts:
    def __init__(self, fetcher: ExpertFetcher, act, dtype: torch.dtype, device: torch.device | str):
        self.fetcher, self.act, self.dtype, self.device = fetcher, act, dtype, torch.device(device)

    def __call__(self, layer: int, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        wanted = torch.unique(experts).tolist()  # ascending: the order transformers accumulates in
        fetched = self.fetcher.fetch(layer, wanted)
        out = torch.zeros_like(x)
        for expert in wanted:
            tokens, pick = torch.where(experts == expert)
            w = fetched[expert]
            h = x[tokens]
            h = self.act(F.linear(h, self._cast(w.gate))) * F.linear(h, self._cast(w.up))
            h = F.linear(h, self._cast(w.down)) * weights[tokens, pick, None]
            out.index_add_(0, tokens, h.to(out.dtype))
        return out

    def _cast(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to(device=self.device, dtype=self.dtype)


def as_routed_experts(experts: RoutedExperts | ExpertFetcher, cfg: TextConfig, dtype: torch.dtype, device
                      ) -> RoutedExperts:
    """`experts` itself, or an ExpertFetcher's dequantised weights as the plain DequantisedExperts. A
    source of device slots (an expert store) runs its records in place through the engine's
    RoutedExperts (runtime/engine/expert_paths.py), never dequantised here by accident."""
    if isinstance(experts, ExpertSlots):
        raise TypeError("an expert store's slots run through the engine's RoutedExperts "
                        "(runtime.engine.expert_paths.routed_experts), not as dequantised weights")
    if isinstance(experts, ExpertFetcher):
        return DequantisedExperts(experts, activation(cfg.hidden_act), dtype, device)
    return experts
