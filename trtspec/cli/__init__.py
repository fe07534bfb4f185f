"""The `trtspec` command line: the group and its shared options in app.py, the commands by what they do in
pipeline.py (checkpoints to a deployment), serving.py (serve, openai), check.py (validate, generate), measure.py
(bench) and lifecycle.py (shadow, promote)."""

from __future__ import annotations

from trtspec.cli import check, lifecycle, measure, pipeline, serving  # noqa: F401  (each registers its commands on the group)
from trtspec.cli.app import cli, main

__all__ = ["cli", "main"]
