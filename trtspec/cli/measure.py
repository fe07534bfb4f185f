"""`trtspec bench`: speculative decoding against target-only on a running deployment, and Spec-Bench."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
from rich.markup import escape

from trtspec.cli.app import PROTOCOL_OPTION, URL_OPTION, cli, console, speculation_option


@cli.command(renamed={"--num-draft-tokens": "--ks", "--tokenizer": "--chat-template"})
@URL_OPTION
@PROTOCOL_OPTION
@click.option("--model", default="tensorrt_llm_bls", show_default=True, help="The speculative model to measure.")
@click.option(
    "--prompts",
    "prompts_source",
    default="builtin:chat",
    show_default=True,
    help="builtin:chat, builtin:code-edit, builtin:summarize, builtin:random (random tokens of "
    "--chat-template's tokenizer), "
    'a JSONL file with {"prompt": ...} per line, or spec-bench:PATH (Spec-Bench\'s question.jsonl: '
    "each draft source against target-only, per task).",
)
@click.option(
    "--per-task", type=click.IntRange(min=1), help="spec-bench: the first N questions of each task [default: all]."
)
@click.option(
    "--chat-template",
    "tokenizer_dir",
    type=click.Path(file_okay=False, exists=True),
    metavar="DIR",
    help="Send each prompt in the chat template of the tokenizer in DIR (the target engine dir holds the "
    "target's) [default: as written; spec-bench: the deployment's tokenizer_dir].",
)
@click.option(
    "--concurrency", "concurrencies", default="1,4,8", show_default=True, help="Requests in flight, e.g. 1,4,8."
)
@click.option(
    "--ks",
    default="0,2,4,6,8",
    show_default=True,
    metavar="K,...",
    help="Draft lengths K; 0, the target-only baseline, is always measured.",
)
@click.option(
    "--draft-length",
    type=click.Choice(["fixed", "adaptive", "both"]),
    default="fixed",
    show_default=True,
    help="K > 0 cells keep K fixed, let the deployment's adaptive draft length choose up to K, or both side by side.",
)
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--requests",
    default=8,
    show_default=True,
    type=click.IntRange(min=1),
    help="Requests per cell (rounded up to a multiple of the concurrency).",
)
@click.option(
    "--stream", is_flag=True, help="Stream the responses (needed for time to first token and inter-token latency)."
)
@speculation_option("Draft source of the K > 0 cells (the K=0 cells are the target alone) [default: the deployment's].")
@click.option(
    "--reuse-prompts",
    is_flag=True,
    help="Send prompts as written, without a request number: repeats hit the engines' prefix KV cache.",
)
@click.option(
    "--prediction",
    type=click.Choice(["original", "unrelated"]),
    help="Send each prompt's quoted code as its predicted output (OpenAI's Predicted Outputs) in the K > 0 cells: "
    "original, the code being edited; unrelated, another prompt's.",
)
@click.option("--seed", default=0, show_default=True, help="Seed of the interleaving order.")
@click.option(
    "--output", type=click.Path(dir_okay=False), default="bench-report.json", show_default=True, help="The JSON report."
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    help="Also write a PNG: speedup vs K per concurrency, acceptance per position.",
)
@click.option(
    "--apply",
    "apply_repo",
    type=click.Path(file_okay=False, exists=True),
    help="Write the best K, the speculation limit and the cost model into this deployed repository's BLS config, "
    "and measure the engines' costs again (the calibration `trtspec serve` made; over gRPC: --url with --protocol "
    "grpc, else the HTTP port + 1).",
)
@click.option("--timeout", default=600.0, show_default=True, help="Seconds each request may take.")
def bench(
    url,
    protocol,
    model,
    prompts_source,
    per_task,
    tokenizer_dir,
    concurrencies,
    ks,
    draft_length,
    max_tokens,
    requests,
    stream,
    speculation,
    reuse_prompts,
    prediction,
    seed,
    output,
    plot,
    apply_repo,
    timeout,
) -> None:
    """Measure latency, throughput, acceptance and speedup for every (concurrency, K), interleaved, against K=0;
    with spec-bench:PATH, each draft source against target-only on Spec-Bench's tasks.

    \b
    Examples:
      trtspec bench --chat-template engines/demo/target
      trtspec bench --url 127.0.0.1:8001 --protocol grpc --concurrency 1,4 --ks 0,2,4,8 --stream --plot bench.png
      trtspec bench --prompts builtin:code-edit --speculation prompt_lookup --ks 0,8 --apply model_repository
      trtspec bench --prompts spec-bench:question.jsonl --per-task 10 --chat-template engines/demo/target
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from trtspec import bench as b
    from trtspec.client import SpecClient
    from trtspec.validate import deployment_max_draft_len

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    common = dict(  # the settings of either kind of run
        url=url,
        protocol=protocol,
        model=model,
        prompts_source=prompts_source,
        tokenizer=tokenizer_dir,
        concurrencies=tuple(b.parse_int_list(concurrencies, "--concurrency", minimum=1)),
        max_tokens=max_tokens,
        stream=stream,
        numbered=not reuse_prompts,
        seed=seed,
        timeout=timeout,
    )
    if prompts_source.startswith("spec-bench:"):
        ctx = click.get_current_context()
        given = {name for name in ("ks", "draft_length") if ctx.get_parameter_source(name).name != "DEFAULT"}
        for name in ("apply_repo", "plot", "prediction"):
            if ctx.params[name]:
                raise click.UsageError(
                    f"--{name.split('_')[0]}: not with spec-bench (it measures draft sources, not K)"
                )
        settings = b.BenchSettings(**common)
        with Progress(*columns, console=console, transient=True) as progress:
            report = _spec_bench(
                settings,
                per_task=per_task,
                speculation=speculation,
                progress=progress,
                ks=b.parse_int_list(ks, "--ks", minimum=1) if "ks" in given else None,
                adaptive=draft_length != "fixed" if "draft_length" in given else None,
                command=b.command_line(ctx),
            )
        from trtspec.bench.specbench import render as render_spec_bench

        render_spec_bench(report, b.table_console())
        console.print(f"report: {escape(str(b.write_report(report, output)))}", highlight=False)
        return

    draft_lengths = b.parse_int_list(ks, "--ks", minimum=0)
    if 0 not in draft_lengths:
        draft_lengths.insert(0, 0)
    with SpecClient(url, protocol=protocol, model=model, timeout=timeout) as client:
        limit = deployment_max_draft_len(client)
    if limit is not None:
        skipped = [k for k in draft_lengths if k > limit]
        draft_lengths = [k for k in draft_lengths if k <= limit]
        if skipped:
            console.print(f"skipping K={','.join(map(str, skipped))}: above the deployment's max_draft_len {limit}")
    settings = b.BenchSettings(
        **common, ks=tuple(draft_lengths), draft_length=draft_length, requests=requests, speculation=speculation
    )
    prompts = b.Prompts(
        b.load_prompt_set(prompts_source, tokenizer_dir),
        tokenizer_dir=tokenizer_dir,
        numbered=not reuse_prompts,
        prediction=prediction,
    )
    console.print(
        f"{len(prompts)} prompts from {escape(prompts_source)}, C = {', '.join(map(str, settings.concurrencies))}, "
        f"K = {', '.join(map(str, settings.ks))} ({draft_length}), {max_tokens} tokens, {requests} requests per cell, "
        "interleaved",
        highlight=False,
    )
    with Progress(*columns, console=console, transient=True) as progress:
        report = b.run_bench(settings, prompts, progress=progress, command=b.command_line(click.get_current_context()))
    b.render(report, b.table_console())
    console.print(f"report: {escape(str(b.write_report(report, output)))}", highlight=False)
    if plot:
        console.print(f"plot: {escape(str(b.write_plot(report, plot)))}", highlight=False)
    if apply_repo:
        _apply_bench_tuning(apply_repo, report["tuning"])
        from trtspec.bench.calibrate import refresh

        refresh(apply_repo, url, protocol, console)  # the engines' costs too, which the running BLS reads at once


def _spec_bench(settings, *, per_task, speculation, ks, adaptive, progress, command) -> dict:
    """Spec-Bench through the deployment: its questions in the target's chat template, each draft source the
    deployment has (with its own K and adaptive policy unless given) against target-only."""
    from trtspec.bench import Prompts
    from trtspec.bench import specbench as sb
    from trtspec.client import SpecClient
    from trtspec.serving_settings import ServingSettings

    with SpecClient(settings.url, protocol=settings.protocol, model=settings.model, timeout=settings.timeout) as client:
        params = {
            k: v.get("string_value", "") for k, v in client.model_config(settings.model).get("parameters", {}).items()
        }
        tokenizer = settings.tokenizer or params.get("tokenizer_dir")
        if not tokenizer or not Path(tokenizer).is_dir():
            raise click.UsageError(
                "--chat-template: spec-bench sends each question in the target's chat template; "
                "give the target engine dir (the deployment's tokenizer_dir is not on this machine)"
            )
        questions = sb.select(sb.load_questions(settings.prompts_source[len(sb.PREFIX) :]), per_task)
        prompts = Prompts([q.text for q in questions], tokenizer_dir=tokenizer, numbered=settings.numbered)
        limit = params.get("max_input_len", "")
        kept, skipped = sb.fit(
            questions,
            prompts,
            lambda text: len(prompts.tokenizer(text)["input_ids"]),
            int(limit) if limit.isdigit() else None,
        )
    if not kept:
        raise click.UsageError(f"--prompts: every question is longer than the deployment's max_input_len {limit}")
    methods = [m for m in sb.METHODS if m in ("none", speculation or m)]
    if not params.get("tensorrt_llm_draft_model_name"):  # (auto without a draft model is prompt lookup alone)
        methods = [m for m in methods if m != "draft_model"]
    served = ServingSettings.from_parameters(params)
    k = max(ks) if ks else None  # None: each method at the deployment's draft length for it
    adaptive = adaptive if adaptive is not None else served.adaptive_draft_length
    console.print(
        f"Spec-Bench: {len(kept)} questions ({sum(skipped.values())} longer than max_input_len skipped), "
        f"C = {', '.join(map(str, settings.concurrencies))}, {', '.join(methods)}, {sb.k_text(k)}"
        f"{' adaptive' if adaptive else ''}, {settings.max_tokens} tokens, interleaved",
        highlight=False,
    )
    prompts.texts = [q.text for q in kept]  # the same tokenizer, the questions that fit
    settings = dataclasses.replace(settings, tokenizer=tokenizer)
    return sb.run_spec_bench(
        settings,
        kept,
        prompts,
        methods=tuple(methods),
        k=k,
        adaptive=adaptive,
        skipped=skipped,
        progress=progress,
        command=command,
    )


def _apply_bench_tuning(repo: str, tuning: dict) -> None:
    from trtspec.bench import BLS_MODEL, apply_tuning

    applied = apply_tuning(repo, tuning)
    where = f"{repo}/{BLS_MODEL}/config.pbtxt"
    if not applied.changes:
        console.print(f"{escape(where)} already holds the measured settings; nothing changed", highlight=False)
        return
    console.print(f"[bold]{escape(where)}[/] updated (the repository still validates):", highlight=False)
    for change in applied.changes:
        old = "(not set)" if change.old is None else change.old
        console.print(f"  {change.parameter}: {escape(old)} -> {escape(change.new)}", highlight=False)
    for problem in applied.problems:
        console.print(f"  [yellow]already there before the edit:[/] {escape(str(problem))}", highlight=False)
    console.print(
        "A running server keeps the config it loaded: restart `trtspec serve`, or, on a server started with "
        f"--model-control-mode explicit, reload the model: POST /v2/repository/models/{BLS_MODEL}/load",
        highlight=False,
        soft_wrap=True,
    )
