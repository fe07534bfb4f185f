"""The Triton model repository: written from the templates in trtspec/model_repository/ for one build, and checked.

`write_repository` fills each template's `${field}`s from the build config and the engine dirs and writes

    preprocessing  postprocessing  tensorrt_llm  tensorrt_llm_draft  tensorrt_llm_bls  ensemble

plus `trtspec-repository.json` (what was written, from what). The engine models' and the BLS's tensors are
generated from the name tables in trtspec.contract, so the configs cannot drift from the code that serves them.
The engine models come from the template set of the config's backend (`ENGINE_TEMPLATES`); every other model
is the same for all backends.

`validate_repository` reads a repository back (any repository, including hand-edited ones) and lists every
problem: missing models, unfilled fields, tensors that differ from the contract, broken ensemble wiring.
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
from trtspec.contract import BLS_INPUTS, BLS_OUTPUTS, ENGINE_INPUTS, ENGINE_OUTPUTS, PERF_OUTPUTS, TensorSpec
from trtspec.engine.manifest import EngineInfo, read_engine, read_manifest
from trtspec.errors import EngineError, Problem, TrtspecError
from trtspec.interfaces import MODEL_TENSORS, SPECULATION_METHODS
from trtspec.launch import (
    RECV_POLL_PERIOD_MS,
    engine_model_values,
    kv_cache_sequences,
    launch_for,
    planned_gpu_memory_fraction,
    repository_launch,
)
from trtspec.marker import MARKER_FILE
from trtspec.serving_settings import CONCURRENT_REQUESTS_PER_BATCH_SLOT, INPUT_CHARS_PER_TOKEN, ServingSettings

TEMPLATES_DIR = Path(__file__).parent / "model_repository"
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
_FIELD = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


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


# ---- writing -----------------------------------------------------------------------------------------------


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
        # (trtspec.monitoring)
        "gpu_memory_planned_fraction": str(planned_gpu_memory_fraction(config, target, draft) or 0),
        "gather_context_logits": target.gather_context_logits,
        "gather_generation_logits": target.gather_generation_logits,
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
    # The trtllm engine models also get their GPUs and KV-cache share (trtspec.launch).
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
    return set(_FIELD.findall(text))


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


# ---- validation --------------------------------------------------------------------------------------------

_REGENERATE = "regenerate the repository with `trtspec deploy --force`"


def validate_repository(path: str | os.PathLike) -> list[Problem]:
    """Every problem of a model repository, or [] when it is ready to serve.

    Checks: every model present with a config that parses; no `${field}` left; every model's tensors equal those
    of NVIDIA's model of the same name (trtspec.interfaces); the BLS is decoupled, calls the engine models as they
    are (decoupled or not) and its model-name parameters name models that exist; the ensemble's steps map
    tensors that exist, with matching dtypes; the engine and tokenizer dirs the configs name exist.
    """
    root = Path(path)
    if not root.is_dir():
        return [Problem("repository", str(root), "is not a directory", "write one with `trtspec deploy`")]
    problems: list[Problem] = []
    configs = {}
    present = sorted(p.name for p in root.iterdir() if (p / CONFIG_FILE).is_file())
    for name in present:
        config = _load_config(root / name, problems)
        if config is not None:
            configs[name] = config

    bls = configs.get(BLS_MODEL)
    engine_names = {TARGET_MODEL}
    if bls is not None:
        engine_names |= {
            n for n in (_param(bls, "tensorrt_llm_model_name"), _param(bls, "tensorrt_llm_draft_model_name")) if n
        }
    elif DRAFT_MODEL in present:
        engine_names.add(DRAFT_MODEL)
    expected = [PREPROCESSING_MODEL, POSTPROCESSING_MODEL, ENSEMBLE_MODEL, BLS_MODEL] + sorted(engine_names)
    for name in expected:
        if name not in present:
            problems.append(Problem(f"{name}/{CONFIG_FILE}", str(root / name), "is missing", _REGENERATE))

    orchestrated = repository_launch(root) is not None
    for name in sorted(engine_names & set(configs)):
        problems += _check_engine_model(name, configs[name], orchestrated)
    if bls is not None:
        problems += _check_bls(bls, set(present))
        problems += _check_engine_streaming(bls, {n: configs[n] for n in engine_names & set(configs)})
    for name in (PREPROCESSING_MODEL, POSTPROCESSING_MODEL, ENSEMBLE_MODEL):
        if name in configs:
            inputs, outputs = MODEL_TENSORS[name]
            table = f"NVIDIA's {name} model (trtspec.interfaces)"
            problems += _check_tensors(name, "input", configs[name].input, inputs, exact=True, table=table)
            problems += _check_tensors(name, "output", configs[name].output, outputs, exact=True, table=table)
    if ENSEMBLE_MODEL in configs:
        problems += _check_ensemble(configs[ENSEMBLE_MODEL], configs)
    for name in (PREPROCESSING_MODEL, POSTPROCESSING_MODEL, BLS_MODEL):
        if name in configs:
            problems += _check_dir_parameter(
                name,
                configs[name],
                "tokenizer_dir",
                _has_tokenizer,
                "has no tokenizer files",
                "point it at the target engine dir",
            )
    return problems


def _load_config(model_dir: Path, problems: list[Problem]):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    name = model_dir.name
    config_path = model_dir / CONFIG_FILE
    text = config_path.read_text(errors="replace")
    for lineno, line in enumerate(text.splitlines(), 1):
        for field in _FIELD.findall(line):
            problems.append(
                Problem(
                    f"{name}/{CONFIG_FILE}:{lineno}", "${" + field + "}", "template field left unfilled", _REGENERATE
                )
            )
    try:
        config = text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        problems.append(
            Problem(
                f"{name}/{CONFIG_FILE}",
                str(config_path),
                f"does not parse as a Triton model config: {exc}",
                _REGENERATE,
            )
        )
        return None
    if config.name and config.name != name:
        problems.append(
            Problem(
                f"{name}/{CONFIG_FILE} name",
                config.name,
                f"differs from its directory name '{name}'",
                f'set name: "{name}" or rename the directory',
            )
        )
    if config.backend == "python" and not (model_dir / VERSION_DIR / "model.py").is_file():
        problems.append(
            Problem(
                f"{name}/{VERSION_DIR}/model.py", str(model_dir / VERSION_DIR / "model.py"), "is missing", _REGENERATE
            )
        )
    elif not (model_dir / VERSION_DIR).is_dir():
        problems.append(
            Problem(f"{name}/{VERSION_DIR}", str(model_dir / VERSION_DIR), "version directory is missing", _REGENERATE)
        )
    return config


def _param(config, key: str) -> str | None:
    return config.parameters[key].string_value if key in config.parameters else None


def _dtype_name(value: int) -> str:
    from tritonclient.grpc import model_config_pb2

    return model_config_pb2.DataType.Name(value)


def _is_decoupled(config) -> bool:
    return config.HasField("model_transaction_policy") and config.model_transaction_policy.decoupled


def _check_tensors(
    model: str, kind: str, declared, specs: Iterable[TensorSpec], *, exact: bool, table: str
) -> list[Problem]:
    """Declared inputs/outputs against a contract table: names, dtypes, dims, and (inputs) optional."""
    problems = []
    where = f"{model}/{CONFIG_FILE} {kind}"
    by_name = {t.name: t for t in declared}
    specs = list(specs)
    for spec in specs:
        t = by_name.get(spec.name)
        if t is None:
            problems.append(Problem(f"{where} '{spec.name}'", None, f"is missing (it is in {table})", _REGENERATE))
            continue
        if _dtype_name(t.data_type) != f"TYPE_{spec.dtype}":
            problems.append(
                Problem(
                    f"{where} '{spec.name}' data_type",
                    _dtype_name(t.data_type),
                    f"differs from {table}'s TYPE_{spec.dtype}",
                    _REGENERATE,
                )
            )
        if tuple(t.dims) != spec.dims:
            problems.append(
                Problem(
                    f"{where} '{spec.name}' dims", list(t.dims), f"differ from {table}'s {list(spec.dims)}", _REGENERATE
                )
            )
        if kind == "input" and t.optional != spec.optional:
            problems.append(
                Problem(
                    f"{where} '{spec.name}' optional",
                    t.optional,
                    f"differs from {table}'s {spec.optional}",
                    _REGENERATE,
                )
            )
    if exact:
        known = {s.name for s in specs}
        for name in by_name:
            if name not in known:
                problems.append(Problem(f"{where} '{name}'", None, f"is not in {table}", _REGENERATE))
    return problems


def _check_engine_model(name: str, config, orchestrated: bool) -> list[Problem]:
    problems = []
    backend = config.backend
    if backend not in ENGINE_DIR_PARAMETER:
        return [
            Problem(
                f"{name}/{CONFIG_FILE} backend",
                backend,
                f"is not an engine backend ({', '.join(ENGINE_DIR_PARAMETER)})",
                _REGENERATE,
            )
        ]
    # TRT-LLM's own model has many more tensors than the contract uses; the embedded one has exactly those.
    exact = backend == "python"
    problems += _check_tensors(
        name, "input", config.input, ENGINE_INPUTS, exact=exact, table="trtspec.contract.ENGINE_INPUTS"
    )
    problems += _check_tensors(
        name, "output", config.output, ENGINE_OUTPUTS, exact=exact, table="trtspec.contract.ENGINE_OUTPUTS"
    )
    problems += _check_dir_parameter(
        name,
        config,
        ENGINE_DIR_PARAMETER[backend],
        _is_engine_dir,
        "is not an engine dir",
        "point it at an engine dir built by `trtspec build`",
    )
    if backend == "tensorrtllm":
        problems += _check_tensorrtllm_model(name, config, orchestrated)
    return problems


# Parameters TensorRT-LLM's tensorrtllm backend reads at load with no fallback (1.2.0rc8,
# triton_backend/inflight_batcher_llm/src/model_instance_state.cc: getBatchingTypeFromParams and
# getGuidedDecodingConfigFromParams; model_state.cc GetParameter throws "Cannot find parameter with name").
TENSORRTLLM_REQUIRED_PARAMETERS = (
    "gpt_model_type",
    "tokenizer_dir",
    "guided_decoding_backend",
    "xgrammar_tokenizer_info_path",
)
TENSORRTLLM_BATCHING_TYPES = ("V1", "v1", "inflight_batching", "inflight_fused_batching")


def _check_tensorrtllm_model(name: str, config, orchestrated: bool) -> list[Problem]:
    problems = []
    poll = (_param(config, "recv_poll_period_ms") or "").strip()
    if orchestrated and (not poll.isdigit() or int(poll) == 0):
        # model_instance_state.cc: "recv_poll_period_ms is not set, will use busy loop" (a core per model)
        problems.append(
            Problem(
                f"{name}/{CONFIG_FILE} parameter recv_poll_period_ms",
                poll,
                "is unset or 0 in orchestrator mode: the executor's receiving thread spins a CPU core",
                f"set it to {RECV_POLL_PERIOD_MS}, or regenerate with `trtspec deploy`",
            )
        )
    for key in TENSORRTLLM_REQUIRED_PARAMETERS:
        if key not in config.parameters:
            problems.append(
                Problem(
                    f"{name}/{CONFIG_FILE} parameter {key}",
                    None,
                    "is missing: the tensorrtllm backend reads it at load and fails without it",
                    "add it (an empty string_value where not used), or regenerate with `trtspec deploy`",
                )
            )
    kind = _param(config, "gpt_model_type")
    if "gpt_model_type" in config.parameters and kind not in TENSORRTLLM_BATCHING_TYPES:
        problems.append(
            Problem(
                f"{name}/{CONFIG_FILE} parameter gpt_model_type",
                kind,
                "is not a batching type the backend knows",
                "set it to inflight_fused_batching",
            )
        )
    # the backend writes all the perf outputs when a request sets return_perf_metrics, declared or not, and
    # Triton refuses a response holding an undeclared output (fillTritonResponse)
    declared = {t.name for t in config.output}
    missing = [t.name for t in PERF_OUTPUTS if t.name not in declared]
    if missing:
        problems.append(
            Problem(
                f"{name}/{CONFIG_FILE} output",
                missing,
                "are not declared: a request with return_perf_metrics would fail, as the backend writes them all",
                "declare every one of trtspec.contract.PERF_OUTPUTS",
            )
        )
    return problems


def _check_engine_streaming(bls, engines: dict) -> list[Problem]:
    """The BLS calls the engine models as they are: decoupled ones through response streams. It is told which
    by its engine_decoupled_mode parameter, which must say what the engine models' configs say."""
    said = (_param(bls, "engine_decoupled_mode") or str(ServingSettings.engine_decoupled_mode)).strip().lower() in (
        "true",
        "1",
        "yes",
        "on",
    )
    return [
        Problem(
            f"{name}/{CONFIG_FILE} model_transaction_policy.decoupled",
            _is_decoupled(config),
            f"differs from {BLS_MODEL}'s parameter engine_decoupled_mode ({str(said).lower()})",
            "make them agree, or regenerate with `trtspec deploy` (--decoupled-mode sets both)",
        )
        for name, config in sorted(engines.items())
        if _is_decoupled(config) != said
    ]


def _check_bls(config, present: set[str]) -> list[Problem]:
    problems = _check_tensors(
        BLS_MODEL, "input", config.input, BLS_INPUTS, exact=True, table="trtspec.contract.BLS_INPUTS"
    )
    problems += _check_tensors(
        BLS_MODEL, "output", config.output, BLS_OUTPUTS, exact=True, table="trtspec.contract.BLS_OUTPUTS"
    )
    if not _is_decoupled(config):
        problems.append(
            Problem(
                f"{BLS_MODEL}/{CONFIG_FILE} model_transaction_policy.decoupled",
                False,
                "the BLS streams its responses and must be decoupled",
                "set decoupled: true",
            )
        )
    for key, required in (("tensorrt_llm_model_name", True), ("tensorrt_llm_draft_model_name", False)):
        value = _param(config, key)
        if not value:  # an empty draft model name: the BLS drafts without a draft model (e.g. prompt lookup)
            if required:
                problems.append(Problem(f"{BLS_MODEL}/{CONFIG_FILE} parameter {key}", value, "is not set", _REGENERATE))
        elif value not in present:
            problems.append(
                Problem(
                    f"{BLS_MODEL}/{CONFIG_FILE} parameter {key}",
                    value,
                    "names a model that is not in the repository",
                    f"add the model or set {key} to one of: {', '.join(sorted(present))}",
                )
            )
    method = _param(config, "default_speculation")
    if method and method not in SPECULATION_METHODS:
        problems.append(
            Problem(
                f"{BLS_MODEL}/{CONFIG_FILE} parameter default_speculation",
                method,
                "is not a draft source",
                f"set it to one of {', '.join(SPECULATION_METHODS)}",
            )
        )
    elif method == "draft_model" and not _param(config, "tensorrt_llm_draft_model_name"):
        problems.append(
            Problem(
                f"{BLS_MODEL}/{CONFIG_FILE} parameter default_speculation",
                method,
                "needs a draft model, and tensorrt_llm_draft_model_name is empty",
                "set it to prompt_lookup or none, or deploy a draft",
            )
        )
    drafts, longest = _param(config, "default_num_draft_tokens"), _param(config, "max_draft_len")
    if drafts and longest and drafts.isdigit() and longest.isdigit() and int(drafts) > int(longest):
        problems.append(
            Problem(
                f"{BLS_MODEL}/{CONFIG_FILE} parameter default_num_draft_tokens",
                int(drafts),
                f"exceeds max_draft_len {longest}",
                "lower it, or rebuild the target with a larger max_draft_len",
            )
        )
    return problems


def _check_ensemble(config, configs: dict) -> list[Problem]:
    """Each step's model exists; its input_map reads ensemble inputs or earlier outputs of the same dtype; its
    output_map names outputs the model has; every required step input is fed; every ensemble output is made."""
    where = f"{ENSEMBLE_MODEL}/{CONFIG_FILE}"
    problems = []
    available = {t.name: t.data_type for t in config.input}  # tensor -> dtype, as the steps produce them
    for i, step in enumerate(config.ensemble_scheduling.step, 1):
        here = f"{where} step {i} ({step.model_name})"
        model = configs.get(step.model_name)
        if model is None:
            problems.append(
                Problem(
                    here,
                    step.model_name,
                    "names a model that is not in the repository (or does not parse)",
                    _REGENERATE,
                )
            )
            for tensor in step.output_map.values():
                available.setdefault(tensor, None)
            continue
        inputs = {t.name: t for t in model.input}
        outputs = {t.name: t for t in model.output}
        for key, tensor in step.input_map.items():
            if key not in inputs:
                problems.append(
                    Problem(f"{here} input_map '{key}'", tensor, f"{step.model_name} has no input '{key}'", _REGENERATE)
                )
            elif tensor not in available:
                problems.append(
                    Problem(
                        f"{here} input_map '{key}'",
                        tensor,
                        "is neither an ensemble input nor an output of an earlier step",
                        _REGENERATE,
                    )
                )
            elif available[tensor] is not None and available[tensor] != inputs[key].data_type:
                problems.append(
                    Problem(
                        f"{here} input_map '{key}'",
                        tensor,
                        f"is {_dtype_name(available[tensor])} but {step.model_name} input '{key}' is "
                        f"{_dtype_name(inputs[key].data_type)}",
                        _REGENERATE,
                    )
                )
        for name, t in inputs.items():
            if not t.optional and name not in step.input_map:
                problems.append(
                    Problem(
                        f"{here} input '{name}'", None, f"is required by {step.model_name} but not mapped", _REGENERATE
                    )
                )
        for key, tensor in step.output_map.items():
            if key not in outputs:
                problems.append(
                    Problem(
                        f"{here} output_map '{key}'", tensor, f"{step.model_name} has no output '{key}'", _REGENERATE
                    )
                )
                available.setdefault(tensor, None)
            else:
                available[tensor] = outputs[key].data_type
    for t in config.output:
        if t.name not in available:
            problems.append(Problem(f"{where} output '{t.name}'", None, "is produced by no step", _REGENERATE))
        elif available[t.name] is not None and available[t.name] != t.data_type:
            problems.append(
                Problem(
                    f"{where} output '{t.name}'",
                    _dtype_name(t.data_type),
                    f"differs from the dtype its step produces, {_dtype_name(available[t.name])}",
                    _REGENERATE,
                )
            )
    return problems


def _check_dir_parameter(model: str, config, key: str, is_ok, what: str, fix: str) -> list[Problem]:
    value = _param(config, key)
    field = f"{model}/{CONFIG_FILE} parameter {key}"
    if not value:
        return [Problem(field, value, "is not set", _REGENERATE)]
    if "${" in value:
        return []  # already reported as an unfilled field
    if not is_ok(Path(value)):
        return [Problem(field, value, what, fix)]
    return []


def _is_engine_dir(path: Path) -> bool:
    try:
        read_engine(path)
    except EngineError:
        return False
    return True


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in TOKENIZER_FILES)
