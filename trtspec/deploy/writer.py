"""The Triton model repository, written from the templates in trtspec/deploy/templates/ for one build.

`write_repository` fills each template's `${field}`s from the build config and the engine dirs and writes

    preprocessing  postprocessing  tensorrt_llm  tensorrt_llm_draft  tensorrt_llm_bls  ensemble

plus `trtspec-repository.json` (what was written, from what). The engine models' and the BLS's tensors are
generated from the name tables in trtspec.contract, so the configs cannot drift from the code that serves them.
The engine models come from the template set of the config's backend (`ENGINE_TEMPLATES`); every other model
is the same for all backends.

What reads a repository back and checks it (`trtspec validate repo`) is trtspec.deploy.checks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import string
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from trtspec import __version__
from trtspec.config import BuildConfig, LoadedConfig
from trtspec.contract import (
    BLS_INPUTS,
    BLS_OUTPUTS,
    ENGINE_INPUTS,
    ENGINE_OUTPUTS,
    TensorSpec,
    takes_prompt_ignore,
)
from trtspec.deploy.launch import (
    engine_model_values,
    kv_cache_sequences,
    launch_for,
    planned_gpu_memory_fraction,
)
from trtspec.engine.manifest import EngineInfo, read_engine, read_manifest
from trtspec.errors import EngineError, TrtspecError
from trtspec.interfaces import MODEL_TENSORS
from trtspec.marker import MARKER_FILE
from trtspec.serving_settings import CONCURRENT_REQUESTS_PER_BATCH_SLOT, INPUT_CHARS_PER_TOKEN, ServingSettings

TEMPLATES_DIR = Path(__file__).parent / "templates"
CONFIG_FILE = "config.pbtxt"
VERSION_DIR = "1"

TARGET_MODEL = "tensorrt_llm"
DRAFT_MODEL = "tensorrt_llm_draft"
BLS_MODEL = "tensorrt_llm_bls"
ENSEMBLE_MODEL = "ensemble"
PREPROCESSING_MODEL = "preprocessing"
POSTPROCESSING_MODEL = "postprocessing"
# Every model a repository has (the draft only when the build has one), in the order they are written.
MODELS = (PREPROCESSING_MODEL, POSTPROCESSING_MODEL, TARGET_MODEL, DRAFT_MODEL, ENSEMBLE_MODEL, BLS_MODEL)

# build-config backend -> the template folder both engine models are written from. Nothing else changes with
# the backend: the BLS and the ensemble speak the tensor contract, whichever backend answers it.
ENGINE_TEMPLATES = {"torch": "tensorrt_llm_torch", "trtllm": "tensorrt_llm_trtllm"}
# Triton backend -> the parameter naming the engine dir (TRT-LLM's C++ backend calls it gpt_model_path).
ENGINE_DIR_PARAMETER = {"python": "engine_dir", "tensorrtllm": "gpt_model_path"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
DEVICES = re.compile(r"^(cpu|cuda(:\d+)?)$")
TEMPLATE_FIELD = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class RepositoryError(TrtspecError):
    """A repository that cannot be written: bad inputs, a template without a value, an occupied directory."""


class Raw(str):
    """A template value written as is (generated protobuf text), not as a quoted-string's contents."""


@dataclass(frozen=True)
class ModelPlan:
    """One model to write: its name in the repository, its template folder and its own template values."""

    name: str
    template: str
    values: Mapping[str, object]


def write_repository(
    loaded_config: LoadedConfig | BuildConfig,
    engines_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    force: bool = False,
    device: str = "auto",
    overrides: Mapping[str, object] | None = None,
    portable: bool = False,
) -> Path:
    """Write the model repository for a build into `out_dir` and return its absolute path.

    `engines_dir` holds `target/` (and `draft/` when the config has a draft), as `trtspec build` writes them.
    `device`: "cpu", "cuda", "cuda:N" or "auto" (cuda when torch sees one). `overrides` replace template values
    by field name (e.g. {"engine_instance_count": 2, "triton_max_batch_size": 4}); a name no template uses is
    an error. The repository is written into a scratch dir and renamed into place, so `out_dir` is never half
    written. An existing `out_dir` is replaced only if it is empty or a trtspec repository, or with `force`.
    `portable`: engine and tokenizer dirs are written as given (a relative `engines_dir` stays relative: it then
    resolves against the directory tritonserver starts in), and the marker keeps the engines' config.json, so that
    the repository can be checked in and re-rendered without the engines (`render_models`).
    Raises RepositoryError (or EngineError for an unreadable engine dir).
    """
    config = loaded_config.config if isinstance(loaded_config, LoadedConfig) else loaded_config
    engines_dir = Path(engines_dir).expanduser()
    engines_dir = engines_dir if portable else engines_dir.resolve()
    out_dir = Path(out_dir).expanduser().resolve()
    _check_destination(out_dir, force)
    target, draft = _read_engines(config, engines_dir)
    device = _resolve_device(device)
    plans, rendered = render_models(config, target, draft, device=device, overrides=overrides or {})

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        for plan in plans:
            _write_model(scratch / plan.name, TEMPLATES_DIR / plan.template, rendered[plan.name])
        source = str(loaded_config.source) if isinstance(loaded_config, LoadedConfig) else None
        if portable and source and Path(source).is_absolute():
            source = os.path.relpath(source)
        marker = {
            "trtspec": __version__,
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": config.name,
            "config_path": source,
            "backend": config.backend,
            "engines": {"target": str(target.path)} | ({"draft": str(draft.path)} if draft else {}),
            "models": [p.name for p in plans],
            "launch": launch_for(config, target, draft).to_dict(),  # how `trtspec serve` starts the server
        }
        if portable:
            marker |= {
                "device": device,
                "overrides": dict(overrides or {}),
                "engine_configs": {"target": target.raw} | ({"draft": draft.raw} if draft else {}),
            }
        (scratch / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        _replace_dir(scratch, out_dir)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return out_dir


def render_models(
    config: BuildConfig, target: EngineInfo, draft: EngineInfo | None, *, device: str, overrides: Mapping[str, object]
) -> tuple[list[ModelPlan], dict[str, str]]:
    """The models of a repository and each one's config.pbtxt text."""
    values = template_values(config, target, draft, device=device)
    _apply_overrides(values, overrides)
    plans = plan_models(config, target, draft)
    rendered, used = {}, set()
    for plan in plans:
        template = TEMPLATES_DIR / plan.template / CONFIG_FILE
        rendered[plan.name] = render(template, {**values, **plan.values})
        used |= template_fields(template.read_text())
    unused = sorted(set(overrides) - used)
    if unused:  # e.g. `device` for the trtllm backend, whose engine models do not run trtspec's engine
        raise RepositoryError(
            f"no {config.backend} template has the field(s) {', '.join(unused)}; they set: {', '.join(sorted(used))}"
        )
    return plans, rendered


def template_values(
    config: BuildConfig, target: EngineInfo, draft: EngineInfo | None, *, device: str
) -> dict[str, object]:
    """The values every template draws from (each engine model adds `model_name` and `engine_dir`)."""
    return {
        "triton_max_batch_size": target.max_batch_size,
        "preprocessing_instance_count": 1,
        "postprocessing_instance_count": 1,
        # One instance by default: each keeps its own prefix KV cache, and the orchestrator's next iteration of
        # a sequence must find the cache of its previous one.
        "engine_instance_count": 1,
        # Engine calls that may wait for a batch slot (dynamic_batching.default_queue_policy.max_queue_size, where
        # TensorRT-LLM's backend reads its executor's bound); more are refused at once (503). The BLS has at most
        # one call per engine for each of its max_concurrent_requests (2 x the batch), so 128 never refuses its own
        # calls for batches up to 64 while bounding how many direct calls can pile up ahead of them.
        "max_queue_size": 128,
        "device": device,
        "enable_kv_cache_reuse": True,
        "engine_inputs": tensor_block(ENGINE_INPUTS, inputs=True),
        "engine_outputs": tensor_block(ENGINE_OUTPUTS, inputs=False),
        # the BLS's parameters (add_special_tokens and skip_special_tokens are the pre- and postprocessing's too)
        **ServingSettings.written_defaults(),
        **_bls_build_values(config, target, draft),
        "bls_inputs": tensor_block(BLS_INPUTS, inputs=True),
        "bls_outputs": tensor_block(BLS_OUTPUTS, inputs=False),
        **{
            f"{model}_{kind}": tensor_block(MODEL_TENSORS[model][i], inputs=i == 0)
            for model in (PREPROCESSING_MODEL, POSTPROCESSING_MODEL, ENSEMBLE_MODEL)
            for i, kind in enumerate(("inputs", "outputs"))
        },
    }


def _bls_build_values(config: BuildConfig, target: EngineInfo, draft: EngineInfo | None) -> dict[str, object]:
    """The BLS parameters written from the build and the deploy options: those trtspec.serving_settings marks per
    build (tokenizer_dir and decoupled_mode are the other models' too). Every other one is written at its default."""
    return {
        "tokenizer_dir": str(target.path),
        # NVIDIA's decoupled_mode. Decoupled engine models stream (streaming: true), so the BLS reads a plain
        # stretch from one call and the ensemble streams; their clients need gRPC streams. `deploy --decoupled-mode
        # false` writes unary ones, for clients that call them with plain `infer` (NVIDIA's client-side
        # speculative loop); the BLS then asks for a plain stretch one call per token when it streams.
        "decoupled_mode": True,
        "tensorrt_llm_model_name": TARGET_MODEL,
        "tensorrt_llm_draft_model_name": DRAFT_MODEL if draft is not None else "",
        # A request that names neither num_draft_tokens nor speculation speculates with the build config's K and
        # method (auto: prompt lookup where the text repeats, the draft model elsewhere), bounded by the adaptive
        # draft length; `trtspec bench --apply` and `deploy --default-num-draft-tokens` (0: off) change K.
        "default_num_draft_tokens": config.speculation.num_draft_tokens,
        "speculation_num_draft_tokens": config.speculation.num_draft_tokens,
        "default_speculation": config.speculation.method,
        "adaptive_draft_length": config.speculation.adaptive,
        "max_matching_ngram_size": config.speculation.max_matching_ngram_size,
        "max_draft_len": target.max_draft_len,
        "max_concurrent_requests": concurrent_requests(config, target, draft),
        "max_input_len": prompt_limit(target),
        "max_input_chars": INPUT_CHARS_PER_TOKEN * prompt_limit(target),  # refused untokenized beyond
        "max_seq_len": target.max_output_seq_len,  # prompt + output, as built (without the draft allowance)
        # the GPU-memory alerts fire above it, not at a level TensorRT-LLM's KV-cache reservation reaches at start
        # (trtspec.deploy.monitoring)
        "gpu_memory_planned_fraction": str(planned_gpu_memory_fraction(config, target, draft) or 0),
        "gather_context_logits": target.gather_context_logits,
        "gather_generation_logits": target.gather_generation_logits,
        "engine_prompt_ignore_length": takes_prompt_ignore(target.backend, target.version),
        "use_draft_logits_default": config.speculation.use_draft_logits,
        # trtspec_build_info's labels: what is deployed, by name (not by path, which differs between machines)
        "build_target": os.path.basename(config.target.checkpoint.rstrip("/")),
        "build_draft": os.path.basename(config.draft.checkpoint.rstrip("/")) if config.draft is not None else "",
        "build_quantization": f"{config.target.quantization}, kv {config.target.kv_cache_dtype}, {config.backend}",
        "build_max_draft_len": target.max_draft_len,
        "build_trtspec_version": __version__,
    }


def concurrent_requests(config: BuildConfig, target: EngineInfo, draft: EngineInfo | None) -> int:
    """The BLS's max_concurrent_requests: CONCURRENT_REQUESTS_PER_BATCH_SLOT x the target's max_batch_size, fewer where
    a trtllm plan's KV cache holds fewer full-length sequences (never less than one batch)."""
    held = kv_cache_sequences(config, target, draft)
    per_slot = CONCURRENT_REQUESTS_PER_BATCH_SLOT
    if held is not None:
        per_slot = max(1, min(per_slot, int(held)))
    return per_slot * max(1, target.max_batch_size)


def prompt_limit(target: EngineInfo) -> int:
    """The longest prompt the BLS accepts: the engine's max_input_len, or, for trtllm engines (built to take the
    re-sent sequence, max_seq_len - 1 tokens), the build config's engine.max_input_len recorded in the manifest."""
    limits = (read_manifest(target.path) or {}).get("limits") or {}
    value = limits.get("max_input_len")
    return int(value) if isinstance(value, int) and 0 < value <= target.max_input_len else target.max_input_len


def plan_models(config: BuildConfig, target: EngineInfo, draft: EngineInfo | None) -> list[ModelPlan]:
    engine_template = ENGINE_TEMPLATES[config.backend]
    if not (TEMPLATES_DIR / engine_template / CONFIG_FILE).is_file():
        raise RepositoryError(
            f"the '{config.backend}' backend's engine model templates ({engine_template}) are not in this version of "
            "trtspec; use backend: torch"
        )
    plans = [
        ModelPlan(PREPROCESSING_MODEL, PREPROCESSING_MODEL, {}),
        ModelPlan(POSTPROCESSING_MODEL, POSTPROCESSING_MODEL, {}),
    ]
    # The trtllm engine models also get their GPUs and KV-cache share (trtspec.deploy.launch).
    extra = engine_model_values(config, target, draft) if config.backend == "trtllm" else {}
    for fields in extra.values():
        fields["trtllm_extra_parameters"] = parameter_lines(fields.pop("extra_parameters"))
    plans.append(
        ModelPlan(
            TARGET_MODEL,
            engine_template,
            {"model_name": TARGET_MODEL, "engine_dir": str(target.path), **extra.get("target", {})},
        )
    )
    if draft is not None:
        plans.append(
            ModelPlan(
                DRAFT_MODEL,
                engine_template,
                {"model_name": DRAFT_MODEL, "engine_dir": str(draft.path), **extra.get("draft", {})},
            )
        )
    plans += [ModelPlan(ENSEMBLE_MODEL, ENSEMBLE_MODEL, {}), ModelPlan(BLS_MODEL, BLS_MODEL, {})]
    return plans


def parameter_lines(parameters: Mapping[str, str]) -> Raw:
    """`parameters: { key: ... }` lines of a model config, one per entry."""
    return Raw(
        "\n".join(
            f'parameters: {{ key: "{k}" value: {{ string_value: "{_format(k, v)}" }} }}' for k, v in parameters.items()
        )
    )


def tensor_block(specs: Iterable[TensorSpec], *, inputs: bool) -> Raw:
    """`input [...]` (`inputs`) or `output [...]` entries for a tensor table, one per line, as protobuf text."""
    lines = []
    for spec in specs:
        parts = [f'name: "{spec.name}"', f"data_type: TYPE_{spec.dtype}", f"dims: [ {', '.join(map(str, spec.dims))} ]"]
        if inputs and spec.optional:
            parts.append("optional: true")
        if inputs and spec.reshape is not None:
            parts.append(f"reshape: {{ shape: [ {', '.join(map(str, spec.reshape))} ] }}")
        if inputs and spec.ragged:
            parts.append("allow_ragged_batch: true")
        lines.append("  { " + " ".join(parts) + " }")
    return Raw(",\n".join(lines))


def template_fields(text: str) -> set[str]:
    return set(TEMPLATE_FIELD.findall(text))


def render(template: Path, values: Mapping[str, object]) -> str:
    """Fill every `${field}` of a template; a field without a value is an error naming the file and the field."""
    text = template.read_text()
    missing = sorted(f for f in template_fields(text) if values.get(f) is None)
    if missing:
        raise RepositoryError(
            f"{template}: no value for the template field(s) {', '.join('${' + f + '}' for f in missing)}"
        )
    try:
        return string.Template(text).substitute({k: _format(k, v) for k, v in values.items() if v is not None})
    except (KeyError, ValueError) as exc:  # a `$` that is not a well-formed field
        raise RepositoryError(f"{template}: malformed template field ({exc}); write a literal $ as $$") from exc


def _format(field: str, value: object) -> str:
    if isinstance(value, Raw):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (str, os.PathLike)):
        # Every string field sits inside a quoted protobuf string.
        return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    raise RepositoryError(f"template field {field}: unsupported value {value!r} (use a string, number or boolean)")


def _apply_overrides(values: dict[str, object], overrides: Mapping[str, object]) -> None:
    for key, value in overrides.items():
        if key not in values:
            raise RepositoryError(f"unknown repository setting '{key}'; known: {', '.join(sorted(values))}")
        if isinstance(values[key], Raw):
            raise RepositoryError(f"'{key}' is generated from trtspec.contract and cannot be overridden")
        if value is None:
            raise RepositoryError(f"repository setting '{key}' has no value")
        values[key] = value


def _resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if not DEVICES.match(device):
        raise RepositoryError(f"device '{device}' is not one of auto, cpu, cuda, cuda:N")
    return device


def _read_engines(config: BuildConfig, engines_dir: Path) -> tuple[EngineInfo, EngineInfo | None]:
    """The target's and the draft's engine dirs, checked against the config; every problem is listed at once."""
    if not engines_dir.is_dir():
        raise RepositoryError(
            f"{engines_dir} is not a directory; build the engines first with `trtspec build -c CONFIG`"
        )
    roles = ["target"] + (["draft"] if config.draft is not None else [])
    infos, problems = {}, []
    for role in roles:
        try:
            infos[role] = read_engine(engines_dir / role)
        except EngineError as exc:
            problems.append(f"{role}: {exc}")
    target, draft = infos.get("target"), infos.get("draft")
    for role, info in infos.items():
        if info.backend != config.backend:
            problems.append(
                f"{role}: {info.path} is a '{info.backend}' engine but the config's backend is '{config.backend}'"
            )
    if target is not None:
        if not any((target.path / f).is_file() for f in TOKENIZER_FILES):
            problems.append(
                f"target: {target.path} has no tokenizer ({', '.join(TOKENIZER_FILES)}); the pre/postprocessing "
                "and BLS models load it from there: build from a checkpoint that has one"
            )
        if draft is not None and not target.accepts_draft_tokens:
            problems.append(
                f"target: {target.path} was built without draft-token support (max_draft_len 0); "
                "rebuild it with speculation.max_draft_len > 0"
            )
        elif draft is not None and config.speculation.num_draft_tokens > target.max_draft_len:
            problems.append(
                f"speculation.num_draft_tokens {config.speculation.num_draft_tokens} exceeds the target "
                f"engine's max_draft_len {target.max_draft_len}; rebuild the engines or lower it"
            )
        if draft is not None and draft.vocab_size != target.vocab_size and config.speculation.use_draft_logits:
            problems.append(
                f"draft vocab_size {draft.vocab_size} differs from the target's {target.vocab_size}: "
                "draft logits cannot be used"
            )
    if problems:
        raise RepositoryError(
            f"cannot deploy the engines in {engines_dir}:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return target, draft


def is_trtspec_repository(path: Path) -> bool:
    try:
        return "trtspec" in json.loads((Path(path) / MARKER_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return False


def _check_destination(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise RepositoryError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not is_trtspec_repository(out_dir) and not force:
        raise RepositoryError(
            f"{out_dir} is not empty and is not a repository written by trtspec (it has no {MARKER_FILE}); "
            "choose another --repo, or pass --force to replace it"
        )


def _write_model(dest: Path, template_dir: Path, config_text: str) -> None:
    (dest / VERSION_DIR).mkdir(parents=True)  # Triton needs a version dir, even for the ensemble
    (dest / CONFIG_FILE).write_text(config_text)
    source = template_dir / VERSION_DIR
    if source.is_dir():
        shutil.copytree(
            source, dest / VERSION_DIR, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )


def _replace_dir(new: Path, final: Path) -> None:
    """Move `new` to `final`; an existing `final` is moved aside first and removed only once `new` is in place."""
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        final.rename(old / final.name)
    try:
        new.rename(final)
    except BaseException:
        if old is not None:
            (old / final.name).rename(final)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
