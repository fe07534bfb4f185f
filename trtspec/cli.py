"""The `trtspec` command line."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from trtspec import __version__
from trtspec.errors import TrtspecError

console = Console(stderr=True)


def _fail(exc: Exception) -> None:
    console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    sys.exit(2)


class _Group(click.Group):
    """Prints trtspec's own errors as messages, not tracebacks."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TrtspecError as exc:
            _fail(exc)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="trtspec")
def cli() -> None:
    """Speculative decoding on Triton: build engines, deploy, serve, validate and measure."""


@cli.command()
@click.option("-c", "--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Build config YAML.")
@click.option("-o", "--output", type=click.Path(file_okay=False), help="Engine output dir [default: engines/<name>].")
@click.option("--dry-run", is_flag=True, help="Print the plan and change nothing.")
def build(config_path: str, output: str | None, dry_run: bool) -> None:
    """Build the target and draft engines of a build config."""
    from trtspec.build import run_build

    run_build(config_path, Path(output) if output else None, dry_run=dry_run, console=console)


def main() -> None:
    cli(prog_name="trtspec")


if __name__ == "__main__":
    main()
