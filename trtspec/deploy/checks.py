"""`trtspec validate repo`: a Triton model repository read back and checked, any repository (hand-edited ones too).

`validate_repository` lists every problem at once: missing models, unfilled `${field}`s, tensors that differ from
the contract (trtspec.contract) or from NVIDIA's models of the same name (trtspec.interfaces), broken ensemble
wiring, the BLS's parameters, what TensorRT-LLM's backend needs, and the engine and tokenizer dirs the configs
name. What writes a repository is trtspec.deploy.writer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from trtspec.contract import BLS_INPUTS, BLS_OUTPUTS, ENGINE_INPUTS, ENGINE_OUTPUTS, PERF_OUTPUTS, TensorSpec
from trtspec.deploy.launch import RECV_POLL_PERIOD_MS, repository_launch
from trtspec.deploy.writer import (
    BLS_MODEL,
    CONFIG_FILE,
    DRAFT_MODEL,
    ENGINE_DIR_PARAMETER,
    ENSEMBLE_MODEL,
    POSTPROCESSING_MODEL,
    PREPROCESSING_MODEL,
    TARGET_MODEL,
    TEMPLATE_FIELD,
    TOKENIZER_FILES,
    VERSION_DIR,
)
from trtspec.engine.manifest import read_engine
from trtspec.errors import EngineError, Problem
from trtspec.interfaces import MODEL_TENSORS, SPECULATION_METHODS
from trtspec.serving_settings import ServingSettings

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
        for field in TEMPLATE_FIELD.findall(line):
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
