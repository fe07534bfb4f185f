"""`trtspec deploy` / `trtspec validate repo`: the model repository written from the templates, and its checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from trtspec.cli import cli
from trtspec.config import load_config
from trtspec.contract import BLS_INPUTS, BLS_OUTPUTS, ENGINE_INPUTS, ENGINE_OUTPUTS
from trtspec.deploy import writer as repository
from trtspec.deploy.checks import validate_repository
from trtspec.deploy.writer import (
    MARKER_FILE,
    MODELS,
    RepositoryError,
    render,
    write_repository,
)
from trtspec.engine.manifest import read_engine
from trtspec.interfaces import MODEL_TENSORS


def parse(repo: Path, model: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse((repo / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def params(config) -> dict[str, str]:
    return {k: v.string_value for k, v in config.parameters.items()}


def fields(problems) -> list[str]:
    return [p.field for p in problems]


@pytest.fixture
def broken(model_repository, tmp_path) -> Path:
    """A copy of the deployed repository to break."""
    return Path(shutil.copytree(model_repository, tmp_path / "repo"))


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


# ---- what deploy writes ---------------------------------------------------------------------------------------


def test_deploy_writes_every_model_filled_and_valid(model_repository, built_fp8):
    assert validate_repository(model_repository) == []
    assert sorted(p.name for p in model_repository.iterdir() if p.is_dir()) == sorted(MODELS)
    for model in MODELS:
        assert "${" not in (model_repository / model / "config.pbtxt").read_text()
        assert (model_repository / model / "1").is_dir()
    marker = json.loads((model_repository / MARKER_FILE).read_text())
    assert marker["models"] == list(MODELS) and marker["backend"] == "torch"

    target = read_engine(built_fp8.target)
    bls = params(parse(model_repository, "tensorrt_llm_bls"))
    assert bls == bls | {
        "tensorrt_llm_model_name": "tensorrt_llm",
        "tensorrt_llm_draft_model_name": "tensorrt_llm_draft",
        "tokenizer_dir": str(built_fp8.target.resolve()),
        "default_num_draft_tokens": "3",
        "speculation_num_draft_tokens": "3",
        "default_speculation": "auto",
        "adaptive_draft_length": "true",
        "max_draft_len": str(target.max_draft_len),
        "max_input_len": str(target.max_input_len),
        "max_seq_len": str(target.max_output_seq_len),
        "use_draft_logits_default": "false",
    }
    for model, engine in (("tensorrt_llm", built_fp8.target), ("tensorrt_llm_draft", built_fp8.draft)):
        config = parse(model_repository, model)
        assert config.backend == "python" and config.max_batch_size == target.max_batch_size
        assert params(config) == {"engine_dir": str(engine.resolve()), "device": "cpu", "enable_kv_cache_reuse": "true"}
        assert [g.count for g in config.instance_group] == [1]
    assert params(parse(model_repository, "preprocessing"))["tokenizer_dir"] == str(built_fp8.target.resolve())


@pytest.mark.parametrize("model", MODELS)
def test_every_model_declares_nvidias_tensors(model_repository, model):
    """Names, dtypes, dims, optional flags, reshapes and ragged batching as trtspec.interfaces has them from NVIDIA."""
    config = parse(model_repository, model)
    inputs, outputs = MODEL_TENSORS[model]

    def reshape(t):
        return tuple(t.reshape.shape) if t.HasField("reshape") else None

    assert [
        (
            t.name,
            model_config_pb2.DataType.Name(t.data_type),
            tuple(t.dims),
            t.optional,
            reshape(t),
            t.allow_ragged_batch,
        )
        for t in config.input
    ] == [(s.name, f"TYPE_{s.dtype}", s.dims, s.optional, s.reshape, s.ragged) for s in inputs]
    assert [(t.name, model_config_pb2.DataType.Name(t.data_type), tuple(t.dims)) for t in config.output] == [
        (s.name, f"TYPE_{s.dtype}", s.dims) for s in outputs
    ]
    assert config.max_batch_size > 0  # like NVIDIA's: clients send [1, ...]-shaped tensors
    # decoupled: the BLS always, the engine models by default (NVIDIA's decoupled_mode), so that they stream
    assert config.model_transaction_policy.decoupled == (
        model in ("tensorrt_llm_bls", "tensorrt_llm", "tensorrt_llm_draft")
    )


def test_nvidia_interface_facts():
    """Spot checks typed from NVIDIA's configs, independent of how the tables were written."""
    engine = {s.name: s for s in ENGINE_INPUTS}
    assert len(ENGINE_INPUTS) == 62 and len(ENGINE_OUTPUTS) == 21
    assert (engine["stop_words_list"].dims, engine["stop_words_list"].ragged) == ((2, -1), True)
    assert (engine["seed"].dtype, engine["seed"].reshape) == ("UINT64", ())
    assert (engine["lora_task_id"].dtype, engine["prompt_table_extra_ids"].dtype) == ("UINT64", "UINT64")
    assert not engine["input_lengths"].optional and engine["input_ids"].optional
    assert engine["mrope_position_deltas"].reshape is None and engine["lookahead_window_size"].reshape is None
    bls = {s.name: s for s in BLS_INPUTS if not s.extension}
    assert len(bls) == 43 and len([s for s in BLS_OUTPUTS if not s.extension]) == 19
    assert bls["return_log_probs"].reshape == () and bls["beam_width"].reshape is None
    assert [s.name for s in MODEL_TENSORS["ensemble"][0]][:3] == ["text_input", "decoder_text_input", "max_tokens"]
    assert len(MODEL_TENSORS["ensemble"][0]) == 36 and len(MODEL_TENSORS["preprocessing"][1]) == 20


def test_draft_and_target_come_from_one_template(model_repository):
    target = (model_repository / "tensorrt_llm" / "config.pbtxt").read_text()
    draft = (model_repository / "tensorrt_llm_draft" / "config.pbtxt").read_text()
    engine_dir = params(parse(model_repository, "tensorrt_llm"))["engine_dir"]
    draft_dir = params(parse(model_repository, "tensorrt_llm_draft"))["engine_dir"]
    assert draft == target.replace('name: "tensorrt_llm"', 'name: "tensorrt_llm_draft"').replace(engine_dir, draft_dir)


def test_overrides_reach_the_configs(built_fp8, tmp_path):
    out = write_repository(
        load_config(built_fp8.config),
        built_fp8.engines,
        tmp_path / "r",
        device="cpu",
        overrides={"engine_instance_count": 2, "triton_max_batch_size": 2, "enable_kv_cache_reuse": False},
    )
    config = parse(out, "tensorrt_llm")
    assert [g.count for g in config.instance_group] == [2] and config.max_batch_size == 2
    assert params(config)["enable_kv_cache_reuse"] == "false"
    assert parse(out, "ensemble").max_batch_size == 2
    with pytest.raises(RepositoryError, match="unknown repository setting 'engine_count'"):
        write_repository(
            load_config(built_fp8.config), built_fp8.engines, tmp_path / "s", overrides={"engine_count": 2}
        )
    with pytest.raises(RepositoryError, match="generated from trtspec.contract"):
        write_repository(
            load_config(built_fp8.config), built_fp8.engines, tmp_path / "s", overrides={"engine_inputs": ""}
        )
    assert not (tmp_path / "s").exists()


# ---- templates ------------------------------------------------------------------------------------------------


def test_a_template_field_without_a_value_is_an_error_naming_file_and_field(tmp_path):
    template = tmp_path / "config.pbtxt"
    template.write_text('name: "${model_name}"\nmax_batch_size: ${triton_max_batch_size}\n')
    assert render(template, {"model_name": "m", "triton_max_batch_size": 4}) == 'name: "m"\nmax_batch_size: 4\n'
    with pytest.raises(
        RepositoryError, match=r"config\.pbtxt: no value for the template field\(s\) \$\{triton_max_batch_size\}"
    ):
        render(template, {"model_name": "m"})
    with pytest.raises(RepositoryError, match=r"\$\{model_name\}"):
        render(template, {"model_name": None, "triton_max_batch_size": 4})
    # string values are escaped for the quoted protobuf string they land in
    assert render(template, {"model_name": 'a"b\\c', "triton_max_batch_size": 1}).startswith('name: "a\\"b\\\\c"')


def test_every_shipped_template_field_has_a_value(built_fp8):
    config = load_config(built_fp8.config).config
    values = repository.template_values(
        config, read_engine(built_fp8.target), read_engine(built_fp8.draft), device="cpu"
    )
    per_model = {"model_name", "engine_dir"}  # each engine model's own
    # the trtllm engine models' placement (trtspec.deploy.launch.engine_model_values)
    per_model |= {"gpu_device_ids", "kv_cache_free_gpu_mem_fraction", "trtllm_extra_parameters"}
    templates = sorted(repository.TEMPLATES_DIR.glob("*/config.pbtxt"))
    assert len(templates) == 6
    for template in templates:
        assert repository.template_fields(template.read_text()) <= set(values) | per_model, template


# ---- writing safely --------------------------------------------------------------------------------------------


def test_refuses_a_foreign_directory_unless_forced(built_fp8, tmp_path):
    loaded = load_config(built_fp8.config)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("keep me")
    with pytest.raises(RepositoryError, match="not a repository written by trtspec.*--force"):
        write_repository(loaded, built_fp8.engines, foreign, device="cpu")
    assert (foreign / "precious.txt").read_text() == "keep me"
    write_repository(loaded, built_fp8.engines, foreign, device="cpu", force=True)
    assert not (foreign / "precious.txt").exists() and validate_repository(foreign) == []
    # a trtspec repository is replaced without --force; an empty dir is used as is
    write_repository(loaded, built_fp8.engines, foreign, device="cpu")
    (tmp_path / "empty").mkdir()
    write_repository(loaded, built_fp8.engines, tmp_path / "empty", device="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "foreign"]  # no scratch dirs left


def test_a_failed_write_leaves_the_previous_repository(built_fp8, tmp_path, monkeypatch):
    loaded = load_config(built_fp8.config)
    out = write_repository(loaded, built_fp8.engines, tmp_path / "repo", device="cpu")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    written = []

    def failing(dest, template_dir, text):
        written.append(dest.name)
        if len(written) == 3:
            raise OSError("disk full")
        return original(dest, template_dir, text)

    original = repository._write_model
    monkeypatch.setattr(repository, "_write_model", failing)
    with pytest.raises(OSError, match="disk full"):
        write_repository(loaded, built_fp8.engines, out, device="cpu")
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["repo"]


def test_engines_that_do_not_fit_the_config_are_refused(built_fp8, tmp_path):
    config = load_config(built_fp8.config).config
    with pytest.raises(RepositoryError, match="is a 'torch' engine but the config's backend is 'trtllm'"):
        write_repository(config.model_copy(update={"backend": "trtllm"}), built_fp8.engines, tmp_path / "r")
    engines = Path(shutil.copytree(built_fp8.engines, tmp_path / "engines"))
    shutil.rmtree(engines / "draft")
    with pytest.raises(RepositoryError, match=r"draft: .*config.json is missing"):
        write_repository(config, engines, tmp_path / "r")
    assert not (tmp_path / "r").exists()


# ---- validation of broken repositories --------------------------------------------------------------------------


def test_validate_finds_tensor_dtype_and_unfilled_field_problems(broken):
    edit(
        broken / "tensorrt_llm" / "config.pbtxt",
        '  { name: "draft_input_ids" data_type: TYPE_INT32 dims: [ -1 ] optional: true allow_ragged_batch: true },\n',
        "",
    )
    edit(
        broken / "tensorrt_llm_draft" / "config.pbtxt",
        'name: "input_lengths" data_type: TYPE_INT32',
        'name: "input_lengths" data_type: TYPE_INT64',
    )
    edit(broken / "preprocessing" / "config.pbtxt", 'string_value: "true"', 'string_value: "${x}"')
    problems = validate_repository(broken)
    by_field = {p.field: p for p in problems}
    assert "tensorrt_llm/config.pbtxt input 'draft_input_ids'" in by_field
    assert (
        "is missing (it is in trtspec.contract.ENGINE_INPUTS)"
        in by_field["tensorrt_llm/config.pbtxt input 'draft_input_ids'"].message
    )
    dtype = by_field["tensorrt_llm_draft/config.pbtxt input 'input_lengths' data_type"]
    assert dtype.value == "TYPE_INT64" and "TYPE_INT32" in dtype.message
    unfilled = [p for p in problems if p.value == "${x}"]
    assert len(unfilled) == 1 and unfilled[0].field.startswith("preprocessing/config.pbtxt:")
    # the ensemble maps neither draft_input_ids nor the draft model: nothing else is reported
    assert len(problems) == 3, [str(p) for p in problems]


def test_validate_finds_wiring_and_policy_problems(broken):
    edit(
        broken / "tensorrt_llm_bls" / "config.pbtxt",
        'string_value: "tensorrt_llm_draft"',
        'string_value: "tensorrt_llm_small"',
    )
    edit(broken / "tensorrt_llm_bls" / "config.pbtxt", "decoupled: true", "decoupled: false")
    edit(broken / "tensorrt_llm" / "config.pbtxt", "decoupled: true", "decoupled: false")
    edit(
        broken / "ensemble" / "config.pbtxt",
        '{ name: "top_k" data_type: TYPE_INT32',
        '{ name: "top_k" data_type: TYPE_FP32',
    )
    edit(
        broken / "ensemble" / "config.pbtxt",
        'input_map { key: "SEQUENCE_LENGTH" value: "_SEQUENCE_LENGTH" }',
        'input_map { key: "SEQUENCE_LENGTH" value: "_SEQUENCE_LENGTHS" }',
    )
    shutil.rmtree(broken / "postprocessing" / "1")
    problems = [str(p) for p in validate_repository(broken)]
    expected = [
        "tensorrt_llm_bls/config.pbtxt parameter tensorrt_llm_draft_model_name = 'tensorrt_llm_small': names a model "
        "that is not in the repository",
        "tensorrt_llm_small/config.pbtxt",  # the model the BLS names is missing
        "tensorrt_llm_bls/config.pbtxt model_transaction_policy.decoupled = False: the BLS streams",
        "tensorrt_llm/config.pbtxt model_transaction_policy.decoupled = False",
        "ensemble/config.pbtxt step 2 (tensorrt_llm) input_map 'runtime_top_k' = 'top_k': is TYPE_FP32 but "
        "tensorrt_llm input 'runtime_top_k' is TYPE_INT32",
        "ensemble/config.pbtxt step 3 (postprocessing) input_map 'SEQUENCE_LENGTH' = '_SEQUENCE_LENGTHS': is neither",
        "ensemble/config.pbtxt input 'top_k' data_type = 'TYPE_FP32': differs from NVIDIA's ensemble model",
        "postprocessing/1/model.py",
    ]
    for text in expected:
        assert any(p.startswith(text) for p in problems), (text, problems)
    assert len(problems) == len(expected), problems


def test_validate_reports_missing_models_and_unparsable_configs(broken, tmp_path):
    shutil.rmtree(broken / "tensorrt_llm_draft")
    (broken / "postprocessing" / "config.pbtxt").write_text("name: postprocessing\nbackend: {")
    problems = validate_repository(broken)
    assert fields(problems)[:2] == ["postprocessing/config.pbtxt", "tensorrt_llm_draft/config.pbtxt"]
    assert "does not parse" in problems[0].message and problems[1].message == "is missing"
    assert any("step 3 (postprocessing)" in f for f in fields(problems))
    assert fields(validate_repository(tmp_path / "nowhere")) == ["repository"]


# ---- the command line --------------------------------------------------------------------------------------------


def test_cli_deploy_then_validate(built_fp8, tmp_path):
    runner = CliRunner()
    out = tmp_path / "repo"
    result = runner.invoke(
        cli,
        [
            "deploy",
            "-c",
            str(built_fp8.config),
            "--engines",
            str(built_fp8.engines),
            "--repo",
            str(out),
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "model repository in" in result.output
    result = runner.invoke(cli, ["validate", "repo", str(out)])
    assert result.exit_code == 0 and "ok" in result.output

    edit(
        out / "tensorrt_llm" / "config.pbtxt",
        'name: "output_ids" data_type: TYPE_INT32',
        'name: "output_ids" data_type: TYPE_FP32',
    )
    edit(out / "postprocessing" / "config.pbtxt", 'string_value: "true"', 'string_value: "${skip_special_tokens}"')
    result = runner.invoke(cli, ["validate", "repo", str(out)])
    assert result.exit_code == 1
    assert "3 problems" in result.output  # the dtype, what it breaks in the ensemble, the unfilled field
    assert "step 3 (postprocessing) input_map 'TOKENS_BATCH'" in result.output
    assert "tensorrt_llm/config.pbtxt output 'output_ids' data_type = 'TYPE_FP32'" in result.output
    assert "${skip_special_tokens}" in result.output

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    result = runner.invoke(
        cli,
        [
            "deploy",
            "-c",
            str(built_fp8.config),
            "--engines",
            str(built_fp8.engines),
            "--repo",
            str(tmp_path / "other"),
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 2 and "--force" in result.output


def test_cli_deploy_sets_the_default_draft_source(built_fp8, tmp_path):
    out = tmp_path / "repo"
    result = CliRunner().invoke(
        cli,
        [
            "deploy",
            "-c",
            str(built_fp8.config),
            "--engines",
            str(built_fp8.engines),
            "--repo",
            str(out),
            "--device",
            "cpu",
            "--speculation",
            "prompt_lookup",
        ],
    )
    assert result.exit_code == 0, result.output
    bls = out / "tensorrt_llm_bls" / "config.pbtxt"
    assert 'key: "default_speculation" value: { string_value: "prompt_lookup" }' in bls.read_text()

    edit(bls, 'string_value: "prompt_lookup"', 'string_value: "ngram"')
    assert [p.field for p in validate_repository(out)] == [
        "tensorrt_llm_bls/config.pbtxt parameter default_speculation"
    ]
    edit(bls, 'string_value: "ngram"', 'string_value: "draft_model"')
    edit(
        bls,
        'key: "tensorrt_llm_draft_model_name" value: { string_value: "tensorrt_llm_draft" }',
        'key: "tensorrt_llm_draft_model_name" value: { string_value: "" }',
    )
    problems = validate_repository(out)
    assert len(problems) == 1 and "needs a draft model" in str(problems[0])
