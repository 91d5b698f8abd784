"""The trainer's settings: one validated-by-type dataclass, its defaults the committed model's run."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from flashpack.convert.train.training_model import LossWeights


@dataclass(frozen=True)
class TrainSettings:
    size: str = "demo"
    seed: int = 0
    sequence_length: int = 1024
    batch_size: int = 32
    peak_lr: float = 2e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    clip_norm: float = 1.0
    steps: int | None = None  # None: fixed by time_budget_s
    time_budget_s: float = 450.0
    calibration_steps: int = 30
    losses: LossWeights = field(default_factory=LossWeights)
    log_every: int = 25
    eval_every: int = 250
    eval_windows: int = 32  # held-out windows of the periodic evaluations (the final one reads all)
    max_train_files: int | None = None
    max_held_out_files: int | None = None
    device: str = "auto"
    tokenizer_dir: Path | None = None  # a tokenizer trained before on the same corpus, reused
