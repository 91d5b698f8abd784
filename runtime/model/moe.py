"""Sparse MoE block: softmax router (fp32), top-k, renormalise; routed experts + gated shared expert.

The routed experts come through the block's `RoutedExperts` (runtime/model/routed_experts.py),
called once per forward with the routing of all T tokens (T = 1 in decode, the whole prompt in
prefill). The shared expert is computed first, so on a GPU it is enqueued before whatever the
routed experts wait for.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from flashpack.layout.model_config import TextConfig
from flashpack.runtime.kernels import router_top_k
from flashpack.runtime.model.linear import DenseLinear, StackedLinear
from flashpack.runtime.model.norms import activation
from flashpack.runtime.model.routed_experts import RoutedExperts
from flashpack.runtime.weights import WeightSource


class SparseMoE(nn.Module):
    def __init__(
        self, cfg: TextConfig, source: WeightSource, prefix: str, layer: int, routed: RoutedExperts,
        dtype: torch.dtype, device,
    ):
        super().__init__()
        self.layer, self.routed = layer, routed
        self.routing_observer: Callable[[int, torch.Tensor], None] | None = None  # (layer, ids [T, k])
        self.num_experts, self.top_k, self.renormalise = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.act = activation(cfg.hidden_act)
        # The router [E, H], the shared expert's gate and up [I, H] and its gate [1, H]: one stacked
        # projection of the block input (the router also runs alone, to predict from a layer before).
        names = ("gate.weight", "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                 "shared_expert_gate.weight")
        self.in_proj = StackedLinear(source, [prefix + name for name in names], dtype, device)
        self.shared_down_proj = DenseLinear(source, prefix + "shared_expert.down_proj.weight", dtype, device)

    def gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (routing weights [T, k], expert ids [T, k], shared expert output [T, H])."""
        logits, gate, up, shared_gate = self.in_proj(x)
        weights, experts = self._top_k(logits)
        shared = torch.sigmoid(shared_gate) * self.shared_down_proj(self.act(gate) * up)
        return weights, experts, shared

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        return self._top_k(self.in_proj.part(x, 0))

    def _top_k(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = router_top_k(logits, self.top_k, self.renormalise)
        return weights.to(logits.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        weights, experts, shared = self.gate(x)
        return self.routed_output(x, weights, experts) + shared

    def routed_output(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum [T, H] for the routing `gate` gave (told to the observer)."""
        if self.routing_observer is not None:
            self.routing_observer(self.layer, experts)
        return self.routed(self.layer, x, weights, experts)
