"""Commands that check a deployment and talk to it: validate repo|monitoring|engines|outputs, generate."""

from __future__ import annotations

import sys

import click
from rich.markup import escape

from trtspec.cli.app import PROTOCOL_OPTION, URL_OPTION, Group, cli, console, report_problems, speculation_option


@cli.group(cls=Group)
def validate() -> None:
    """Check a model repository, engines or outputs.

    \b
    Examples:
      trtspec validate repo model_repository
      trtspec validate engines --target engines/demo/target --draft engines/demo/draft
      trtspec validate outputs --ks 1,4,8
    """


@validate.command("repo")
@click.argument("path", type=click.Path())
def validate_repo(path: str) -> None:
    """Check a model repository: models, tensors against the contract, ensemble wiring, parameters.

    \b
    Examples:
      trtspec validate repo model_repository
      trtspec validate repo demo-output/model_repository
    """
    from trtspec.deploy.checks import validate_repository

    report_problems(f"repository {path}", validate_repository(path))
    console.print(f"[green]ok[/]: {escape(path)}", highlight=False, soft_wrap=True)


@validate.command("monitoring")
@click.argument("path", type=click.Path(file_okay=False))
def validate_monitoring(path: str) -> None:
    """Check that the monitoring files in PATH (rules, dashboard, Alertmanager example) are what this trtspec writes.

    \b
    Examples:
      trtspec validate monitoring monitoring
      trtspec validate monitoring k8s/monitoring
    """
    from trtspec.deploy.monitoring import stale_monitoring

    stale = stale_monitoring(path)
    if stale:
        console.print(
            f"[red]stale[/]: {escape(', '.join(stale))} in {escape(path)} differ from what this trtspec "
            f"writes; regenerate them: trtspec deploy ... --monitoring {escape(path)}",
            highlight=False,
            soft_wrap=True,
        )
        raise SystemExit(1)
    console.print(f"[green]ok[/]: {escape(path)}", highlight=False, soft_wrap=True)


@validate.command("engines")
@click.option("--target", required=True, type=click.Path(file_okay=False), help="Target engine dir.")
@click.option("--draft", type=click.Path(file_okay=False), help="Draft engine dir.")
@click.option(
    "--num-draft-tokens", type=click.IntRange(min=1), help="Draft length K the target must verify [default: 1]."
)
@click.option(
    "--use-draft-logits",
    is_flag=True,
    help="Draft logits will be used: both engines gather generation logits, equal vocabs.",
)
@click.option(
    "-c",
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="Also check the quantization this build config asks for.",
)
def validate_engines_cmd(target, draft, num_draft_tokens, use_draft_logits, config_path) -> None:
    """Check a target (and draft) engine dir without loading them: layout, ranks, speculative decoding, KV cache,
    FP8, version.

    \b
    Examples:
      trtspec validate engines --target engines/demo/target
      trtspec validate engines --target engines/demo/target --draft engines/demo/draft --num-draft-tokens 4
      trtspec validate engines --target engines/qwen/target -c build_configs/qwen2.5-14b_qwen2.5-0.5b_1xh100.yaml
    """
    from trtspec.engine.validate import expected_from_spec, validate_engines

    expect = {}
    if config_path:
        from trtspec.config import load_config

        loaded = load_config(config_path, plan_only=True)
        expect = {role: expected_from_spec(spec) for role, spec, _ in loaded.models()}
    problems = validate_engines(
        target, draft, num_draft_tokens=num_draft_tokens, use_draft_logits=use_draft_logits, expect=expect
    )
    report_problems("engines", problems)
    console.print(
        f"[green]ok[/]: {escape(target)}" + (f" + {escape(draft)}" if draft else ""), highlight=False, soft_wrap=True
    )


@cli.command()
@click.argument("prompt")
@URL_OPTION
@PROTOCOL_OPTION
@click.option("--model", default="tensorrt_llm_bls", show_default=True, help="The speculative model to ask.")
@click.option("--stream", is_flag=True, help="Print the text as each iteration's tokens arrive.")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--num-draft-tokens",
    type=click.IntRange(min=0),
    help="Draft length K; 0: the target alone [default: the deployment's].",
)
@click.option(
    "--temperature",
    type=float,
    help="Sampling temperature; 0 (the default) is greedy. With neither --top-k "
    "nor --top-p it samples from the whole distribution (top_p 1.0: TensorRT-LLM reads top_k 0 with top_p 0 as "
    "greedy).",
)
@click.option("--top-k", type=click.IntRange(min=0))
@click.option("--top-p", type=click.FloatRange(0.0, 1.0))
@click.option("--seed", type=click.IntRange(min=0))
@click.option("--timeout", default=600.0, show_default=True, help="Seconds the request may take.")
def generate(
    prompt, url, protocol, model, stream, max_tokens, num_draft_tokens, temperature, top_k, top_p, seed, timeout
) -> None:
    """Generate from PROMPT with the speculative model; text to stdout, statistics to stderr.

    \b
    Examples:
      trtspec generate "Explain KV-cache reuse." --stream
      trtspec generate "Write a haiku about GPUs." --num-draft-tokens 0
      trtspec generate "def fib(n):" --url 127.0.0.1:8001 --protocol grpc --temperature 0.7 --seed 1
      TRTSPEC_URL=gpu-host:8000 trtspec generate "Summarize speculative decoding." --max-tokens 128
    """
    if temperature and top_k is None and top_p is None:
        top_p = 1.0
    from trtspec.client import SpecClient

    def show(chunk) -> None:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()

    with SpecClient(url, protocol=protocol, model=model, timeout=timeout) as client:
        result = client.generate(
            prompt,
            max_tokens=max_tokens,
            num_draft_tokens=num_draft_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            stream=stream,
            on_chunk=show if stream else None,
        )
    if not stream:
        sys.stdout.write(result.text)
    sys.stdout.write("\n")
    sys.stdout.flush()
    _print_completion(result)


def _print_completion(result) -> None:
    from rich.table import Table

    table = Table(show_header=False, box=None, padding=(0, 2))
    rows = [("tokens", f"{len(result.token_ids)} ({result.finish_reason or '?'})")]
    if result.draft_tokens is not None:
        acceptance = f"{result.acceptance_rate:.1%}" if result.draft_tokens else "-"
        rows.append(("acceptance", f"{acceptance} ({result.accepted_draft_tokens}/{result.draft_tokens} draft tokens)"))
        if result.drafted_per_position:
            rows.append(("by position", "  ".join(f"{p:.0%}" for p in result.position_acceptance())))
        per_iteration = f" ({result.tokens_per_iteration:.2f} tokens each)" if result.tokens_per_iteration else ""
        rows.append(("iterations", f"{result.iterations}{per_iteration}"))
        rows.append(("draft / verify", f"{result.draft_ms:.0f} ms / {result.verify_ms:.0f} ms"))
    if result.time_to_first_token is not None:
        rows.append(("first token", f"{result.time_to_first_token * 1e3:.0f} ms"))
    rows.append(("total", f"{result.seconds:.2f} s, {result.tokens_per_second:.1f} tokens/s"))
    for name, value in rows:
        table.add_row(f"[bold]{name}[/]", escape(value))
    console.print(table)


@validate.command("outputs", renamed={"--num-draft-tokens": "--ks"})
@URL_OPTION
@PROTOCOL_OPTION
@click.option("--model", default="tensorrt_llm_bls", show_default=True, help="The speculative model.")
@click.option(
    "--engine-model",
    default="tensorrt_llm",
    show_default=True,
    help="The target engine model (asked for logits at a difference).",
)
@click.option(
    "--prompts",
    "prompts_file",
    type=click.Path(dir_okay=False, exists=True),
    help='JSONL with {"prompt": ...} per line, or one prompt per line [default: 8 built-in prompts].',
)
@click.option(
    "--ks",
    metavar="K,...",
    help="Draft lengths K to check, e.g. 1,4,8 [default: 1,4,8 up to the deployment's max_draft_len].",
)
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--tokenizer",
    "tokenizer_dir",
    type=click.Path(file_okay=False, exists=True),
    metavar="DIR",
    help="The target's tokenizer on this machine (e.g. the target engine dir), for the prompt ids [default: "
    "the deployment's preprocessing model].",
)
@click.option(
    "--tie-tolerance",
    default=1e-2,
    show_default=True,
    type=click.FloatRange(min=0.0),
    help="A difference is a near-tie when the logit gap <= this x max(1, max |logit|).",
)
@click.option("--allow-near-ties", is_flag=True, help="Pass when the only differences are near-ties.")
@speculation_option("Draft source of the speculative requests [default: the deployment's].")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds each request may take.")
def validate_outputs(
    url,
    protocol,
    model,
    engine_model,
    prompts_file,
    ks,
    max_tokens,
    tokenizer_dir,
    tie_tolerance,
    allow_near_ties,
    speculation,
    timeout,
) -> None:
    """Check that speculative greedy outputs are the target's own, token for token.

    \b
    Examples:
      trtspec validate outputs
      trtspec validate outputs --url 127.0.0.1:8001 --protocol grpc --ks 1,4,8 --max-tokens 48
      trtspec validate outputs --speculation prompt_lookup --ks 8 --max-tokens 64
      trtspec validate outputs --prompts prompts.jsonl --tokenizer engines/demo/target --allow-near-ties
    """
    from trtspec.client import SpecClient
    from trtspec.validate import (
        DEFAULT_KS,
        DEFAULT_PROMPTS,
        Tokens,
        deployment_max_draft_len,
        load_prompts,
        parse_ks,
        render_report,
        run_validation,
    )

    prompts = load_prompts(prompts_file) if prompts_file else list(DEFAULT_PROMPTS)
    with SpecClient(url, protocol=protocol, model=model, timeout=timeout) as client:
        skipped = []
        if ks:
            draft_lengths = parse_ks(ks)
        else:
            limit = deployment_max_draft_len(client)
            draft_lengths = [k for k in DEFAULT_KS if limit is None or k <= limit]
            skipped = [k for k in DEFAULT_KS if k not in draft_lengths]
            if limit and limit not in draft_lengths and limit > max(draft_lengths, default=0):
                draft_lengths.append(limit)
            if not draft_lengths:
                raise click.UsageError(f"the deployment's max_draft_len is {limit}: there is no draft length to check")
        tokens = Tokens(client, tokenizer_dir)
        console.print(
            f"{len(prompts)} prompts, K = {', '.join(map(str, draft_lengths))}, {max_tokens} tokens, "
            f"prompt ids from the {tokens.source}",
            highlight=False,
        )
        with console.status("validating…") as status:
            report = run_validation(
                client,
                prompts,
                draft_lengths,
                max_tokens=max_tokens,
                tokens=tokens,
                tolerance=tie_tolerance,
                engine_model=engine_model,
                speculation=speculation,
                progress=lambda msg: status.update(f"validating: {msg}"),
            )
        report.skipped_ks = skipped
    render_report(report, console, allow_near_ties=allow_near_ties)
    sys.exit(0 if report.passed(allow_near_ties) else 1)
