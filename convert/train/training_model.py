"""The model being trained: transformers' Qwen4ExpForCausalLM, the MTP head, and their losses.

A training window holds T + 2 tokens x_0..x_{T+1}. The backbone reads x_0..x_{T-1} and predicts
x_1..x_T; the MTP head reads the backbone's pre-final-mixer streams at each position p (captured
by a hook on the final mixer's input, so transformers' forward runs unchanged) with x_{p+1}, and
predicts x_{p+2}. The loss is main + mtp_weight * MTP + router_weight * transformers'
load-balancing loss (over the backbone's and the MTP layer's routers) + indexer_weight * the QSA
indexers' KL loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

from flashpack.convert.train.batched_indexer import install_batched_indexers
from flashpack.convert.train.indexer_loss import IndexerLoss
from flashpack.convert.train.mtp_head import TrainingMTPHead


@dataclass(frozen=True)
class LossWeights:
    mtp: float = 0.3
    router: float = 0.01
    indexer: float = 1.0


@dataclass
class Losses:
    total: torch.Tensor
    main: torch.Tensor
    mtp: torch.Tensor
    router: torch.Tensor
    indexer: torch.Tensor

    def detached(self) -> dict[str, torch.Tensor]:
        """Each loss, detached, still on the device (reading them would sync the step)."""
        return {name: getattr(self, name).detach().float() for name in ("total", "main", "mtp", "router", "indexer")}


@dataclass
class Predictions:
    main_logits: torch.Tensor  # [B, T, vocab]: x_1..x_T
    mtp_logits: torch.Tensor  # [B, T, vocab]: x_2..x_{T+1}


class DemoModel(nn.Module):
    def __init__(self, config: Qwen4ExpTextConfig, mtp_layers: int = 1):
        super().__init__()
        self.lm = Qwen4ExpForCausalLM(config)
        self.mtp = TrainingMTPHead(self.lm, mtp_layers)
        install_batched_indexers(self)

    def backbone(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, T] -> (final hidden [B, T, H], pre-final-mixer streams [B, T, hc*H])."""
        captured: list[torch.Tensor] = []
        hook = self.lm.model.hyper_connection_mixer.register_forward_pre_hook(
            lambda _module, args: captured.append(args[0])
        )
        try:
            hidden = self.lm.model(input_ids=input_ids, use_cache=False).last_hidden_state
        finally:
            hook.remove()
        return hidden, captured[0]

    def predict(self, window: torch.Tensor) -> Predictions:
        """window [B, T + 2] -> both heads' logits over it."""
        length = window.shape[1] - 2
        hidden, streams = self.backbone(window[:, :length])
        mtp_logits, _ = self.mtp(self.lm, streams, window[:, 1 : length + 1])
        return Predictions(self.lm.lm_head(hidden), mtp_logits)

    def losses(self, window: torch.Tensor, weights: LossWeights) -> Losses:
        length = window.shape[1] - 2
        routers = _RouterLogits(self)
        indexers = IndexerLoss([self]) if weights.indexer else None
        try:
            predictions = self.predict(window)
        finally:
            routers.close()
            if indexers is not None:
                indexers.close()
        main = _cross_entropy(predictions.main_logits, window[:, 1 : length + 1])
        mtp = _cross_entropy(predictions.mtp_logits, window[:, 2 : length + 2])
        config = self.lm.config
        router = load_balancing_loss_func(tuple(routers.logits), config.num_experts, config.num_experts_per_tok)
        indexer = indexers.loss().to(main.device) if indexers is not None else main.new_zeros(())
        total = main + weights.mtp * mtp + weights.router * router + weights.indexer * indexer
        return Losses(total, main, mtp, router, indexer)


class _RouterLogits:
    """Every router's logits [tokens, experts] during one forward (the backbone's and the MTP layer's)."""

    def __init__(self, model: nn.Module):
        self.logits: list[torch.Tensor] = []
        self._hooks = [
            module.register_forward_hook(lambda _m, _args, output: self.logits.append(output[0]))
            for module in model.modules()
            if isinstance(module, hf.Qwen4ExpTextTopKRouter)
        ]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten().long())
