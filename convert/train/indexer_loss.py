"""The QSA indexer's training signal: match the attention it serves, over the blocks it selected.

The indexer's top-k selection passes no gradient, so the main loss never moves its weights. As in
DeepSeek-V3.2's sparse stage, each query's attention probabilities (summed over heads, the
attention's own, detached) are pooled per selected complete block and renormalised; the indexer's
softmax over the same blocks is pulled toward them by KL divergence. The indexer's input is
detached (BatchedQSAIndexer), so this loss trains the indexer alone. Queries whose selection holds
fewer than two blocks carry no ranking and are left out. The attention probabilities come from
transformers' eager attention (the only implementation that returns them).
"""

from __future__ import annotations

import torch
from torch import nn

from flashpack.convert.train.batched_indexer import BatchedQSAIndexer


class IndexerLoss:
    """Collects each QSA attention's probabilities during a forward; `loss()` then pairs them with
    the layer's indexer scores. One forward, one `loss()` call."""

    def __init__(self, modules: list[nn.Module]):
        self._pairs: list[tuple[BatchedQSAIndexer, list[torch.Tensor]]] = []
        self._hooks = []
        for module in modules:
            for attention in module.modules():
                indexer = getattr(attention, "indexer", None)
                if isinstance(indexer, BatchedQSAIndexer):
                    captured: list[torch.Tensor] = []
                    self._pairs.append((indexer, captured))
                    self._hooks.append(attention.register_forward_hook(_capture_weights(captured)))

    def loss(self) -> torch.Tensor:
        terms = []
        for indexer, captured in self._pairs:
            if not captured:
                continue
            probabilities = captured.pop()
            terms.append(block_kl(probabilities, indexer.last_scores, indexer.last_selected, indexer.compress_ratio))
            captured.clear()
        return torch.stack(terms).mean() if terms else torch.zeros(())

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def block_kl(probabilities: torch.Tensor, scores: torch.Tensor, selected: torch.Tensor, ratio: int) -> torch.Tensor:
    """probabilities [B, heads, T, T], scores / selected [B, T, blocks] -> mean KL(target || indexer)."""
    batch, length, blocks = scores.shape
    mass = probabilities.detach().float().sum(dim=1)[..., : blocks * ratio]
    mass = mass.reshape(batch, length, blocks, ratio).sum(-1).masked_fill(~selected, 0.0)
    target = mass / mass.sum(-1, keepdim=True).clamp_min(1e-9)
    # A large finite fill, not -inf: a query with no selected block would give a NaN row (and NaN grads).
    log_indexer = torch.log_softmax(scores.masked_fill(~selected, -1e9), dim=-1)
    per_block = torch.where(selected, target * (torch.log(target.clamp_min(1e-9)) - log_indexer), 0.0)
    ranked = (selected.sum(-1) >= 2).float()
    # A masked mean rather than indexing: no host sync inside the step.
    return (per_block.sum(-1) * ranked).sum() / ranked.sum().clamp_min(1.0)


def _capture_weights(captured: list[torch.Tensor]):
    def hook(_module, _args, output):
        weights = output[1]
        if weights is None:
            raise ValueError("the indexer loss needs attention probabilities: use the eager attention")
        captured.append(weights)

    return hook
