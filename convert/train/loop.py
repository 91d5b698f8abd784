"""The training loop: steps over seeded batches, the learning-rate schedule, logging and guards.

The schedule is fixed by `steps`, or by a wall-time budget: after `calibration_steps` the mean step
time (timed from a third of the way there, past kernel autotuning) fixes the total so that training
ends inside the budget; training also stops at the budget whatever the estimate said. Losses are
summed on the device and read only at log points, so a step never waits for the host. A run whose
losses turn non-finite stops and keeps the weights of its last finite log point.
"""

from __future__ import annotations

import json
import math
import time

import torch

from flashpack.convert.train.evaluate import evaluate
from flashpack.convert.train.optimizer import MasterWeightAdamW, Schedule
from flashpack.convert.train.settings import TrainSettings
from flashpack.convert.train.training_model import DemoModel
from flashpack.convert.train.windows import Windows



class TrainingLoop:
    def __init__(self, model: DemoModel, optimizer: MasterWeightAdamW, settings: TrainSettings, device: torch.device):
        self.model, self.optimizer, self.settings, self.device = model, optimizer, settings, device
        self.schedule = (
            Schedule(settings.peak_lr, settings.warmup_steps, settings.steps) if settings.steps is not None else None
        )
        self.steps_done = self.tokens_seen = 0
        self.wall_s = 0.0
        self.stopped_early: str | None = None
        self._last_good: dict[str, torch.Tensor] | None = None
        self._last_good_step = 0

    def run(self, windows: Windows, held_out: Windows, unigram: torch.Tensor, log) -> tuple[list, list]:
        settings, curve, evals = self.settings, [], []
        sums: dict[str, torch.Tensor] = {}  # summed on the device, read at each log point only
        started = time.perf_counter()
        calibration_start = None
        batches = windows.shuffled(settings.batch_size, settings.seed)
        self._keep_last_good()
        while True:
            if self.schedule is not None and self.steps_done >= self.schedule.total_steps:
                break
            elapsed = time.perf_counter() - started
            if settings.steps is None and elapsed >= settings.time_budget_s:
                log(f"time budget reached at step {self.steps_done}")
                break
            epoch, batch = next(batches)
            losses = self.model.losses(batch.to(self.device, non_blocking=True), settings.losses)
            losses.total.backward()
            lr = self._lr()
            grad_norm = self.optimizer.step(lr)
            self.optimizer.zero_grad()
            self.steps_done += 1
            self.tokens_seen += batch.shape[0] * settings.sequence_length
            for name, value in dict(losses.detached(), grad_norm=grad_norm.float()).items():
                sums[name] = sums[name] + value if name in sums else value

            if self.schedule is None and self.steps_done == settings.calibration_steps // 3:
                _synchronize(self.device)
                calibration_start = (time.perf_counter(), self.steps_done)
            if self.schedule is None and self.steps_done == settings.calibration_steps:
                self.schedule = self._calibrated(started, calibration_start)
                log(f"schedule: {self.schedule.total_steps} steps in {settings.time_budget_s:.0f} s")
            if self.steps_done % settings.log_every == 0:
                point = {"step": self.steps_done, "epoch": epoch, "tokens": self.tokens_seen, "lr": lr,
                         "elapsed_s": round(time.perf_counter() - started, 2)}
                point.update({name: round(float(value) / settings.log_every, 5) for name, value in sums.items()})
                curve.append(point)
                sums = {}
                log(json.dumps(point))
                if not math.isfinite(point["total"]):
                    self._restore_last_good(log)
                    break
                self._keep_last_good()
            if self.steps_done % settings.eval_every == 0:
                numbers = evaluate(self.model, held_out, unigram, settings.batch_size, self.device,
                                   limit=settings.eval_windows)
                evals.append({"step": self.steps_done, **{k: round(v, 5) for k, v in numbers.items()}})
                log("eval " + json.dumps(evals[-1]))
        _synchronize(self.device)
        self.wall_s = time.perf_counter() - started
        return curve, evals

    def _keep_last_good(self) -> None:
        """A copy of the weights at the last log point whose losses were finite (on the device)."""
        self._last_good = {name: value.detach().clone() for name, value in self.model.state_dict().items()}
        self._last_good_step = self.steps_done

    def _restore_last_good(self, log) -> None:
        """A diverged run stops and keeps the weights of its last finite log point."""
        self.stopped_early = f"non-finite loss by step {self.steps_done}; weights of step {self._last_good_step} kept"
        log(self.stopped_early)
        if self._last_good is not None:
            self.model.load_state_dict(self._last_good)

    def _lr(self) -> float:
        if self.schedule is not None:
            return self.schedule.lr(self.steps_done)
        # Before calibration only the warm-up applies, which does not depend on the total.
        return self.settings.peak_lr * (self.steps_done + 1) / self.settings.warmup_steps

    def _calibrated(self, started: float, calibration_start: tuple[float, int]) -> Schedule:
        _synchronize(self.device)
        now = time.perf_counter()
        first_time, first_step = calibration_start
        step_s = (now - first_time) / (self.steps_done - first_step)
        remaining = self.settings.time_budget_s - (now - started)
        # Periodic evaluations take time too: leave them room at the calibrated step rate.
        total = self.steps_done + int(remaining / step_s * 0.97)
        return Schedule(self.settings.peak_lr, self.settings.warmup_steps, max(total, self.settings.warmup_steps + 1))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
