"""Sparse MoE block: softmax router (fp32), top-k, renormalise; routed experts + gated shared expert.

Routed experts come from the `ExpertFetcher`, one `fetch` per forward with the union of the experts
the router picked for the T tokens (T = 1 in decode, the whole prompt in prefill: a long prompt
touches most experts, so one layer-major pass moves each of them once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashpack.layout.model_config import TextConfig
from flashpack.runtime.experts import ExpertFetcher
from flashpack.runtime.model.norms import activation
from flashpack.runtime.weights import WeightSource, load_dense


class SparseMoE(nn.Module):
    def __init__(
        self, cfg: TextConfig, source: WeightSource, prefix: str, layer: int, fetcher: ExpertFetcher,
        dtype: torch.dtype, device,
    ):
        super().__init__()
        self.layer, self.fetcher, self.dtype, self.device = layer, fetcher, dtype, device
        self.top_k, self.renormalise = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.act = activation(cfg.hidden_act)
        load = lambda name: load_dense(source, prefix + name, dtype, device)  # noqa: E731
        self.register_buffer("router", load("gate.weight"), persistent=False)  # [E, H]
        self.register_buffer("shared_gate_proj", load("shared_expert.gate_proj.weight"), persistent=False)
        self.register_buffer("shared_up_proj", load("shared_expert.up_proj.weight"), persistent=False)
        self.register_buffer("shared_down_proj", load("shared_expert.down_proj.weight"), persistent=False)
        self.register_buffer("shared_expert_gate", load("shared_expert_gate.weight"), persistent=False)  # [1, H]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        logits = F.linear(x, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, experts = self.route(x)
        wanted = torch.unique(experts).tolist()  # ascending: the order transformers accumulates in
        fetched = self.fetcher.fetch(self.layer, wanted)
        out = torch.zeros_like(x)
        for expert in wanted:
            tokens, slot = torch.where(experts == expert)
            w = fetched[expert]
            h = x[tokens]
            h = self.act(F.linear(h, self._cast(w.gate))) * F.linear(h, self._cast(w.up))
            h = F.linear(h, self._cast(w.down)) * weights[tokens, slot, None]
            out.index_add_(0, tokens, h.to(out.dtype))
        shared = F.linear(self.act(F.linear(x, self.shared_gate_proj)) * F.linear(x, self.shared_up_proj),
                          self.shared_down_proj)
        return out + torch.sigmoid(F.linear(x, self.shared_expert_gate)) * shared

    def _cast(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to(device=self.device, dtype=self.dtype)
