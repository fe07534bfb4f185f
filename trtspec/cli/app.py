"""The `trtspec` command group and what its commands share: error printing, renamed options' old spellings,
and the options several commands take."""

from __future__ import annotations

import atexit
import os
import sys

import click
from rich.console import Console
from rich.markup import escape

from trtspec import __version__
from trtspec.errors import TrtspecError
from trtspec.interfaces import SPECULATION_METHODS

console = Console(stderr=True)

URL_ENV = "TRTSPEC_URL"  # the server address of every client command, unless --url (or --triton-url) is given


def _fail(exc: Exception) -> None:
    console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    sys.exit(2)


class _Command(click.Command):
    """A command whose renamed options still answer to their old spellings: hidden from --help, with a one-line
    note on stderr, so that scripts written for the old names keep working. `renamed` maps old -> new."""

    def __init__(self, *args, renamed: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.renamed = renamed or {}

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _rename_options(ctx, self, args) if self.renamed else args)


def _rename_options(ctx: click.Context, command: _Command, args: list[str]) -> list[str]:
    """`args` with each old option name (alone or as `--old=value`) replaced by its new one. An option's value is
    never renamed, even when it reads like an old name, and nothing after `--` is."""
    takes_value = {
        name for p in command.params if isinstance(p, click.Option) and not p.is_flag and not p.count for name in p.opts
    }
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            out += args[i:]
            break
        name, eq, value = arg.partition("=")
        if name in command.renamed:
            new = command.renamed[name]
            if not ctx.resilient_parsing:  # (shell completion parses too)
                click.echo(f"warning: {name} is deprecated in `{ctx.command_path}`; use {new}", err=True)
            name, arg = new, new + eq + value
        out.append(arg)
        if name in takes_value and not eq and i + 1 < len(args):
            out.append(args[i + 1])
            i += 1
        i += 1
    return out


class Group(click.Group):
    """Prints trtspec's own errors as messages, not tracebacks; its commands accept renamed options' old names."""

    command_class = _Command

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TrtspecError as exc:
            _fail(exc)


def speculation_option(help: str, *, plain: bool = False):
    """--speculation with the same choices in every command (trtspec.interfaces.SPECULATION_METHODS); `none`
    only where plain decoding is a choice of its own, not where K=0 already is the target alone."""
    choices = [m for m in SPECULATION_METHODS if plain or m != "none"]
    return click.option("--speculation", type=click.Choice(choices), help=help)


def moved_option(old: str, new: str, why: str):
    """A hidden `old` option that refuses any value with an error naming `new`: for an option whose name now means
    something else (a silent rename would read a count as a file, or the reverse)."""

    def refuse(ctx: click.Context, param: click.Parameter, value) -> None:
        if value is not None:
            raise click.UsageError(f"{old} {value}: {why}; give {new} {value}", ctx=ctx)

    return click.option(old, hidden=True, expose_value=False, callback=refuse)


@click.group(cls=Group)
@click.version_option(__version__, prog_name="trtspec")
def cli() -> None:
    """Speculative decoding on Triton: build engines, deploy, serve, validate and measure.

    \b
    Examples:
      trtspec build -c build_configs/demo.yaml
      trtspec deploy -c build_configs/demo.yaml --repo model_repository
      trtspec serve --repo model_repository
      trtspec generate "Explain KV-cache reuse." --stream
    """


def report_problems(what: str, problems: list) -> None:
    """Print every problem and exit 1 when there is any."""
    if not problems:
        return
    console.print(
        f"[bold red]{escape(what)}: {len(problems)} problem{'s' if len(problems) != 1 else ''}[/]",
        highlight=False,
        soft_wrap=True,
    )
    for problem in problems:
        console.print(f"  - {escape(str(problem))}", highlight=False, soft_wrap=True)
    sys.exit(1)


PROTOCOL_OPTION = click.option("--protocol", type=click.Choice(["http", "grpc"]), default="http", show_default=True)

URL_OPTION = click.option(
    "--url",
    envvar=URL_ENV,
    show_envvar=True,
    help=f"host:port of the server [default: ${URL_ENV}, else 127.0.0.1:8000 for http, 127.0.0.1:8001 for grpc].",
)


_stopped_serving = False  # set by a command that served in the foreground, once it stopped all it started


def stopped_serving() -> None:
    """Called by `serve` and `openai` once everything they started is stopped (sockets closed, Triton gone)."""
    global _stopped_serving
    _stopped_serving = True


def main() -> None:
    try:
        cli(prog_name="trtspec")
    except SystemExit as exc:
        if not _stopped_serving:
            raise
        # A server command that has stopped everything it started leaves without the interpreter's teardown: with
        # torch loaded (transformers' tokenizers import it) tearing the modules down took 3-7 s after Ctrl-C on a
        # loaded 2-core machine, with every socket already closed, and a supervisor (or a test) that waits 20 s for
        # the process saw it hang. atexit's handlers still run, and the streams are flushed.
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
