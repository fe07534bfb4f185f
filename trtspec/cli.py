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


@cli.command()
@click.option("--repo", required=True, type=click.Path(file_okay=False, exists=True), help="Model repository (from `trtspec deploy`).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; 0.0.0.0 exposes the server to the network.")
@click.option("--http-port", default=8000, show_default=True)
@click.option("--grpc-port", default=8001, show_default=True)
@click.option("--metrics-port", default=8002, show_default=True)
@click.option("--tritonserver", "binary", type=click.Path(dir_okay=False), help="tritonserver binary [default: container, PATH, then the nvidia-pytriton wheel].")
@click.option("--log-file", type=click.Path(dir_okay=False), help="Where the server log goes [default: a temp file].")
def serve(repo, host, http_port, grpc_port, metrics_port, binary, log_file) -> None:
    """Run tritonserver on a model repository in the foreground (Ctrl-C stops it)."""
    from trtspec.server import TritonServer, run_foreground

    server = TritonServer(repo, host=host, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                          binary=binary, log_file=log_file)
    sys.exit(run_foreground(server, Console()))


@cli.command()
@click.option("-c", "--config", "config_path", default="build_configs/demo.yaml", show_default=True, type=click.Path(dir_okay=False))
@click.option("--workdir", default="demo-output", show_default=True, type=click.Path(file_okay=False), help="Engines, repository and report go here.")
@click.option("--max-tokens", default=64, show_default=True, help="Tokens per answer.")
@click.option("--num-draft-tokens", type=int, help="Draft length K [default: the config's speculation.num_draft_tokens].")
def demo(config_path, workdir, max_tokens, num_draft_tokens) -> None:
    """Build, deploy and serve the demo pair, stream answers, validate, and print a summary."""
    from trtspec.demo import run_demo

    sys.exit(run_demo(config_path, Path(workdir), max_tokens=max_tokens, num_draft_tokens=num_draft_tokens))


@cli.command()
@click.option("-c", "--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Build config YAML.")
@click.option("--engines", type=click.Path(file_okay=False), help="Engine dir of `trtspec build` [default: engines/<name>].")
@click.option("--repo", required=True, type=click.Path(file_okay=False), help="Model repository to write.")
@click.option("--device", default="auto", show_default=True, help="Where the engine models run: auto, cpu, cuda, cuda:N.")
@click.option("--force", is_flag=True, help="Replace --repo even if it is not a repository written by trtspec.")
def deploy(config_path: str, engines: str | None, repo: str, device: str, force: bool) -> None:
    """Write the Triton model repository for built engines, then validate it."""
    from trtspec.build import default_output
    from trtspec.config import load_config
    from trtspec.repository import validate_repository, write_repository

    loaded = load_config(config_path)
    out = write_repository(loaded, Path(engines) if engines else default_output(loaded), repo, force=force, device=device)
    problems = validate_repository(out)
    _report_problems(f"repository {out}", problems)
    console.print(f"model repository in {escape(str(out))}; serve it with `trtspec serve --repo {escape(str(out))}`", highlight=False)


@cli.group(cls=_Group)
def validate() -> None:
    """Check a model repository, engines or outputs."""


@validate.command("repo")
@click.argument("path", type=click.Path())
def validate_repo(path: str) -> None:
    """Check a model repository: models, tensors against the contract, ensemble wiring, parameters."""
    from trtspec.repository import validate_repository

    _report_problems(f"repository {path}", validate_repository(path))
    console.print(f"[green]ok[/]: {escape(path)}", highlight=False)


def _report_problems(what: str, problems: list) -> None:
    """Print every problem and exit 1 when there is any."""
    if not problems:
        return
    console.print(f"[bold red]{escape(what)}: {len(problems)} problem{'s' if len(problems) != 1 else ''}[/]", highlight=False)
    for problem in problems:
        console.print(f"  - {escape(str(problem))}", highlight=False, soft_wrap=True)
    sys.exit(1)


def main() -> None:
    cli(prog_name="trtspec")


if __name__ == "__main__":
    main()
