"""What the benchmark scripts share. A script beside this file imports it by name (`from common import ...`): run as
`python benchmarks/NAME.py`, its own folder is first on the path."""

from __future__ import annotations

import argparse

PROMPTS_MOVED = "in trtspec --prompts names a prompt source (a file or spec), not a count"


class _PromptsMoved(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"--prompts {values}: {PROMPTS_MOVED}; give --num-prompts {values}")


def add_num_prompts(parser: argparse.ArgumentParser, default: int, help: str) -> None:
    """--num-prompts N, and a hidden --prompts that refuses a count with an error naming --num-prompts (as the
    trtspec commands do)."""
    parser.add_argument("--num-prompts", type=int, default=default, help=help)
    parser.add_argument("--prompts", action=_PromptsMoved, help=argparse.SUPPRESS)
