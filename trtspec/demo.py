"""`trtspec demo`: the whole path on the embedded default, end to end, leaving nothing running.

build the demo pair -> deploy a model repository -> serve it with tritonserver, its engines' costs calibrated as
`trtspec serve` does -> stream two answers -> measure two workloads side by side with target-only (`trtspec bench`'s
interleaved runs) -> check that greedy outputs are the target's own at every concurrency measured (`trtspec
validate`'s comparison, requests sent that many at a time) -> one table, with a sentence per row on why speculation
paid or not. The demo pair's config ships inside the package (trtspec/data/demo.yaml), so it runs from any folder.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from trtspec.compile import run_build
from trtspec.config import load_config
from trtspec.deploy.writer import write_repository
from trtspec.server import TritonServer, free_port, start_timeout_for

DEMO_START_TIMEOUT_S = 900.0


def demo_config() -> Path:
    """The demo pair's build config, shipped inside the package (build_configs/demo.yaml in a checkout links to it)."""
    return Path(str(resources.files("trtspec") / "data" / "demo.yaml"))


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
    prediction: str | None = None  # each prompt's predicted output (trtspec.bench.prompts.PREDICTIONS)


def workloads(config, *, max_tokens: int, num_draft_tokens: int | None) -> list[Workload]:
    """Chat (at concurrency 1 and 4), and code editing, whose answers copy long runs of the prompt: both with the
    deployment's defaults, as a client that names no speculation field gets them."""
    spec = config.speculation
    k = num_draft_tokens or spec.num_draft_tokens
    return [
        Workload("chat", "builtin:chat", spec.method, k, max_tokens, (1, 4)),
        Workload("code editing", "builtin:code-edit", spec.method, k, 2 * max_tokens),
        # the same edits with OpenAI's Predicted Outputs: the code being edited sent as the prediction
        Workload("code editing, predicted", "builtin:code-edit", spec.method, k, 2 * max_tokens, prediction="original"),
    ]


def run_demo(
    config_path: str | None, workdir: Path, *, max_tokens: int = 64, num_draft_tokens: int | None = None
) -> int:
    from trtspec.bench import Prompts, load_prompt_set
    from trtspec.bench.calibrate import calibrate_deployment, calibration_path
    from trtspec.client import SpecClient

    console = Console()
    config_path = str(config_path or demo_config())
    loaded = load_config(config_path)
    config = loaded.config
    workdir = workdir.resolve()
    engines = run_build(config_path, workdir / "engines", console=console)
    repo = write_repository(loaded, engines, workdir / "model_repository", force=True)
    console.print(f"model repository in {repo}")
    self_draft = config.draft is not None and config.draft.checkpoint == config.target.checkpoint
    plan = workloads(config, max_tokens=max_tokens, num_draft_tokens=num_draft_tokens)

    calibration_path(repo).unlink(missing_ok=True)  # measured afresh, as `trtspec serve` does
    server = TritonServer(
        repo,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        calibration_file=calibration_path(repo),
    )
    # the demo's own server: a busy machine may take minutes to load it, and a server that fails says so at once
    with console.status("starting tritonserver (loads both engines)…"):
        server.start(max(DEMO_START_TIMEOUT_S, start_timeout_for(repo)))
    try:
        calibrate_deployment(repo, server.grpc_url, server.inference_headers, console)
        # each workload's prompts in the target's chat template; numbered only where the bench numbers them
        prompts = {
            w.name: Prompts(load_prompt_set(w.prompts), tokenizer_dir=engines / "target", prediction=w.prediction)
            for w in plan
        }
        with SpecClient(server.grpc_url, protocol="grpc") as client:
            for w in plan:
                _stream_one(console, client, w, prompts[w.name])
        rows, checks = [], []
        for w in plan:
            rows_w, checks_w = _measure(console, server.grpc_url, w, prompts[w.name], engines / "target")
            rows += rows_w
            checks += checks_w
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


def _measure(console: Console, url: str, w: Workload, prompts, tokenizer_dir: Path) -> tuple[list[dict], list[dict]]:
    """The workload's interleaved bench run (target-only and K, each concurrency), then the output check at each
    concurrency (its prompts sent that many at a time, target-only and speculative): every row is vouched for."""
    from trtspec import bench as b

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
    identical, checks = {}, []
    with Progress(*columns, console=console, transient=True) as progress:
        report = b.run_bench(settings, prompts, progress=progress)
        for c in w.concurrencies:
            task = progress.add_task(f"{w.name}, C={c}: comparing outputs with target-only", total=None)
            texts = [prompts.text(i % len(prompts)) for i in range(max(w.checked, c))]
            predicted = (
                [prompts.predictions[i % len(prompts)] for i in range(len(texts))] if prompts.predictions else None
            )
            checked = compare_outputs(url, w, texts, tokenizer_dir, concurrency=c, predictions=predicted)
            progress.remove_task(task)
            result = checked.results[0]
            identical[c] = checked.passed(allow_near_ties=True) and not result.errors
            checks.append(
                {
                    "workload": w.name,
                    "concurrency": c,
                    "prompts": result.runs,
                    "identical": result.matches,
                    "near_ties": result.near_ties,
                    "mismatches": result.mismatches,
                    "errors": checked.errors + result.errors,
                    "differences": [
                        f"C={c}, prompt {d.prompt_index + 1}, token {d.position}: target-only {d.expected_text!r}, "
                        f"speculative {d.got_text!r}: {d.kind}"
                        for d in result.differences
                    ],
                }
            )
    return b.summary_rows(report, w.name, identical), checks


def compare_outputs(
    url: str, w: Workload, texts: list[str], tokenizer_dir: Path, *, concurrency: int, predictions=None
):
    """Greedy outputs of `texts`, target-only and with the deployment's defaults, `concurrency` requests at a time
    (so a speculative request shares its passes with others, as in the bench's cells), compared token by token; a
    difference is explained by the target's own logits (trtspec validate's verdicts: near tie or mismatch).
    `predictions`: each text's predicted output, sent with the speculative requests."""
    from trtspec.client import ClientError, SpecClient
    from trtspec.validate import DEFAULT_TIE_TOLERANCE, KResult, Report, Tokens, compare_tokens, explain

    greedy = {"max_tokens": w.max_tokens, "top_k": 1, "return_perf_metrics": True}
    spec_fields = {"num_draft_tokens": w.k} | ({"speculation": w.speculation} if w.speculation else {})
    report = Report(list(texts), w.max_tokens, DEFAULT_TIE_TOLERANCE, [KResult(w.k)])
    result = report.results[0]
    clients = [SpecClient(url, protocol="grpc") for _ in range(concurrency)]
    try:

        def run(fields: dict, predicted: bool = False) -> list:
            out: list = [None] * len(texts)

            def one(slot: int) -> None:
                for i in range(slot, len(texts), concurrency):
                    more = {"prediction": predictions[i]} if predicted and predictions else {}
                    try:
                        out[i] = clients[slot].generate(texts[i], **greedy, **fields, **more)
                    except ClientError as exc:
                        out[i] = exc

            threads = [threading.Thread(target=one, args=(slot,)) for slot in range(concurrency)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return out

        bases, specs = run({"num_draft_tokens": 0}), run(spec_fields, predicted=True)
        tokens = Tokens(clients[0], tokenizer_dir)
        for i, (base, spec) in enumerate(zip(bases, specs)):
            if isinstance(base, Exception):
                report.errors.append(f"prompt {i + 1}, target only: {base}")
                continue
            if isinstance(spec, Exception):
                result.errors.append(f"prompt {i + 1}: {spec}")
                continue
            result.runs += 1
            at = compare_tokens(base.token_ids, spec.token_ids)
            if at is None:
                result.matches += 1
            else:
                result.differences.append(
                    explain(clients[0], tokens, i, texts[i], w.k, base, spec, at, DEFAULT_TIE_TOLERANCE, "tensorrt_llm")
                )
    finally:
        for client in clients:
            client.close()
    return report


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
