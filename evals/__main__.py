"""`python -m flashpack.evals URL PACK`: our lm-eval tasks against the `flashpack serve` at URL.

Builds the tasks' documents from the held-out slice, runs lm-eval's `local-completions` (which
starts nothing: the server must be running), prints lm-eval's table and, for the code task, its bits
per byte beside the training record's held-out loss in the same unit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from flashpack.errors import FlashpackError
from flashpack.evals import TASK_NAMES


@click.command()
@click.argument("url")
@click.argument("pack", type=click.Path(path_type=Path))
@click.option("--tasks", default=",".join(TASK_NAMES), show_default=True, help="Comma-separated task names.")
@click.option("--limit", type=int, help="Only the first N documents of each task.")
@click.option("--max-files", type=int, help="Only the first N held-out files.")
@click.option("--batch-size", type=int, default=1, show_default=True, help="Prompts a request (at most 64).")
@click.option("--api-key", envvar="FLASHPACK_API_KEY", help="The server's --api-key, if it has one.")
@click.option("--json", "json_out", type=click.Path(path_type=Path), help="Write lm-eval's results here.")
def main(url: str, pack: Path, tasks: str, limit: int | None, max_files: int | None, batch_size: int,
         api_key: str | None, json_out: Path | None) -> None:
    """Evaluate the model served at URL (e.g. http://127.0.0.1:8000), whose pack is PACK."""
    try:
        _run(url, pack, tuple(t for t in tasks.split(",") if t), limit, max_files, batch_size, api_key, json_out)
    except FlashpackError as error:
        click.echo(f"error: {error}", err=True)
        sys.exit(2)


def _run(url, pack, tasks, limit, max_files, batch_size, api_key, json_out) -> None:
    from lm_eval.utils import make_table

    from flashpack.demo_model import training_record
    from flashpack.evals.run import evaluate, held_out_in_bits_per_byte

    unknown = sorted(set(tasks) - set(TASK_NAMES))
    if unknown or not tasks:
        raise FlashpackError(f"unknown task {', '.join(unknown) or '(none)'}: the tasks are {', '.join(TASK_NAMES)}")
    if not 1 <= batch_size <= 64:
        raise FlashpackError(f"--batch-size must be 1..64, got {batch_size}")
    results = evaluate(url, pack, tasks, limit, max_files, batch_size, api_key)
    click.echo(make_table(results))
    if json_out is not None:
        json_out.write_text(json.dumps(results["results"], indent=1, default=str) + "\n")
    code = results["results"].get("flashpack_heldout_code")
    if code is not None:
        record = training_record()
        click.echo(f"flashpack_heldout_code: {code['bits_per_byte,none']:.4f} bits/byte; the training record's "
                   f"held-out loss {record['final']['loss']:.4f} nats/token at "
                   f"{record['tokens']['bytes_per_token_held_out']:.3f} bytes/token is "
                   f"{held_out_in_bits_per_byte(record):.4f} bits/byte (the demo model; another pack's record differs)")


if __name__ == "__main__":
    main()
