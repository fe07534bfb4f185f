"""The production backend's build: the steps TensorRT-LLM documents for draft-target speculative decoding, per model.

    1. checkpoint  FP8: ModelOpt quantization (quantize.py's `--qformat fp8 --kv_cache_dtype fp8 --calib_dataset D
                   --calib_size N --tp_size T --pp_size P`); `quantization: none`: plain conversion
                   (convert_checkpoint.py)
    2. engine      trtllm-build --use_paged_context_fmha enable ... ; the target adds --speculative_decoding_mode
                   draft_tokens_external --max_draft_len N; FP8 adds --gemm_plugin fp8 --use_fp8_context_fmha enable
                   --use_fused_mlp enable; both gather generation logits when draft logits are used; never
                   --gather_context_logits (trtllm-build refuses it with max_draft_len > 0)
    3. tokenizer   the checkpoint's tokenizer files copied into the engine dir (the tokenizer models read them there)

then the pair is checked with trtspec.engine.validate. Steps run as subprocesses with their output logged to
<output>/logs/ and shown live; a step whose inputs, settings and outputs are unchanged since it last succeeded is
skipped (its output dir's manifest.json holds the fingerprint). `--dry-run` prints the exact commands and the memory
plan and needs neither TensorRT-LLM nor the checkpoints' weights.

Input lengths. The BLS re-sends the whole sequence (prompt + accepted tokens) as a new request every iteration, so
an engine sees inputs up to max_seq_len - 1 tokens long, not just prompts. Both engines are therefore built with
--max_input_len = max_seq_len - 1, and their Triton models enable chunked context (with which the executor takes
inputs up to its max_seq_len - 1 whatever max_num_tokens is); `engine.max_input_len` stays the prompt limit that the
BLS enforces (recorded in the manifest's `limits`). The draft is built with max_seq_len + max_draft_len like the
target (whose build() adds it), so that drafting K tokens after a sequence of max_seq_len - 1 still fits.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from trtspec import __version__
from trtspec.checkpoint import CheckpointInfo
from trtspec.compile.common import (
    StepFailed,
    describe_outputs,
    describe_sources,
    fingerprint,
    is_up_to_date,
    run_logged,
    write_json,
)
from trtspec.compile.memory import (
    GIB,
    MemoryPlan,
    ModelShape,
    calibration_memory,
    engine_memory,
    gib,
    host_memory_bytes,
)
from trtspec.config import BuildConfig, LoadedConfig, ModelSpec, is_hub_calibration_set
from trtspec.engine.manifest import CONFIG_FILE, MANIFEST_FILE, read_manifest
from trtspec.environment import available_gpus
from trtspec.errors import TrtspecError

BUILDING_MARKER = ".trtspec-building"  # in an output dir while its step runs: a dir with it is ours to replace
SOURCE_HASH_LIMIT = 64 * 2**20  # checkpoint files above this are fingerprinted by size and mtime
OUTPUT_HASH_LIMIT = 0  # engine and checkpoint outputs: size and mtime (tens of GB)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
TRTLLM_BUILD = "trtllm-build"
CHECKPOINT_RUNNER = "trtspec.compile.trtllm_checkpoint"


class BuildPlanError(TrtspecError):
    """A trtllm build that cannot go ahead: memory, environment, or an occupied output dir."""


@dataclass
class Step:
    """One subprocess of the build."""

    role: str
    kind: str  # "checkpoint" or "engine"
    argv: list[str]
    output: Path
    label: str  # what the step does, for the plan and the progress display
    settings: dict = field(default_factory=dict)
    up_to_date: bool = False

    @property
    def name(self) -> str:
        return f"{self.role} {self.kind}"


@dataclass
class ModelPlan:
    role: str
    spec: ModelSpec
    info: CheckpointInfo
    shape: ModelShape
    devices: list[int]
    checkpoint_dir: Path
    engine_dir: Path
    steps: list[Step]


@dataclass
class Plan:
    config: BuildConfig
    output: Path
    models: list[ModelPlan]
    memory: MemoryPlan
    limits: dict

    @property
    def steps(self) -> list[Step]:
        return [s for m in self.models for s in m.steps]

    def commands(self) -> list[list[str]]:
        return [s.argv for s in self.steps]


# ---- planning -----------------------------------------------------------------------------------------------


def plan(
    loaded: LoadedConfig, output: Path, *, gpus=None, gpu_source: str | None = None, check_existing: bool = True
) -> Plan:
    """The steps and the memory plan of a build. `gpus`: what to plan against (default: the GPUs present, else those
    the config names)."""
    config = loaded.config
    output = Path(output)
    if gpus is None:
        gpus, gpu_source = available_gpus(config)
    models = []
    for role, spec, info in loaded.models():
        shape = ModelShape.from_hf_config(info.config)
        ranks = spec.tp_size * spec.pp_size
        devices = list(getattr(config.gpu, f"{role}_devices") or range(ranks))
        ckpt, eng = output / "checkpoints" / role, output / role
        steps = [checkpoint_step(config, role, spec, info, ckpt), engine_step(config, role, spec, ckpt, eng)]
        models.append(ModelPlan(role, spec, info, shape, devices, ckpt, eng, steps))
    memory = memory_plan(config, models, gpus, gpu_source or "")
    limits = {"max_input_len": config.engine.max_input_len, "max_seq_len": config.engine.max_seq_len}
    result = Plan(config, output, models, memory, limits)
    if check_existing:
        mark_up_to_date(result)
    return result


def engine_limits(config: BuildConfig, role: str) -> dict:
    """The shape limits passed to trtllm-build (see the module doc for why input and sequence are raised)."""
    eng, spec = config.engine, config.speculation
    return {
        "max_batch_size": eng.max_batch_size,
        "max_input_len": eng.max_seq_len - 1,
        # The target's build() adds max_draft_len itself; the draft gets the same allowance from us.
        "max_seq_len": eng.max_seq_len if role == "target" else eng.max_seq_len + spec.max_draft_len,
        "max_num_tokens": config.trtllm.max_num_tokens,
    }


def checkpoint_step(config: BuildConfig, role: str, spec: ModelSpec, info: CheckpointInfo, out: Path) -> Step:
    """ModelOpt quantization when anything is FP8, else plain conversion; tp/pp go into the checkpoint's mapping."""
    model_dir = str(info.model_dir)
    if spec.quantization == "fp8" or spec.kv_cache_dtype == "fp8":
        cal = config.calibration
        runner = (
            [sys.executable, config.trtllm.quantize_script]
            if config.trtllm.quantize_script
            else [sys.executable, "-m", CHECKPOINT_RUNNER, "quantize"]
        )
        argv = runner + [
            "--model_dir",
            model_dir,
            "--dtype",
            spec.dtype,
            "--qformat",
            "fp8" if spec.quantization == "fp8" else "full_prec",
        ]
        if spec.kv_cache_dtype == "fp8":
            argv += ["--kv_cache_dtype", "fp8"]
        if spec.quantize_lm_head:
            argv += ["--quantize_lm_head"]
        argv += [
            "--calib_dataset",
            cal.dataset,
            "--calib_size",
            str(cal.size),
            "--calib_max_seq_length",
            str(cal.max_seq_length),
            "--batch_size",
            str(cal.batch_size),
            "--tp_size",
            str(spec.tp_size),
            "--pp_size",
            str(spec.pp_size),
            "--output_dir",
            str(out),
        ]
        label = (
            f"quantize ({'FP8' if spec.quantization == 'fp8' else spec.dtype} weights, "
            f"{'FP8' if spec.kv_cache_dtype == 'fp8' else spec.dtype} KV"
            f"{', FP8 output head' if spec.quantize_lm_head else ''}; {cal.size} samples of {cal.dataset})"
        )
    else:
        runner = (
            [sys.executable, config.trtllm.convert_script]
            if config.trtllm.convert_script
            else [sys.executable, "-m", CHECKPOINT_RUNNER, "convert"]
        )
        argv = runner + [
            "--model_dir",
            model_dir,
            "--output_dir",
            str(out),
            "--dtype",
            spec.dtype,
            "--tp_size",
            str(spec.tp_size),
            "--pp_size",
            str(spec.pp_size),
        ]
        label = f"convert ({spec.dtype})"
    return Step(role, "checkpoint", argv, out, f"{label}, tp {spec.tp_size} pp {spec.pp_size}")


def engine_step(config: BuildConfig, role: str, spec: ModelSpec, checkpoint: Path, out: Path) -> Step:
    limits = engine_limits(config, role)
    fp8 = spec.quantization == "fp8"
    argv = [TRTLLM_BUILD, "--checkpoint_dir", str(checkpoint), "--output_dir", str(out)]
    for key, value in limits.items():
        argv += [f"--{key}", str(value)]
    argv += [
        "--max_beam_width",
        "1",
        "--kv_cache_type",
        "paged",
        "--use_paged_context_fmha",
        "enable",
        "--remove_input_padding",
        "enable",
        "--context_fmha",
        "enable",
        "--gpt_attention_plugin",
        spec.dtype,
    ]
    if fp8:
        # The FP8 engine flags of TensorRT-LLM's perf-benchmarking recipe; FP8 context FMHA with paged context FMHA
        # needs an FP8 KV cache (build() turns it off otherwise, so ask for it only then).
        argv += [
            "--gemm_plugin",
            "fp8",
            "--use_fp8_context_fmha",
            "enable" if spec.kv_cache_dtype == "fp8" else "disable",
            "--use_fused_mlp",
            "enable",
        ]
    else:
        argv += ["--gemm_plugin", spec.dtype]
    if role == "target":
        argv += [
            "--speculative_decoding_mode",
            "draft_tokens_external",
            "--max_draft_len",
            str(config.speculation.max_draft_len),
        ]
    if config.gathers_generation_logits(role):
        # FP32 logits whatever the checkpoint says: ModelOpt's export writes logits_dtype float16 for bf16 models,
        # trtllm-build keeps it unless told, and the served models declare FP32 (the backend checks the match)
        argv += ["--gather_generation_logits", "--logits_dtype", "float32"]
    argv += ["--workers", str(spec.tp_size * spec.pp_size)]
    quant = "FP8" if fp8 else spec.dtype
    spec_text = f", verifies up to {config.speculation.max_draft_len} draft tokens" if role == "target" else ""
    return Step(
        role,
        "engine",
        argv,
        out,
        f"trtllm-build ({quant}, batch {limits['max_batch_size']}, "
        f"seq {config.engine.max_seq_len} + {config.speculation.max_draft_len}{spec_text})",
    )


def memory_plan(config: BuildConfig, models: list[ModelPlan], gpus, source: str) -> MemoryPlan:
    engines, calibrations = [], []
    detected = bool(gpus) and gpus[0].source != "config"
    host = (
        int(config.gpu.host_memory_gb * 2**30)
        if config.gpu.host_memory_gb
        else host_memory_bytes()
        if detected
        else None
    )
    for m in models:
        limits = engine_limits(config, m.role)
        engine_seq = limits["max_seq_len"] + (config.speculation.max_draft_len if m.role == "target" else 0)
        engines.append(
            engine_memory(
                m.role,
                m.shape,
                devices=m.devices,
                tp_size=m.spec.tp_size,
                pp_size=m.spec.pp_size,
                dtype=m.spec.dtype,
                quantization=m.spec.quantization,
                kv_cache_dtype=m.spec.kv_cache_dtype,
                max_batch_size=limits["max_batch_size"],
                max_seq_len=engine_seq,
                max_num_tokens=limits["max_num_tokens"],
                gather_generation_logits=config.gathers_generation_logits(m.role),
                max_draft_len=config.speculation.max_draft_len,
            )
        )
        if m.spec.quantization == "fp8" or m.spec.kv_cache_dtype == "fp8":
            calibrations.append(
                calibration_memory(
                    m.role, m.shape, dtype=m.spec.dtype, quantization=m.spec.quantization, gpus=gpus, host_bytes=host
                )
            )
    return MemoryPlan(engines, list(gpus), calibrations, source)


def kv_cache_fractions(plan_: MemoryPlan) -> dict[str, float]:
    """kv_cache_free_gpu_mem_fraction per model, as `trtspec deploy` will set it (trtspec.compile.memory)."""
    return plan_.kv_fractions()


def mark_up_to_date(p: Plan) -> None:
    """Fingerprint each step; a step is up to date when its output dir's manifest has the same fingerprint and its
    outputs are as written. A checkpoint's fingerprint covers the Hugging Face files and its command; an engine's
    covers its checkpoint's fingerprint and its own command, and an engine is rebuilt whenever its checkpoint is."""
    from trtspec.environment import installed_trtllm

    version = installed_trtllm().version
    for m in p.models:
        upstream = None
        if (m.info.path / "config.json").is_file() and any(m.info.model_dir.glob("*.safetensors")):
            upstream = describe_sources(m.info, hash_limit=SOURCE_HASH_LIMIT)
        upstream_done = True
        for step in m.steps:
            argv = [a if a != sys.executable else "python" for a in step.argv]
            step.settings = {"argv": argv, "tensorrt_llm": version, "trtspec": __version__}
            if upstream is None:
                step.up_to_date = False
                continue
            step.settings["fingerprint"] = fingerprint(upstream, step.settings)
            step.up_to_date = upstream_done and is_up_to_date(step.output, step.settings["fingerprint"])
            upstream_done = step.up_to_date
            upstream = [{"step": step.name, "fingerprint": step.settings["fingerprint"]}]


# ---- showing the plan ---------------------------------------------------------------------------------------


def plan_table(p: Plan) -> Table:
    table = Table(title=f"build plan: {p.config.name} (trtllm)")
    for col in ("step", "what", "output", "action"):
        table.add_column(col)
    for s in p.steps:
        table.add_row(s.name, escape(s.label), escape(str(s.output)), "skip (up to date)" if s.up_to_date else "run")
    return table


def memory_table(p: Plan) -> Table:
    mem = p.memory
    table = Table(title=f"memory per GPU, GiB ({escape(mem.gpu_source)})")
    for col in ("GPU", "engine", "weights", "KV", "KV tokens", "other", "total"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    by_index = {g.index: g for g in mem.gpus}
    for device in mem.devices():
        gpu = by_index.get(device)
        for e in (e for e in mem.engines if device in e.devices):
            table.add_row(
                str(device),
                f"{e.role} tp{e.tp_size}",
                f"{e.weights / GIB:.1f}",
                f"{e.kv_planned / GIB:.1f}",
                # the cap, and how many times the bare need (max_batch_size sequences at full length) it holds
                f"{e.kv_cap_tokens or e.kv_tokens} ({(e.kv_cap_tokens or e.kv_tokens) / e.kv_tokens:.1f}x)",
                f"{(e.activations + e.logits + e.overhead) / GIB:.1f}",
                f"{e.planned_total / GIB:.1f}",
            )
        capacity = f"of {gpu.memory_gib:.1f}" if gpu else "[red]no such GPU[/]"
        table.add_row("", "", "", "", "", "", f"[bold]{mem.planned(device) / GIB:.1f}[/] {capacity}")
    return table


def print_plan(p: Plan, console: Console) -> None:
    console.print(plan_table(p))
    console.print(memory_table(p))
    if p.memory.calibrations and is_hub_calibration_set(p.config.calibration.dataset):
        console.print(
            f"[yellow]note:[/] calibration reads '{escape(p.config.calibration.dataset)}' from the Hugging Face Hub "
            "(or its cache): the build host needs to reach it, or give calibration.dataset a local directory "
            '(train.jsonl with a "text" field per line)',
            highlight=False,
        )
    for c in p.memory.calibrations:
        console.print(
            f"calibration of the {c.role}: {gib(c.needed)} (BF16 weights + FP8 copy) on GPUs holding "
            f"{gib(c.gpu_total)}",
            highlight=False,
        )
    fractions = kv_cache_fractions(p.memory)
    console.print(
        "kv_cache_free_gpu_mem_fraction: " + ", ".join(f"{r} {f}" for r, f in fractions.items()), highlight=False
    )
    for w in p.memory.warnings():
        console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)


def print_commands(p: Plan, console: Console) -> None:
    for s in p.steps:
        console.print(f"# {s.name}: {s.label}", markup=False, highlight=False, soft_wrap=True)
        console.print(shlex.join(s.argv), markup=False, highlight=False, soft_wrap=True)


# ---- running ------------------------------------------------------------------------------------------------


def run(loaded: LoadedConfig, output: Path, *, dry_run: bool = False, console: Console | None = None) -> Path:
    """`trtspec build` for backend: trtllm. Returns the output dir (engines in <output>/target and <output>/draft)."""
    console = console or Console(stderr=True)
    if not dry_run:  # before any work: an install without the engine backend stops here, in one sentence
        note = check_trtllm()
        if note:
            console.print(f"[yellow]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
    p = plan(loaded, output)
    print_plan(p, console)
    problems = p.memory.problems()
    if dry_run:
        print_commands(p, console)
        for problem in problems:
            console.print(f"[bold red]does not fit:[/] {escape(problem)}", highlight=False, soft_wrap=True)
        console.print("dry run: nothing run, nothing written")
        return p.output
    check_environment(p)
    if problems:
        raise BuildPlanError("the engines do not fit the GPUs:\n" + "\n".join(f"  - {x}" for x in problems))
    for m in p.models:
        _check_destination(m.checkpoint_dir)
        _check_destination(m.engine_dir)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        for m in p.models:
            for step in m.steps:
                if step.up_to_date:
                    continue
                task = progress.add_task(f"{step.name}: {escape(step.label)}", total=None)
                start = time.perf_counter()
                run_step(p, m, step, progress, task)
                progress.update(
                    task, description=f"{step.name}: done in {time.perf_counter() - start:.0f}s", completed=1, total=1
                )
    final_check(p)
    console.print(f"engines in {p.output}")
    return p.output


def check_trtllm() -> str | None:
    """A TensorRT-LLM that can build engines (a release with the TensorRT engine backend, trtllm-build on PATH), or
    BuildPlanError: one sentence naming the release and image to use. Returns a note for a release outside the
    production line (a 1.3.0 pre-release), else None."""
    from trtspec.environment import UnsupportedVersion, outside_line_note, require_trtllm

    try:
        return outside_line_note(require_trtllm())
    except UnsupportedVersion as exc:
        raise BuildPlanError(str(exc)) from exc


def check_environment(p: Plan) -> None:
    """A GPU to build on (unless every step is done); `check_trtllm` ran before the plan."""
    if all(s.up_to_date for s in p.steps):
        return
    if not p.memory.gpus or p.memory.gpus[0].source == "config":
        raise BuildPlanError(
            f"no GPU detected on this machine ({p.memory.gpu_source}); TensorRT-LLM builds on the GPUs "
            "it serves on. Plan here with --dry-run, build on the GPU host"
        )


def _check_destination(path: Path) -> None:
    if path.exists() and any(path.iterdir()) and read_manifest(path) is None and not (path / BUILDING_MARKER).exists():
        raise BuildPlanError(f"{path} exists and was not written by trtspec; choose another --output or remove it")


def run_step(p: Plan, m: ModelPlan, step: Step, progress: Progress, task) -> None:
    """Run one step into its output dir; the manifest is written last, so an interrupted step reruns next time."""
    out = step.output
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / BUILDING_MARKER).write_text(shlex.join(step.argv) + "\n")
    log_path = p.output / "logs" / f"{m.role}-{step.kind}.log"

    def show(line: str) -> None:
        progress.console.print(f"[dim]{escape(step.name)} |[/] {escape(line)}", highlight=False, soft_wrap=True)
        progress.update(task, description=f"{step.name}: {escape(line[:80])}")

    run_logged(step.name, step.argv, log_path=log_path, cwd=out, on_line=show)
    if step.kind == "engine":
        copy_tokenizer(m.info, out)
    (out / BUILDING_MARKER).unlink()
    if not (out / CONFIG_FILE).is_file():
        raise StepFailed(
            step.name, step.argv, 0, [f"the command succeeded but wrote no {CONFIG_FILE} into {out}"], log_path
        )
    manifest = {
        "trtspec": __version__,
        "backend": "trtllm",
        "role": m.role,
        "step": step.kind,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "fingerprint": step.settings.get("fingerprint"),
        "settings": step.settings,
        "command": step.argv,
        "limits": p.limits,
        "outputs": describe_outputs(out, hash_limit=OUTPUT_HASH_LIMIT),
    }
    write_json(out / MANIFEST_FILE, manifest)


def copy_tokenizer(info: CheckpointInfo, engine_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        src = info.model_dir / name
        if src.is_file():
            shutil.copy2(src, engine_dir / name)


def final_check(p: Plan) -> None:
    """trtspec.engine.validate on the built pair; raises listing every failed check."""
    from trtspec.engine.validate import expected_from_spec, validate_engines

    dirs = {m.role: m.engine_dir for m in p.models}
    problems = validate_engines(
        dirs["target"],
        dirs.get("draft"),
        num_draft_tokens=p.config.speculation.num_draft_tokens,
        use_draft_logits=p.config.speculation.use_draft_logits and "draft" in dirs,
        expect={m.role: expected_from_spec(m.spec) for m in p.models},
    )
    if problems:
        raise BuildPlanError("the built engines fail validation:\n" + "\n".join(f"  - {x}" for x in problems))
