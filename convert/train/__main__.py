"""`python -m flashpack.convert.train OUT`: train the demo model into OUT/snapshot with
OUT/training-record.json beside it (the committed one: OUT = the package's demo_model/ folder)."""

from __future__ import annotations

from pathlib import Path

import click

from flashpack.errors import one_line_errors
from flashpack.convert.train.model_config import SIZES
from flashpack.convert.train.train import TrainSettings, train
from flashpack.convert.train.training_model import LossWeights

_DEFAULTS = TrainSettings()


@click.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--size", type=click.Choice(sorted(SIZES)), default=_DEFAULTS.size, show_default=True)
@click.option("--seed", type=int, default=_DEFAULTS.seed, show_default=True)
@click.option("--steps", type=int, help="Fix the schedule's length (default: fit --time-budget).")
@click.option("--time-budget", type=float, default=_DEFAULTS.time_budget_s, show_default=True,
              help="Seconds of training when --steps is not given.")
@click.option("--sequence-length", type=int, default=_DEFAULTS.sequence_length, show_default=True)
@click.option("--batch-size", type=int, default=_DEFAULTS.batch_size, show_default=True)
@click.option("--lr", type=float, default=_DEFAULTS.peak_lr, show_default=True, help="Peak learning rate.")
@click.option("--warmup-steps", type=int, default=_DEFAULTS.warmup_steps, show_default=True)
@click.option("--mtp-weight", type=float, default=LossWeights.mtp, show_default=True)
@click.option("--indexer-weight", type=float, default=LossWeights.indexer, show_default=True,
              help="0 turns the QSA indexer's KL loss off (and attention to SDPA).")
@click.option("--log-every", type=int, default=_DEFAULTS.log_every, show_default=True)
@click.option("--eval-every", type=int, default=_DEFAULTS.eval_every, show_default=True)
@click.option("--max-train-files", type=int, help="Read only the corpus's first N training files (smoke runs).")
@click.option("--max-held-out-files", type=int, help="Read only the first N held-out files.")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(path_type=Path, file_okay=False),
              help="Reuse a tokenizer trained on the same corpus (a snapshot folder) instead of training one.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--force", is_flag=True, help="Replace OUT's snapshot and record if they exist.")
@one_line_errors
def main(out, size, seed, steps, time_budget, sequence_length, batch_size, lr, warmup_steps, mtp_weight,
         indexer_weight, log_every, eval_every, max_train_files, max_held_out_files, tokenizer_dir, device, force):
    settings = TrainSettings(
        size=size, seed=seed, steps=steps, time_budget_s=time_budget, sequence_length=sequence_length,
        batch_size=batch_size, peak_lr=lr, warmup_steps=warmup_steps,
        losses=LossWeights(mtp=mtp_weight, indexer=indexer_weight), log_every=log_every, eval_every=eval_every,
        max_train_files=max_train_files, max_held_out_files=max_held_out_files, tokenizer_dir=tokenizer_dir,
        device=device,
    )
    train(out, settings, force=force, log=lambda line: click.echo(line, err=True))


if __name__ == "__main__":
    main()
