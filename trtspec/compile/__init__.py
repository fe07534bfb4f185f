"""`trtspec build`: compiles the draft and target checkpoints into engines, one module per backend; this entry
point loads the config and shows progress. (Named for what it does: a package called build/ is skipped by every
tool and ignore list that takes it for a build output.)"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from trtspec.config import LoadedConfig, load_config
from trtspec.errors import TrtspecError


def default_output(loaded: LoadedConfig) -> Path:
    return Path("engines") / loaded.config.name


def run_build(
    config_path: str | Path, output: Path | None, *, dry_run: bool = False, console: Console | None = None
) -> Path:
    """Build every engine of the config that is not already built from the same inputs; returns the output dir."""
    console = console or Console(stderr=True)
    loaded = load_config(config_path, plan_only=dry_run)
    output = (output or default_output(loaded)).resolve()
    if loaded.config.backend == "trtllm":
        from trtspec.compile import trtllm

        return trtllm.run(loaded, output, dry_run=dry_run, console=console)
    from trtspec.compile import torch as backend

    builds = backend.plan(loaded, output)
    table = Table(title=f"build plan: {loaded.config.name} ({loaded.config.backend})")
    for col in ("role", "checkpoint", "architecture", "output", "action"):
        table.add_column(col)
    for b in builds:
        table.add_row(
            b.role,
            escape(str(b.info.path)),
            b.info.architecture,
            escape(str(b.output)),
            "skip (up to date)" if b.up_to_date else "build",
        )
    console.print(table)
    if dry_run:
        for b in builds:
            console.print(f"  {b.describe()}", highlight=False, markup=False)  # "[dtype, quant]" is not markup
        console.print("dry run: nothing written")
        return output

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        for b in builds:
            if b.up_to_date:
                continue
            task = progress.add_task(f"{b.role}: starting", total=None)
            start = time.perf_counter()
            backend.build_model(b, loaded.config, progress=lambda text, t=task: progress.update(t, description=text))
            progress.update(
                task, description=f"{b.role}: built in {time.perf_counter() - start:.1f}s", completed=1, total=1
            )
    _validate_built(loaded, output)
    console.print(f"engines in {output}")
    return output


def _validate_built(loaded: LoadedConfig, output: Path) -> None:
    """The engine checks of `trtspec validate engines` on what was just built."""
    from trtspec.engine.validate import expected_from_spec, validate_engines

    config = loaded.config
    draft = output / "draft" if config.draft is not None else None
    problems = validate_engines(
        output / "target",
        draft,
        num_draft_tokens=config.speculation.num_draft_tokens,
        use_draft_logits=config.speculation.use_draft_logits and draft is not None,
        expect={role: expected_from_spec(spec) for role, spec, _ in loaded.models()},
        runtime_version=None,
    )
    if problems:
        raise TrtspecError("the built engines fail validation:\n" + "\n".join(f"  - {p}" for p in problems))
