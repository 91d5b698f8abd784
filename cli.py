"""The `flashpack` command. Each subcommand is thin: parse flags, call one keyword function."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from flashpack import __version__
from flashpack.errors import FlashpackError


def _one_line_errors(command):
    """User errors print one line and exit 2; no traceback for things the user can fix."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except FlashpackError as error:
            click.echo(f"error: {error}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper


@click.group()
@click.version_option(__version__, prog_name="flashpack")
def main() -> None:
    """Run Qwen3.8-Flash-Next from a tiered expert pack."""


@main.command()
@click.argument("source")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--revision", help="Hub revision (branch, tag or commit) when SOURCE is a repo id.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--dense-fp8", is_flag=True, help="Store large dense matrices as FP8 with one scale per row.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@_one_line_errors
def convert(source: str, out: Path, revision: str | None, force: bool, dense_fp8: bool, quiet: bool) -> None:
    """Repack a Hugging Face checkpoint (SOURCE: directory or hub repo id) into a pack at OUT."""
    from flashpack.convert.pipeline import convert as run_convert

    pack = run_convert(source, out, revision=revision, force=force, dense_fp8=dense_fp8, progress=not quiet)
    click.echo(f"wrote {pack}")


@main.command()
@click.argument("pack", type=click.Path(path_type=Path))
@click.option("--check", is_flag=True, help="Re-hash every expert record against the manifest.")
@_one_line_errors
def inspect(pack: Path, check: bool) -> None:
    """Show what PACK holds; with --check, verify every record."""
    from flashpack.layout.inspect import find_corrupt_records, summarize
    from flashpack.layout.pack import Pack

    opened = Pack.open(pack)
    for line in summarize(opened).lines():
        click.echo(line)
    if check:
        corrupt = find_corrupt_records(opened)
        for entry in corrupt:
            click.echo(f"corrupt: layer {entry.layer} expert {entry.expert} ({entry.file} @ {entry.offset})", err=True)
        if corrupt:
            raise FlashpackError(f"{len(corrupt)} corrupt expert record(s)")
        click.echo(f"all {len(opened.manifest.expert_records())} expert records match their hashes")


if __name__ == "__main__":
    main()
