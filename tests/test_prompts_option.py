"""`--prompts` means one thing in every command and benchmark script: a prompt source (a file or a spec such as
builtin:chat); a count is `--num-prompts`, and a count given to `--prompts` is refused with an error naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
from click.testing import CliRunner

from trtspec.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def _options(group: click.Group, prefix: tuple[str, ...] = ()):
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        if isinstance(command, click.Group):
            yield from _options(command, (*prefix, name))
        else:
            for param in command.params:
                if isinstance(param, click.Option):
                    yield (*prefix, name), param


def test_every_commands_prompts_is_a_source_and_every_count_is_num_prompts():
    sources, counts = [], []
    for path, option in _options(cli):
        if "--prompts" in option.opts and not option.hidden:
            assert not isinstance(option.type, (click.types.IntParamType, click.IntRange)), path
            sources.append(path)
        if "--num-prompts" in option.opts:
            assert isinstance(option.type, (click.types.IntParamType, click.IntRange)), path
            counts.append(path)
    assert ("bench",) in sources and ("validate", "outputs") in sources
    assert ("distill",) in counts


def test_a_count_given_to_distills_prompts_names_num_prompts(tmp_path):
    result = CliRunner().invoke(cli, ["distill", "--target", "x", "-o", str(tmp_path / "d"), "--prompts", "32"])
    assert result.exit_code == 2
    assert "--num-prompts 32" in result.output and "prompt source" in result.output
    assert not (tmp_path / "d").exists()


def test_the_benchmark_scripts_take_num_prompts_and_refuse_a_count_in_prompts():
    for script in ("predicted_outputs.py", "distill_answers.py", "draft_quantization.py", "streaming.py"):
        path = ROOT / "benchmarks" / script
        refused = subprocess.run([sys.executable, str(path), "--prompts", "4"], capture_output=True, text=True)
        assert refused.returncode == 2, (script, refused.stderr)
        assert "give --num-prompts 4" in refused.stderr, script
        helped = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True)
        assert helped.returncode == 0 and "--num-prompts" in helped.stdout, script
