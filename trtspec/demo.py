"""`trtspec demo`: the whole path on the embedded default, end to end, leaving nothing running.

build the demo pair -> deploy a model repository -> serve it with tritonserver -> stream two answers -> measure two
workloads side by side with target-only (`trtspec bench`'s interleaved runs) -> check that greedy outputs are the
target's own (`trtspec validate`'s comparison) -> one table, with a sentence per row on why speculation paid or not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from trtspec.compile import run_build
from trtspec.config import load_config
from trtspec.repository import write_repository
from trtspec.server import TritonServer, free_port


@dataclass(frozen=True)
class Workload:
    """What one row (or two) of the demo's table measures: a prompt set and the concurrencies, speculated as a
    request that names no speculation field is: the deployment's draft source and K, the adaptive draft length."""

    name: str
    prompts: str  # a `trtspec bench` prompt set
    speculation: str  # the deployment's default draft source
    k: int  # the deployment's default K (auto: the draft model's; prompt lookup drafts up to max_draft_len)
    max_tokens: int
    concurrencies: tuple[int, ...] = (1,)
    requests: int = 4  # per cell
    checked: int = 2  # prompts whose greedy outputs are compared token by token


def workloads(config, *, max_tokens: int, num_draft_tokens: int | None) -> list[Workload]:
    """Chat (at concurrency 1 and 4), and code editing, whose answers copy long runs of the prompt: both with the
    deployment's defaults, as a client that names no speculation field gets them."""
    spec = config.speculation
    k = num_draft_tokens or spec.num_draft_tokens
    return [
        Workload("chat", "builtin:chat", spec.method, k, max_tokens, (1, 4)),
        Workload("code editing", "builtin:code-edit", spec.method, k, 2 * max_tokens),
    ]


def run_demo(config_path: str, workdir: Path, *, max_tokens: int = 64, num_draft_tokens: int | None = None) -> int:
    from trtspec.bench import Prompts, load_prompt_set
    from trtspec.client import SpecClient

    console = Console()
    loaded = load_config(config_path)
    config = loaded.config
    workdir = workdir.resolve()
    engines = run_build(config_path, workdir / "engines", console=console)
    repo = write_repository(loaded, engines, workdir / "model_repository", force=True)
    console.print(f"model repository in {repo}")
    self_draft = config.draft is not None and config.draft.checkpoint == config.target.checkpoint
    plan = workloads(config, max_tokens=max_tokens, num_draft_tokens=num_draft_tokens)

    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    with console.status("starting tritonserver (loads both engines)…"):
        server.start()
    try:
        # each workload's prompts in the target's chat template; numbered only where the bench numbers them
        prompts = {w.name: Prompts(load_prompt_set(w.prompts), tokenizer_dir=engines / "target") for w in plan}
        with SpecClient(server.grpc_url, protocol="grpc") as client:
            for w in plan:
                _stream_one(console, client, w, prompts[w.name])
        rows, checks = [], []
        for w in plan:
            rows_w, check = _measure(console, server.grpc_url, w, prompts[w.name], engines / "target")
            rows += rows_w
            checks.append(check)
    finally:
        server.stop()
    return _summary(console, rows, checks, self_draft, workdir)


def _stream_one(console: Console, client, w: Workload, prompts) -> None:
    question = prompts.texts[0].splitlines()[0]
    console.rule(f"[bold]{w.name}, the deployment's defaults ({w.speculation}, adaptive): {question}", characters="─")
    client.generate(
        prompts.text(0),
        max_tokens=w.max_tokens // 2,
        stream=True,
        on_chunk=lambda c: console.print(c.text, end="", markup=False, highlight=False),
    )
    console.print()


def _measure(console: Console, url: str, w: Workload, prompts, tokenizer_dir: Path) -> tuple[list[dict], dict]:
    """The workload's interleaved bench run (target-only and K, each concurrency), then the output check (one
    request at a time: it vouches for the rows of concurrency 1)."""
    from trtspec import bench as b
    from trtspec.client import SpecClient
    from trtspec.validate import Tokens, run_validation

    settings = b.BenchSettings(
        url=url,
        protocol="grpc",
        prompts_source=w.prompts,
        tokenizer=str(tokenizer_dir),
        concurrencies=w.concurrencies,
        ks=(0, w.k),
        draft_length="adaptive",
        max_tokens=w.max_tokens,
        requests=w.requests,
        stream=True,
        speculation=w.speculation,
    )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        report = b.run_bench(settings, prompts, progress=progress)
        task = progress.add_task(f"{w.name}: comparing outputs with target-only", total=None)
        with SpecClient(url, protocol="grpc") as client:
            checked = run_validation(
                client,
                [prompts.text(i) for i in range(w.checked)],
                [w.k],
                max_tokens=w.max_tokens,
                speculation=w.speculation,
                fixed_k=False,
                tokens=Tokens(client, tokenizer_dir),
                progress=lambda msg: progress.update(task, description=f"{w.name}: {msg}"),
            )
    result = checked.results[0]
    identical = checked.passed(allow_near_ties=True) and not result.errors
    check = {
        "workload": w.name,
        "prompts": result.runs,
        "identical": result.matches,
        "near_ties": result.near_ties,
        "mismatches": result.mismatches,
        "errors": checked.errors + result.errors,
        "differences": [
            f"prompt {d.prompt_index + 1}, token {d.position}: target-only {d.expected_text!r}, "
            f"speculative {d.got_text!r}: {d.kind}"
            for d in result.differences
        ],
    }
    return b.summary_rows(report, w.name, {1: identical}), check


def _summary(console: Console, rows: list[dict], checks: list[dict], self_draft: bool, workdir: Path) -> int:
    from trtspec.bench import render_summary, table_console

    title = "trtspec demo: speculative vs target-only, greedy, streamed" + (
        " (the draft is the target itself)" if self_draft else ""
    )
    render_summary(rows, table_console(), title)
    for check in checks:
        for line in check["differences"] + check["errors"]:
            console.print(f"  {check['workload']}: {line}", markup=False, highlight=False)
    if self_draft:
        console.print(
            "The draft is the target itself: nearly every draft token is accepted, but drafting costs as much "
            "as decoding, so this shows correctness and the orchestration, not a speed-up."
        )
    report = {"rows": rows, "output_checks": checks}
    (workdir / "demo-report.json").write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"report: {workdir / 'demo-report.json'}")
    ok = all(r["identical"] is not False and not r["errors"] for r in rows) and all(not c["errors"] for c in checks)
    return 0 if ok else 1
