"""AdamW with warm-up and cosine decay, over float32 master weights when the model is BF16.

On a GPU the model's parameters are BF16, so every matmul runs in BF16 (transformers' grouped
experts take their fast grouped_mm path only with BF16 weights, which autocast does not give
them); the optimizer keeps a float32 copy of each parameter, steps that copy and rounds it back
into the model, so updates far below BF16's resolution still accumulate. With float32 parameters
(the CPU) the copy is the parameter itself. Matrices decay; norms, gates' biases and the DeltaNet
decay parameters (1-D) do not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Schedule:
    peak_lr: float
    warmup_steps: int
    total_steps: int
    final_fraction: float = 0.1

    def lr(self, step: int) -> float:
        """Learning rate for 0-based `step`: linear warm-up, then cosine down to final_fraction."""
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.final_fraction
        return self.peak_lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


class MasterWeightAdamW:
    def __init__(self, model: nn.Module, weight_decay: float, betas: tuple[float, float], clip_norm: float):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        fused = all(p.is_cuda for p in self.params)
        groups = [
            {"params": [m for m in self.masters if m.ndim >= 2], "weight_decay": weight_decay},
            {"params": [m for m in self.masters if m.ndim < 2], "weight_decay": 0.0},
        ]
        self.inner = torch.optim.AdamW(groups, lr=0.0, betas=betas, fused=fused)
        self.clip_norm = clip_norm

    def step(self, lr: float) -> torch.Tensor:
        """Apply the gradients in the model's parameters; returns the gradient norm before clipping
        (a device tensor: reading it would sync the step)."""
        for param, master in zip(self.params, self.masters):
            if master is not param:
                master.grad = None if param.grad is None else param.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(self.masters, self.clip_norm)
        for group in self.inner.param_groups:
            group["lr"] = lr
        self.inner.step()
        with torch.no_grad():
            for param, master in zip(self.params, self.masters):
                if master is not param:
                    param.copy_(master)
        return norm

    def zero_grad(self) -> None:
        for param, master in zip(self.params, self.masters):
            param.grad = None
            master.grad = None
