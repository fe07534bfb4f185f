"""The build config: one YAML file that names a draft/target pair and how to build and serve it.

`load_config` reads it with `yaml.safe_load`, validates it with pydantic (unknown keys are errors), resolves
checkpoint paths against the file's folder, then checks what the schema cannot see (files exist, the
architectures run, draft and target share a vocabulary). Every problem is collected and reported at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trtspec.checkpoint import SUPPORTED_ARCHITECTURES, CheckpointInfo, inspect_checkpoint, resolve_checkpoint_path
from trtspec.errors import CheckpointError, ConfigError, Problem
from trtspec.serving_settings import ServingSettings

Dtype = Literal["bfloat16", "float16", "float32"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSpec(_Strict):
    checkpoint: str = Field(description="HF checkpoint dir, a .gguf file, or pkg:<package>/<file>")
    dtype: Dtype = "bfloat16"
    quantization: Literal["fp8", "none"] = "fp8"
    fp8_scaling: Literal["per_tensor", "per_channel"] = "per_tensor"
    # The output head in FP8 too (quantize.py's --quantize_lm_head; off by default there, as here): a quarter of a
    # decode step's bytes on a small model such as the demo's, at the cost of the logits' precision.
    quantize_lm_head: bool = False
    kv_cache_dtype: Literal["fp8", "auto"] = "fp8"
    tp_size: int = Field(1, ge=1)
    pp_size: int = Field(1, ge=1)
    trust_remote_code: bool = False
    # trtllm backend: the model's Hugging Face config.json, used to plan (memory, commands) when `checkpoint`
    # is not on this machine, e.g. `trtspec build --dry-run` away from the GPU host.
    hf_config: str | None = None


class SpeculationSpec(_Strict):
    max_draft_len: int = Field(8, ge=1, le=64)
    num_draft_tokens: int = Field(4, ge=0)
    use_draft_logits: bool = False
    # The deployment's draft source for requests that do not name one: auto drafts from prompt lookup where the
    # text repeats earlier text and from the draft model elsewhere (prompt lookup alone without a draft section);
    # prompt_lookup needs no draft model; none: requests decode plainly unless they ask.
    method: Literal["auto", "draft_model", "prompt_lookup", "none"] = "auto"
    adaptive: bool = True  # draft length follows each request's measured acceptance
    max_matching_ngram_size: int = Field(ServingSettings.max_matching_ngram_size, ge=1, le=16)


class EngineSpec(_Strict):
    max_batch_size: int = Field(8, ge=1)
    max_input_len: int = Field(2048, ge=1)
    max_seq_len: int = Field(4096, ge=2)
    # Embedded engine only: the byte budget of all KV caches (running calls and those kept for reuse); a call
    # that cannot fit is refused with an error naming this limit.
    kv_cache_mb: int = Field(1024, ge=1)
    # Embedded engine only: of that budget, at most this much kept for reusable KV caches of recent sequences
    # (TRT-LLM's block reuse).
    kv_cache_reuse_mb: int = Field(512, ge=0)
    # The target engine keeps the logits a request may ask for (return_context_logits, return_generation_logits);
    # an engine built without them refuses such requests, as TensorRT-LLM's executor does. They cost memory and
    # time on every call, so only a deployment whose clients read logits should ask.
    gather_context_logits: bool = False  # torch backend only: trtllm-build refuses it with max_draft_len > 0
    gather_generation_logits: bool = False  # also on whenever speculation.use_draft_logits


class CalibrationSpec(_Strict):
    """trtllm backend: FP8 calibration by TensorRT-LLM's ModelOpt quantization (quantize.py's --calib_* flags)."""

    dataset: str = "cnn_dailymail"  # a Hugging Face dataset name or a local directory
    size: int = Field(512, ge=1)  # --calib_size: calibration samples
    max_seq_length: int = Field(512, ge=1)  # --calib_max_seq_length
    batch_size: int = Field(1, ge=1)  # --batch_size


class GpuSpec(_Strict):
    """trtllm backend: the GPUs to plan for (when the build machine has none to detect) and where each model runs."""

    type: str | None = None  # one of trtspec.environment.GPU_TYPES, e.g. H100, H200
    count: int | None = Field(None, ge=1)
    memory_gb: float | None = Field(None, gt=0)  # GiB per GPU; defaults to the type's
    host_memory_gb: float | None = Field(None, gt=0)  # CPU memory, for calibration that spills off the GPUs
    target_devices: list[int] | None = None  # GPU ids of the target's ranks [default: 0..tp*pp-1]
    draft_devices: list[int] | None = None  # [default: 0..tp*pp-1, sharing the target's first GPUs]
    # Orchestrator mode without spawned processes: draft logits go straight to the target over MPI.
    fast_logits: bool = False


class TrtllmSpec(_Strict):
    """trtllm backend: knobs of the TensorRT-LLM steps."""

    max_num_tokens: int = Field(8192, ge=1)  # trtllm-build --max_num_tokens (tokens per engine iteration)
    # NVIDIA's examples/quantization/quantize.py to run instead of trtspec's runner of the same ModelOpt API.
    quantize_script: str | None = None
    # A model's examples/models/core/<model>/convert_checkpoint.py to run for `quantization: none`.
    convert_script: str | None = None


class BuildConfig(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=64)
    backend: Literal["torch", "trtllm"] = "torch"
    target: ModelSpec
    draft: ModelSpec | None = None
    speculation: SpeculationSpec = SpeculationSpec()
    engine: EngineSpec = EngineSpec()
    calibration: CalibrationSpec = CalibrationSpec()
    gpu: GpuSpec = GpuSpec()
    trtllm: TrtllmSpec = TrtllmSpec()

    def gathers_generation_logits(self, role: str) -> bool:
        """Whether the `role` engine is built to return generation logits: both for draft logits, and the target
        when asked."""
        return (self.speculation.use_draft_logits and self.draft is not None) or (
            role == "target" and self.engine.gather_generation_logits
        )

    def gathers_context_logits(self, role: str) -> bool:
        return role == "target" and self.engine.gather_context_logits


class LoadedConfig:
    """A validated build config with its checkpoints resolved and inspected."""

    def __init__(self, config: BuildConfig, source: Path, checkpoints: dict[str, CheckpointInfo]):
        self.config = config
        self.source = source
        self.checkpoints = checkpoints  # "target" and, when configured, "draft"

    def models(self) -> list[tuple[str, ModelSpec, CheckpointInfo]]:
        return [(role, getattr(self.config, role), info) for role, info in self.checkpoints.items()]


def load_config(path: str | Path, *, plan_only: bool = False) -> LoadedConfig:
    """Read, validate and check a build config; raises ConfigError listing every problem found.

    `plan_only` (trtllm backend): a checkpoint may be a Hugging Face config.json without weights (or missing, with
    `hf_config` naming its config.json), enough to plan the build; nothing can be built from such a config."""
    source = Path(path).expanduser().resolve()
    if not source.is_file():
        raise ConfigError(
            str(path), [Problem("config", str(path), "file not found", "pass the path of a build config YAML")]
        )
    try:
        raw = yaml.safe_load(source.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(
            str(source), [Problem("config", source.name, f"not valid YAML: {exc}", "fix the YAML syntax")]
        ) from exc
    if not isinstance(raw, dict):
        raise ConfigError(str(source), [Problem("config", raw, "must be a mapping", "see build_configs/ for examples")])
    # Schema, limits and checkpoints are all checked before reporting, so one run lists every problem.
    problems = _cross_checks(raw)
    try:
        config = BuildConfig.model_validate(raw)
    except ValidationError as exc:
        problems = [_problem_from_pydantic(e) for e in exc.errors()] + problems
        config = None
    plan_only = plan_only and raw.get("backend") == "trtllm"
    checkpoints = _inspect_checkpoints(raw, source.parent, problems, plan_only=plan_only)
    if config is not None:
        problems += check_pair(config, checkpoints, plan_only=plan_only)
        if config.backend == "trtllm":
            problems += trtllm_checks(config)
            problems += calibration_checks(config, source.parent, plan_only=plan_only)
    if problems:
        raise ConfigError(str(source), problems)
    return LoadedConfig(config, source, checkpoints)


def _section(raw: dict, key: str, model: type[BaseModel]) -> dict:
    """A section's values with the schema's defaults filled in (the section may still be invalid)."""
    values = raw.get(key) if isinstance(raw.get(key), dict) else {}
    defaults = {name: f.default for name, f in model.model_fields.items() if not f.is_required()}
    return defaults | values


def _cross_checks(raw: dict) -> list[Problem]:
    """Rules between fields; values that are not numbers are left to the schema's own errors."""
    problems = []
    spec, eng = _section(raw, "speculation", SpeculationSpec), _section(raw, "engine", EngineSpec)
    if _ints(spec["num_draft_tokens"], spec["max_draft_len"]) and spec["num_draft_tokens"] > spec["max_draft_len"]:
        problems.append(
            Problem(
                "speculation.num_draft_tokens",
                spec["num_draft_tokens"],
                f"exceeds speculation.max_draft_len ({spec['max_draft_len']})",
                "lower it, or raise max_draft_len",
            )
        )
    if _ints(eng["max_seq_len"], eng["max_input_len"]) and eng["max_seq_len"] <= eng["max_input_len"]:
        problems.append(
            Problem(
                "engine.max_seq_len",
                eng["max_seq_len"],
                f"must exceed engine.max_input_len ({eng['max_input_len']}): prompt + output must fit in it",
                "raise max_seq_len or lower max_input_len",
            )
        )
    explicit = raw.get("speculation") if isinstance(raw.get("speculation"), dict) else {}
    if explicit.get("method") == "draft_model" and raw.get("draft") is None:
        problems.append(
            Problem(
                "speculation.method",
                "draft_model",
                "needs a draft model, and the config has no `draft` section",
                "add a draft, or set speculation.method: prompt_lookup (drafts from the prompt, no model needed)",
            )
        )
    for role in ("target", "draft"):
        section = raw.get(role) if isinstance(raw.get(role), dict) else {}
        quantization = section.get("quantization", ModelSpec.model_fields["quantization"].default)
        if section.get("quantize_lm_head") is True and quantization != "fp8":
            problems.append(
                Problem(
                    f"{role}.quantize_lm_head",
                    True,
                    f"quantizes the output head to FP8, and {role}.quantization is {quantization!r}",
                    "set quantization: fp8, or drop quantize_lm_head",
                )
            )
    if raw.get("backend", "torch") == "torch":
        for role in ("target", "draft"):
            section = raw.get(role) if isinstance(raw.get(role), dict) else {}
            for key in ("tp_size", "pp_size"):
                if section.get(key, 1) != 1:
                    problems.append(
                        Problem(
                            f"{role}.{key}",
                            section[key],
                            "the embedded engine runs in one process",
                            "set it to 1, or use backend: trtllm for tensor/pipeline parallelism",
                        )
                    )
    return problems


def _ints(*values) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


_FIXES = {
    "extra_forbidden": "remove it or correct its spelling (see build_configs/ for the known keys)",
    "missing": "add it",
    "literal_error": "use one of the allowed values",
    "string_pattern_mismatch": "use letters, digits, '.', '_' and '-' only",
}


def _problem_from_pydantic(error: dict) -> Problem:
    field = ".".join(str(p) for p in error["loc"]) or "config"
    return Problem(field, error.get("input"), error["msg"], _FIXES.get(error["type"], ""))


def _inspect_checkpoints(
    raw: dict, base: Path, problems: list[Problem], *, plan_only: bool = False
) -> dict[str, CheckpointInfo]:
    found = {}
    for role in ("target", "draft"):
        checkpoint = (raw.get(role) or {}).get("checkpoint") if isinstance(raw.get(role), dict) else None
        if not isinstance(checkpoint, str):
            continue  # absent or mistyped: the schema reports it
        field = f"{role}.checkpoint"
        try:
            info = inspect_checkpoint(resolve_checkpoint_path(checkpoint, base))
        except CheckpointError as exc:
            info = _planning_info(raw[role], base) if plan_only else None
            if info is None:
                problems.append(
                    Problem(
                        field, checkpoint, str(exc), "point it at a Hugging Face checkpoint directory or a .gguf file"
                    )
                )
                continue
        if raw.get("backend", "torch") == "torch" and not info.supported:
            problems.append(
                Problem(
                    field,
                    checkpoint,
                    f"architecture {info.architecture} is not supported by the embedded engine",
                    f"use one of {', '.join(SUPPORTED_ARCHITECTURES)}",
                )
            )
        found[role] = info
    return found


def check_pair(
    config: BuildConfig, checkpoints: dict[str, CheckpointInfo], *, plan_only: bool = False
) -> list[Problem]:
    """Draft and target must speak the same vocabulary: the draft's token ids go straight to the target.
    When planning from config.json files alone (no tokenizers to compare), differing vocab sizes are accepted
    without draft logits; the real build compares the tokenizers."""
    target, draft = checkpoints.get("target"), checkpoints.get("draft")
    if target is None or draft is None:
        return []
    problems = []
    tv, dv = target.vocab, draft.vocab
    if tv is not None and dv is not None and tv != dv:
        differing = [tok for tok, i in dv.items() if tv.get(tok) != i]
        example = differing[0] if differing else next(tok for tok in tv if tok not in dv)
        problems.append(
            Problem(
                "draft.checkpoint",
                config.draft.checkpoint,
                f"the draft's tokenizer maps tokens to other ids than the target's ({len(differing)} of {len(dv)} "
                "differ, "
                f"e.g. {example!r}: draft {dv.get(example)}, target {tv.get(example)})",
                "use a draft from the same model family that shares the target's tokenizer, or train one with "
                "`trtspec distill`",
            )
        )
    elif target.vocab_size != draft.vocab_size:
        same_tokens = (tv is not None and dv is not None) or (plan_only and (tv is None or dv is None))
        if not same_tokens or config.speculation.use_draft_logits:
            problems.append(
                Problem(
                    "draft.checkpoint",
                    config.draft.checkpoint,
                    f"draft vocab_size {draft.vocab_size} differs from the target's {target.vocab_size}"
                    + (" (same tokens, different padding: draft logits cannot be compared)" if same_tokens else ""),
                    "set speculation.use_draft_logits: false (token matching only needs equal token ids)"
                    if same_tokens
                    else "use a draft that shares the target's tokenizer and vocabulary",
                )
            )
    return problems


# ---- trtllm backend ----------------------------------------------------------------------------------------


def _planning_info(section: dict, base: Path) -> CheckpointInfo | None:
    """A checkpoint known from its config.json alone (the checkpoint dir's, or `hf_config`): enough to plan."""
    checkpoint = section.get("checkpoint")
    if not isinstance(checkpoint, str) or checkpoint.startswith("pkg:"):
        return None
    path = resolve_checkpoint_path(checkpoint, base)  # where the weights will be: the commands name it
    candidates = [path / "config.json"]
    if isinstance(section.get("hf_config"), str):
        candidates.append(resolve_checkpoint_path(section["hf_config"], base))
    for candidate in candidates:
        try:
            config = json.loads(candidate.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict) and config.get("architectures") and "vocab_size" in config:
            return CheckpointInfo(path, config["architectures"][0], int(config["vocab_size"]), config)
    return None


# The calibration sets TensorRT-LLM's get_calib_dataloader (tensorrt_llm/quantization/quantize_by_modelopt.py)
# fetches from the Hugging Face Hub by name; anything else must be a local directory that `datasets.load_dataset`
# reads with a `train` split and a `text` column (a single file is refused with NotImplementedError).
HUB_CALIBRATION_SETS = ("cnn_dailymail", "pileval", "scienceqa", "science_qa")


def is_hub_calibration_set(name: str) -> bool:
    return any(hub in name.lower() for hub in HUB_CALIBRATION_SETS) and not Path(name).is_dir()


def calibration_checks(config: BuildConfig, base: Path, *, plan_only: bool) -> list[Problem]:
    """A calibration set TensorRT-LLM's quantize.py can load: a Hub name it knows, or a local directory (a path
    relative to the config file is made absolute in the config)."""
    cal = config.calibration
    if is_hub_calibration_set(cal.dataset):
        return []
    path = Path(cal.dataset).expanduser()
    path = path if path.is_absolute() else (base / path).resolve()
    if path.is_file():
        return [
            Problem(
                "calibration.dataset",
                cal.dataset,
                "is a file; TensorRT-LLM's quantize.py loads a Hub name or a "
                "directory (a single file raises NotImplementedError there)",
                'put it in a directory as train.jsonl with a "text" field per line, and name the directory',
            )
        ]
    if not path.is_dir():
        if plan_only:
            return []
        return [
            Problem(
                "calibration.dataset",
                cal.dataset,
                "is neither a calibration set quantize.py fetches from the "
                f"Hugging Face Hub ({', '.join(HUB_CALIBRATION_SETS[:2])}) nor an existing directory",
                'name a directory holding train.jsonl with a "text" field per line, or use cnn_dailymail '
                "on a build host that reaches the Hub",
            )
        ]
    cal.dataset = str(path)
    return []


def trtllm_checks(config: BuildConfig) -> list[Problem]:
    """GPU placement and FP8 support for the trtllm backend."""
    from trtspec.environment import FP8_MIN_SM, GPU_TYPES

    problems = []
    if config.engine.gather_context_logits:  # the target is always built for draft tokens (max_draft_len >= 1)
        problems.append(
            Problem(
                "engine.gather_context_logits",
                True,
                "trtllm-build refuses it for a target built with max_draft_len > 0, which every trtspec target is",
                "leave it false on the trtllm backend",
            )
        )
    gpu = config.gpu
    known = GPU_TYPES.get(gpu.type) if gpu.type else None
    if gpu.type and known is None and gpu.memory_gb is None:
        problems.append(
            Problem(
                "gpu.type",
                gpu.type,
                f"is not a known GPU ({', '.join(GPU_TYPES)})",
                "use one of them, or give gpu.memory_gb (GiB per GPU) as well",
            )
        )
    roles = [("target", config.target)] + ([("draft", config.draft)] if config.draft else [])
    uses_fp8 = any(spec.quantization == "fp8" or spec.kv_cache_dtype == "fp8" for _, spec in roles)
    if known is not None and uses_fp8 and known.sm < FP8_MIN_SM:
        problems.append(
            Problem(
                "gpu.type",
                gpu.type,
                f"is SM{known.sm}; FP8 needs SM{FP8_MIN_SM} or newer (Ada, Hopper, Blackwell)",
                "set quantization: none and kv_cache_dtype: auto, or plan for H100/H200/L40S",
            )
        )
    for role, spec in roles:
        if spec.quantization == "fp8" and spec.fp8_scaling != "per_tensor":
            problems.append(
                Problem(
                    f"{role}.fp8_scaling",
                    spec.fp8_scaling,
                    "the trtllm backend quantizes with ModelOpt's per-tensor FP8 (qformat fp8)",
                    "set it to per_tensor",
                )
            )
        ranks = spec.tp_size * spec.pp_size
        devices = getattr(gpu, f"{role}_devices")
        if gpu.count is not None and ranks > gpu.count:
            problems.append(
                Problem(
                    f"{role}.tp_size",
                    spec.tp_size,
                    f"needs {ranks} GPUs (tp_size x pp_size) but gpu.count is {gpu.count}",
                    "lower tp_size/pp_size or raise gpu.count",
                )
            )
        if devices is None:
            continue
        if len(devices) != ranks or len(set(devices)) != len(devices):
            problems.append(
                Problem(
                    f"gpu.{role}_devices",
                    devices,
                    f"must list {ranks} distinct GPU ids (one per rank of {role})",
                    f"give {ranks} ids, or leave it out",
                )
            )
        if gpu.count is not None and any(d < 0 or d >= gpu.count for d in devices):
            problems.append(
                Problem(
                    f"gpu.{role}_devices", devices, f"names a GPU outside 0..{gpu.count - 1}", "use ids below gpu.count"
                )
            )
    if gpu.fast_logits and config.draft is None:
        problems.append(
            Problem(
                "gpu.fast_logits", True, "sends draft logits to the target, and the config has no draft", "remove it"
            )
        )
    if gpu.fast_logits and not config.speculation.use_draft_logits:
        problems.append(
            Problem(
                "gpu.fast_logits",
                True,
                "only speeds up draft-logits transfer, and speculation.use_draft_logits is false",
                "set use_draft_logits: true, or remove fast_logits",
            )
        )
    return problems
