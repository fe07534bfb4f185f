"""The serving commands: `trtspec serve` (tritonserver on a repository, with the OpenAI front, the control
receiver and capture beside it) and `trtspec openai` (the OpenAI front alone, before a running deployment)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
from rich.console import Console

from trtspec import capture, keys
from trtspec.cli.app import URL_ENV, cli, stopped_serving
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
    "speculation for a time, POST /alertmanager takes Alertmanager's webhook (docs/governor.md).",
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
    from trtspec.deploy.launch import repository_launch
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
        from trtspec.deploy.launch import server_command_line

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
