"""The command line's own surface: renamed options and their old spellings, the server address from the
environment, the same --speculation choices everywhere, examples in every --help, errors without tracebacks,
and docs/cli.md as the commands' --help renders it."""

from __future__ import annotations

import click
import pytest
from click.core import ParameterSource
from click.testing import CliRunner

from trtspec.cli import cli
from trtspec.cli.docs import DOC, REGENERATE, render
from trtspec.errors import TrtspecError
from trtspec.interfaces import SPECULATION_METHODS


def _all_commands():
    """(command path, command) of every command and subcommand."""

    def walk(path, command):
        yield path, command
        if isinstance(command, click.Group):
            for name, sub in sorted(command.commands.items()):
                yield from walk(f"{path} {name}", sub)

    return list(walk("trtspec", cli))


def _parse(path: str, args: list[str]) -> click.Context:
    """The context `trtspec <path> <args>` would run with, without running it."""
    ctx, group = click.Context(cli, info_name="trtspec"), cli
    *groups, name = path.split()
    for sub in groups:
        group = group.commands[sub]
        ctx = click.Context(group, info_name=sub, parent=ctx)
    return group.commands[name].make_context(name, list(args), parent=ctx)


def test_cli_md_is_current():
    assert DOC.read_text() == render(), f"docs/cli.md is not current: regenerate it with `{REGENERATE}`"


@pytest.mark.parametrize(
    "path, old, new, param, value",
    [
        ("bench", "--num-draft-tokens", "--ks", "ks", "0,4"),
        ("bench", "--tokenizer", "--chat-template", "tokenizer_dir", "."),
        ("validate outputs", "--num-draft-tokens", "--ks", "ks", "1,4,8"),
    ],
)
def test_old_option_names_still_work(capsys, path, old, new, param, value):
    for args in ([old, value], [f"{old}={value}"]):
        ctx = _parse(path, args)
        assert ctx.params[param] == value and ctx.get_parameter_source(param) is ParameterSource.COMMANDLINE
        note = capsys.readouterr().err
        assert note == f"warning: {old} is deprecated in `trtspec {path}`; use {new}\n"
    assert _parse(path, [new, value]).params[param] == value and capsys.readouterr().err == ""
    help_text = CliRunner().invoke(cli, [*path.split(), "--help"]).output
    assert new in help_text and f"{old} " not in help_text  # the old name is hidden


def test_only_option_names_are_renamed(capsys):
    ctx = _parse("bench", ["--model", "--tokenizer", "--output", "--num-draft-tokens"])
    assert ctx.params["model"] == "--tokenizer" and ctx.params["output"] == "--num-draft-tokens"
    assert capsys.readouterr().err == ""


def test_an_old_name_reaches_the_command(tmp_path):
    result = CliRunner().invoke(cli, ["validate", "outputs", "--url", "127.0.0.1:1", "--num-draft-tokens", "0"])
    assert result.exit_code == 2
    assert (
        "--num-draft-tokens is deprecated" in result.output and "--ks: '0' is not a positive integer" in result.output
    )


@pytest.mark.parametrize(
    "path, param", [("generate", "url"), ("validate outputs", "url"), ("bench", "url"), ("openai", "triton_url")]
)
def test_server_address_from_the_environment(monkeypatch, path, param):
    args = ["hi"] if path == "generate" else []
    monkeypatch.setenv("TRTSPEC_URL", "gpu-host:8000")
    assert _parse(path, args).params[param] == "gpu-host:8000"
    assert _parse(path, [*args, f"--{param.replace('_', '-')}", "other:1"]).params[param] == "other:1"
    assert "TRTSPEC_URL" in CliRunner().invoke(cli, [*path.split(), "--help"]).output


def test_speculation_offers_the_same_choices_everywhere():
    found = {}
    for path, command in _all_commands():
        for param in command.params:
            if param.name == "speculation":
                found[path] = list(param.type.choices)
    assert set(found) == {"trtspec deploy", "trtspec bench", "trtspec validate outputs"}
    assert found.pop("trtspec deploy") == list(SPECULATION_METHODS)  # none: plain decoding by default
    # elsewhere K=0 is the target alone already
    assert all(choices == [m for m in SPECULATION_METHODS if m != "none"] for choices in found.values())


def test_every_command_shows_examples():
    for path, _command in _all_commands():
        text = CliRunner().invoke(cli, [*path.split()[1:], "--help"], terminal_width=80).output
        assert "Examples:" in text, path
        examples = text.split("Examples:")[1].split("\n\n")[0].strip().splitlines()
        assert 2 <= len(examples) <= 4, path
        for line in examples:
            assert line.strip().startswith(("trtspec ", "TRTSPEC_URL=")), line
            assert f" {path.split()[-1]}" in line or path == "trtspec", (path, line)


def test_server_errors_are_trtspec_errors(monkeypatch, tmp_path):
    from trtspec import server

    assert issubclass(server.ServerError, TrtspecError) and issubclass(server.ServerError, RuntimeError)

    def fails(*args, **kwargs):
        raise server.ServerError("no tritonserver found; give --tritonserver")

    monkeypatch.setattr(server, "TritonServer", fails)
    result = CliRunner().invoke(cli, ["serve", "--repo", str(tmp_path)])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit)  # printed, no traceback
    assert "error: no tritonserver found; give --tritonserver" in result.output


@pytest.mark.server  # TritonServer.start runs, and refuses before it launches anything
@pytest.mark.parametrize("front", [False, True], ids=["triton", "with-openai-front"])
def test_a_server_that_cannot_start_fails_like_every_trtspec_error(tmp_path, front):
    import socket

    from trtspec.server import free_port

    front = ["--openai-port", str(free_port())] if front else []

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(cli, ["serve", "--repo", str(tmp_path), "--http-port", str(port), *front])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "error:" in result.stderr and str(port) in result.stderr
