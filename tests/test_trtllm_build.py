"""The trtllm backend's build: golden command lines for the example configs, --dry-run without TensorRT-LLM, the memory
plan, the version guard, the config checks, and real runs of the steps against stand-in `trtllm-build` and quantize
commands (skip on re-run, rebuild on change, a failure naming the step, the command and its log)."""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from rich.console import Console
from support.trtllm_layout import hf_config, write_checkpoint

from trtspec import environment
from trtspec.cli import cli
from trtspec.compile import run_build, trtllm
from trtspec.compile.common import StepFailed
from trtspec.compile.memory import GIB, ModelShape, engine_memory
from trtspec.config import load_config
from trtspec.environment import (
    Gpu,
    Package,
    UnsupportedVersion,
    check_trtllm_version,
    named_gpus,
    parse_nvidia_smi,
)
from trtspec.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "70b": ROOT / "build_configs" / "llama-3.1-70b_llama-3.2-1b_4xh100.yaml",
    "405b": ROOT / "build_configs" / "llama-3.1-405b_llama-3.1-8b_8xh200.yaml",
    "qwen": ROOT / "build_configs" / "qwen2.5-14b_qwen2.5-0.5b_1xh100.yaml",
}
PY = sys.executable


def quantize_cmd(model: str, tp: int, out: Path) -> list[str]:
    return [
        PY,
        "-m",
        "trtspec.compile.trtllm_checkpoint",
        "quantize",
        "--model_dir",
        model,
        "--dtype",
        "bfloat16",
        "--qformat",
        "fp8",
        "--kv_cache_dtype",
        "fp8",
        "--calib_dataset",
        "cnn_dailymail",
        "--calib_size",
        "512",
        "--calib_max_seq_length",
        "512",
        "--batch_size",
        "1",
        "--tp_size",
        str(tp),
        "--pp_size",
        "1",
        "--output_dir",
        str(out),
    ]


def build_cmd(ckpt: Path, out: Path, *, batch: int, seq: int, workers: int, draft_len: int | None) -> list[str]:
    cmd = [
        "trtllm-build",
        "--checkpoint_dir",
        str(ckpt),
        "--output_dir",
        str(out),
        "--max_batch_size",
        str(batch),
        "--max_input_len",
        "8191",
        "--max_seq_len",
        str(seq),
        "--max_num_tokens",
        "8192",
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
        "bfloat16",
        "--gemm_plugin",
        "fp8",
        "--use_fp8_context_fmha",
        "enable",
        "--use_fused_mlp",
        "enable",
    ]
    if draft_len is not None:
        cmd += ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(draft_len)]
    return cmd + ["--workers", str(workers)]


def golden(name: str, out: Path) -> list[list[str]]:
    c, t, d = out / "checkpoints", out / "target", out / "draft"
    if name == "70b":
        return [
            quantize_cmd("/models/meta-llama/Llama-3.1-70B-Instruct", 4, c / "target"),
            build_cmd(c / "target", t, batch=16, seq=8192, workers=4, draft_len=10),
            quantize_cmd("/models/meta-llama/Llama-3.2-1B-Instruct", 1, c / "draft"),
            build_cmd(c / "draft", d, batch=16, seq=8202, workers=1, draft_len=None),
        ]
    if name == "405b":
        return [
            quantize_cmd("/models/meta-llama/Llama-3.1-405B-Instruct", 8, c / "target"),
            build_cmd(c / "target", t, batch=16, seq=8192, workers=8, draft_len=10),
            quantize_cmd("/models/meta-llama/Llama-3.1-8B-Instruct", 1, c / "draft"),
            build_cmd(c / "draft", d, batch=16, seq=8202, workers=1, draft_len=None),
        ]
    return [
        quantize_cmd("/models/Qwen/Qwen2.5-14B-Instruct", 1, c / "target"),
        build_cmd(c / "target", t, batch=8, seq=8192, workers=1, draft_len=8),
        quantize_cmd("/models/Qwen/Qwen2.5-0.5B-Instruct", 1, c / "draft"),
        build_cmd(c / "draft", d, batch=8, seq=8200, workers=1, draft_len=None),
    ]


@pytest.fixture(autouse=True)
def no_gpus_no_trtllm(monkeypatch):
    """This machine as the tests see it: no GPU, no TensorRT-LLM (tests that need them say so)."""
    monkeypatch.setattr(environment, "detect_gpus", lambda: environment.GpuReport([], ["test: none"]))
    monkeypatch.setattr(environment, "installed_trtllm", lambda: Package("tensorrt_llm", None, None))


# ---- golden command lines ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_configs_plan_the_documented_commands(name, tmp_path):
    loaded = load_config(EXAMPLES[name], plan_only=True)
    plan = trtllm.plan(loaded, tmp_path)
    assert plan.commands() == golden(name, tmp_path)
    assert [s.name for s in plan.steps] == ["target checkpoint", "target engine", "draft checkpoint", "draft engine"]
    assert not any(s.up_to_date for s in plan.steps)
    assert plan.memory.problems() == []
    target_build = plan.steps[1].argv
    assert "--gather_context_logits" not in target_build and "--gather_all_token_logits" not in target_build


def test_example_configs_need_their_checkpoints_outside_plan_only():
    with pytest.raises(ConfigError, match="target.checkpoint"):
        load_config(EXAMPLES["70b"])


def test_dry_run_prints_exact_commands_without_tensorrt_llm(tmp_path):
    out = tmp_path / "engines"
    result = CliRunner().invoke(
        cli, ["build", "-c", str(EXAMPLES["70b"]), "-o", str(out), "--dry-run"], env={"COLUMNS": "400"}
    )
    assert result.exit_code == 0, result.output
    import shlex

    for cmd in golden("70b", out):
        assert shlex.join(cmd) in result.output
    assert "dry run: nothing run, nothing written" in result.output
    assert not out.exists()


def test_draft_logits_gather_generation_logits_on_both_engines(tmp_path):
    config = yaml.safe_load(EXAMPLES["70b"].read_text())
    config["speculation"]["use_draft_logits"] = True
    path = _write_example(tmp_path, config)
    plan = trtllm.plan(load_config(path, plan_only=True), tmp_path / "out")
    for step in plan.steps:
        if step.kind == "engine":
            assert "--gather_generation_logits" in step.argv
            assert "--gather_context_logits" not in step.argv
            # the served models declare FP32 logits; ModelOpt's export would leave float16 for a bf16 model
            assert step.argv[step.argv.index("--logits_dtype") + 1] == "float32"


def test_unquantized_models_are_converted_not_calibrated(tmp_path):
    config = yaml.safe_load(EXAMPLES["qwen"].read_text())
    for role in ("target", "draft"):
        config[role].update(quantization="none", kv_cache_dtype="auto")
    plan = trtllm.plan(load_config(_write_example(tmp_path, config), plan_only=True), tmp_path / "out")
    ckpt = plan.steps[0].argv
    assert ckpt[:4] == [PY, "-m", "trtspec.compile.trtllm_checkpoint", "convert"]
    assert ckpt[4:] == [
        "--model_dir",
        "/models/Qwen/Qwen2.5-14B-Instruct",
        "--output_dir",
        str(tmp_path / "out" / "checkpoints" / "target"),
        "--dtype",
        "bfloat16",
        "--tp_size",
        "1",
        "--pp_size",
        "1",
    ]
    engine = plan.steps[1].argv
    assert engine[engine.index("--gemm_plugin") + 1] == "bfloat16" and "--use_fp8_context_fmha" not in engine
    assert plan.memory.calibrations == []


def test_quantize_lm_head_reaches_modelopt_or_is_refused(tmp_path):
    import inspect

    from trtspec.compile.trtllm_checkpoint import parse_args, quantize_kwargs

    config = yaml.safe_load(EXAMPLES["qwen"].read_text())
    config["target"]["quantize_lm_head"] = True
    plan = trtllm.plan(load_config(_write_example(tmp_path, config), plan_only=True), tmp_path / "out")
    target, draft = (s.argv for s in plan.steps if s.kind == "checkpoint")
    assert "--quantize_lm_head" in target and "--quantize_lm_head" not in draft
    args = parse_args(target[3:])
    assert args.quantize_lm_head is True

    def with_head(*, model_dir, output_dir, qformat, quantize_lm_head=False): ...

    def without_head(*, model_dir, output_dir, qformat): ...

    assert quantize_kwargs(args, inspect.signature(with_head))["quantize_lm_head"] is True
    # a TensorRT-LLM whose quantize_and_export cannot quantize the head refuses rather than build it in bfloat16
    with pytest.raises(SystemExit, match="no quantize_lm_head"):
        quantize_kwargs(args, inspect.signature(without_head))
    assert "quantize_lm_head" not in quantize_kwargs(parse_args(draft[3:]), inspect.signature(without_head))


def _write_example(tmp_path: Path, config: dict) -> Path:
    for role in ("target", "draft"):
        config[role]["hf_config"] = str(ROOT / "build_configs" / config[role]["hf_config"])
    path = tmp_path / "build.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# ---- config checks ------------------------------------------------------------------------------------------------


def test_qwen_vocab_padding_is_refused_only_with_draft_logits(tmp_path):
    config = yaml.safe_load(EXAMPLES["qwen"].read_text())
    assert load_config(_write_example(tmp_path, dict(config)), plan_only=True)
    config = yaml.safe_load(EXAMPLES["qwen"].read_text())
    config["speculation"]["use_draft_logits"] = True
    with pytest.raises(ConfigError, match="vocab_size 151936 differs from the target's 152064"):
        load_config(_write_example(tmp_path, config), plan_only=True)


def test_trtllm_config_checks(tmp_path):
    config = yaml.safe_load(EXAMPLES["70b"].read_text())
    config["gpu"].update(type="A100", draft_devices=[0, 1], fast_logits=True)
    config["target"]["tp_size"] = 8
    config["draft"]["fp8_scaling"] = "per_channel"
    config["calibration"]["sizee"] = 3
    with pytest.raises(ConfigError) as exc:
        load_config(_write_example(tmp_path, config), plan_only=True)
    fields = [p.field for p in exc.value.problems]
    assert "calibration.sizee" in fields  # unknown keys stay errors
    config["calibration"].pop("sizee")
    with pytest.raises(ConfigError) as exc:
        load_config(_write_example(tmp_path, config), plan_only=True)
    text = str(exc.value)
    assert "FP8 needs SM89" in text and "needs 8 GPUs" in text and "must list 1 distinct GPU ids" in text
    assert "per-tensor FP8" in text and "gpu.fast_logits" in text


# ---- the version guard ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version",
    [
        "0.20.0",
        "0.21.0",
        "1.0.0",
        "1.0.3.2510",
        "1.1.0",
        "1.2.0rc2",
        "1.2.1",
        "1.3.0rc5",
        "1.3.0rc20",
        "1.3.0rc20.post1",
        "1.3.0.dev1",
    ],
)
def test_version_guard_accepts_releases_with_the_trt_backend(version):
    assert str(check_trtllm_version(version)).startswith(version.split(".post")[0][:3])


@pytest.mark.parametrize(
    "version,why",
    [
        ("1.3.0rc21", "no TensorRT engine backend"),
        ("1.3.0", "no TensorRT engine backend"),
        ("1.4.0rc1", "no TensorRT engine backend"),
        ("2.0.0", "no TensorRT engine backend"),
        ("0.19.0", "older than 0.20.0"),
        ("0.14.0", "older than 0.20.0"),
        ("banana", "not a version number"),
        (None, "not installed"),
    ],
)
def test_version_guard_refuses_with_what_works(version, why):
    with pytest.raises(UnsupportedVersion) as exc:
        check_trtllm_version(version)
    text = str(exc.value)
    assert why in text
    assert "TensorRT-LLM 1.2.1" in text and "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3" in text


def test_pyproject_pins_the_release_the_container_ships():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'trtllm = ["tensorrt_llm=={environment.PINNED_TRTLLM}"]' in text
    check_trtllm_version(environment.PINNED_TRTLLM)
    assert (
        environment.CONTAINER_TRTLLM[environment.CONTAINER_IMAGE.split(":")[1].split("-")[0]]
        == environment.PINNED_TRTLLM
    )


def test_nvidia_smi_parsing_and_doctor_without_gpus():
    gpus = parse_nvidia_smi("0, NVIDIA H100 80GB HBM3, 81559, 9.0\n1, NVIDIA A100-SXM4-80GB, 81920, 8.0\n")
    assert [(g.name, round(g.memory_gib, 1), g.sm, g.fp8) for g in gpus] == [
        ("NVIDIA H100 80GB HBM3", 79.6, 90, True),
        ("NVIDIA A100-SXM4-80GB", 80.0, 80, False),
    ]
    result = CliRunner().invoke(cli, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "none found" in result.output and "TensorRT-LLM is not installed" in result.output
    result = CliRunner().invoke(cli, ["doctor", "--json"])
    report = json.loads(result.output)
    assert report["gpus"] == [] and report["tensorrt_llm"]["supported"] is False


# ---- the memory plan -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,params",
    [
        ("Llama-3.1-70B-Instruct", 70_553_706_496),
        ("Llama-3.2-1B-Instruct", 1_235_814_400),
        ("Llama-3.1-405B-Instruct", 405_853_388_800),
        ("Llama-3.1-8B-Instruct", 8_030_261_248),
        ("Qwen2.5-14B-Instruct", 14_770_033_664),
        ("Qwen2.5-0.5B-Instruct", 494_032_768),
    ],
)
def test_parameter_counts_match_the_published_sizes(name, params):
    """The safetensors totals Hugging Face shows for these repositories."""
    assert ModelShape.from_hf_config(hf_config(name)).param_count == params


def test_engine_memory_of_the_70b_target_on_four_gpus():
    shape = ModelShape.from_hf_config(hf_config("Llama-3.1-70B-Instruct"))
    m = engine_memory(
        "target",
        shape,
        devices=[0, 1, 2, 3],
        tp_size=4,
        pp_size=1,
        dtype="bfloat16",
        quantization="fp8",
        kv_cache_dtype="fp8",
        max_batch_size=16,
        max_seq_len=8202,
        max_num_tokens=8192,
        gather_generation_logits=False,
        max_draft_len=10,
    )
    # FP8 matrices / 4 + BF16 norms + the BF16 embedding on every rank + a quarter of the BF16 lm_head
    linear = 80 * (8192 * (8192 + 2 * 1024) + 8192 * 8192 + 3 * 8192 * 28672)
    assert m.weights == linear // 4 + (80 * 2 * 8192 + 8192) * 2 + 128256 * 8192 * 2 + 128256 * 8192 * 2 // 4
    assert m.kv_bytes_per_token == 2 * 80 * 2 * 128 * 1  # K and V, 80 layers, 8/4 KV heads, FP8
    assert m.kv_tokens == 16 * 8224  # 8202 rounded up to 32-token blocks
    assert 18 * GIB < m.weights < 19 * GIB


def test_a_pair_that_does_not_fit_is_refused_with_the_numbers(tmp_path):
    config = yaml.safe_load(EXAMPLES["70b"].read_text())
    config["target"]["tp_size"] = 1
    config["target"]["quantization"] = "none"
    config["gpu"]["target_devices"] = [0]
    plan = trtllm.plan(load_config(_write_example(tmp_path, config), plan_only=True), tmp_path / "out")
    problems = plan.memory.problems()
    assert len(problems) == 1 and problems[0].startswith("GPU 0 (H100, 79.6 GiB) needs")
    assert "target: weights 131.4 GiB + KV cache 20.1 GiB (131584 tokens)" in problems[0]
    # calibration of 70B BF16 + an FP8 copy does not fit on one H100, and the host memory is unknown
    config["target"]["quantization"] = "fp8"
    config["gpu"]["count"] = 1
    config["target"]["tp_size"] = 1
    plan = trtllm.plan(load_config(_write_example(tmp_path, config), plan_only=True), tmp_path / "out")
    assert any("target calibration needs 199.1 GiB" in p and "gpu.host_memory_gb" in p for p in plan.memory.problems())


def test_405b_calibration_spills_to_host_memory_with_a_warning(tmp_path):
    plan = trtllm.plan(load_config(EXAMPLES["405b"], plan_only=True), tmp_path)
    assert plan.memory.problems() == []
    assert any("target calibration" in w and "CPU memory" in w for w in plan.memory.warnings())


def test_detected_gpus_take_precedence_over_named_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(environment, "detect_gpus", lambda: environment.GpuReport(named_gpus("H100", 2)))
    plan = trtllm.plan(load_config(EXAMPLES["70b"], plan_only=True), tmp_path)
    assert any("GPU 2 is needed but only 2 GPU(s)" in p for p in plan.memory.problems())


# ---- running the steps -------------------------------------------------------------------------------------------

FAKE_QUANTIZE = """
import argparse, json, os, sys
from pathlib import Path
p = argparse.ArgumentParser()
for flag in ("model_dir", "dtype", "qformat", "kv_cache_dtype", "calib_dataset", "calib_size", "calib_max_seq_length",
             "batch_size", "tp_size", "pp_size", "output_dir"):
    p.add_argument("--" + flag)
a = p.parse_args()
print("Loading model", a.model_dir); print("Calibrating batch 0\\rCalibrating batch 1"); sys.stdout.flush()
if os.environ.get("FAKE_FAIL") == "quantize":
    print("CUDA out of memory"); sys.exit(3)
out = Path(a.output_dir); out.mkdir(parents=True, exist_ok=True)
hf = json.loads((Path(a.model_dir) / "config.json").read_text())
world = int(a.tp_size) * int(a.pp_size)
(out / "config.json").write_text(json.dumps({"hf": hf, "tp_size": int(a.tp_size), "fp8": a.qformat == "fp8",
                                               "fp8_kv": a.kv_cache_dtype == "fp8"}))
for r in range(world):
    (out / f"rank{r}.safetensors").write_bytes(b"w")
"""

FAKE_BUILD = """
import argparse, json, os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from support.trtllm_layout import engine_config, write_engine
p = argparse.ArgumentParser()
p.add_argument("--checkpoint_dir"); p.add_argument("--output_dir")
p.add_argument("--max_batch_size", type=int); p.add_argument("--max_input_len", type=int)
p.add_argument("--max_seq_len", type=int)
p.add_argument("--max_draft_len", type=int, default=0); p.add_argument("--speculative_decoding_mode")
p.add_argument("--gather_generation_logits", action="store_true")
a, _ = p.parse_known_args()
print("[TensorRT-LLM] building", a.output_dir, flush=True)
if os.environ.get("FAKE_FAIL") == "build":
    print("[TensorRT-LLM][ERROR] Engine building failed, please check error log."); sys.exit(1)
ck = json.loads((Path(a.checkpoint_dir) / "config.json").read_text())
role = "target" if a.speculative_decoding_mode else "draft"
version = os.environ.get("FAKE_TRTLLM_VERSION", "1.2.1")
cfg = engine_config(version=version, role=role, hf=ck["hf"], tp_size=ck["tp_size"], max_draft_len=a.max_draft_len,
                    max_batch_size=a.max_batch_size, max_input_len=a.max_input_len, max_seq_len=a.max_seq_len,
                    fp8=ck["fp8"], fp8_kv=ck["fp8_kv"], gather_generation_logits=a.gather_generation_logits)
write_engine(Path(a.output_dir), cfg)
"""


@pytest.fixture
def fake_tools(tmp_path, monkeypatch):
    """Stand-ins for trtllm-build and ModelOpt's quantize, TensorRT-LLM 1.2.1 "installed", and 4 H100s "present"."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    build = bin_dir / "trtllm-build"
    build.write_text(f"#!{PY}\n" + FAKE_BUILD.format(tests=str(Path(__file__).parent)))
    build.chmod(0o755)
    quantize = tmp_path / "fake_quantize.py"
    quantize.write_text(FAKE_QUANTIZE)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(environment, "installed_trtllm", lambda: Package("tensorrt_llm", "1.2.1", "/fake"))
    gpus = [Gpu(i, "NVIDIA H100 80GB HBM3", 81559 / 1024, 90, "nvidia-smi") for i in range(4)]
    monkeypatch.setattr(environment, "detect_gpus", lambda: environment.GpuReport(gpus))
    tok = tmp_path / "tok.json"
    tok.write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    config = yaml.safe_load(EXAMPLES["70b"].read_text())
    config["target"]["checkpoint"] = str(
        write_checkpoint(tmp_path / "hf" / "target", "Llama-3.1-70B-Instruct", weights=True, tokenizer=tok)
    )
    config["draft"]["checkpoint"] = str(
        write_checkpoint(tmp_path / "hf" / "draft", "Llama-3.2-1B-Instruct", weights=True, tokenizer=tok)
    )
    config["trtllm"] = {"quantize_script": str(quantize)}
    path = tmp_path / "build.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _run(config: Path, out: Path) -> str:
    buffer = io.StringIO()
    run_build(config, out, console=Console(file=buffer, width=200))
    return buffer.getvalue()


def test_steps_run_then_skip_when_unchanged_then_rerun_on_change(fake_tools, tmp_path):
    out = tmp_path / "engines"
    log = _run(fake_tools, out)
    assert "Calibrating batch 1" in log and "[TensorRT-LLM] building" in log  # live logs
    for role in ("target", "draft"):
        manifest = json.loads((out / role / "manifest.json").read_text())
        assert manifest["backend"] == "trtllm" and manifest["command"][0] == "trtllm-build"
        assert manifest["limits"] == {"max_input_len": 4096, "max_seq_len": 8192}
        assert (out / role / "tokenizer.json").is_file() and (out / "logs" / f"{role}-engine.log").is_file()
    assert sorted(p.name for p in (out / "target").glob("rank*.engine")) == [f"rank{r}.engine" for r in range(4)]

    loaded = load_config(fake_tools)
    assert all(s.up_to_date for s in trtllm.plan(loaded, out).steps)
    log = _run(fake_tools, out)  # nothing runs again
    assert "Calibrating" not in log and "building" not in log

    (out / "draft" / "rank0.engine").write_bytes(b"changed plan")  # an output changed
    steps = {s.name: s.up_to_date for s in trtllm.plan(loaded, out).steps}
    assert steps == {"target checkpoint": True, "target engine": True, "draft checkpoint": True, "draft engine": False}

    config = yaml.safe_load(fake_tools.read_text())  # a setting changed
    config["calibration"]["size"] = 256
    fake_tools.write_text(yaml.safe_dump(config))
    steps = {s.name: s.up_to_date for s in trtllm.plan(load_config(fake_tools), out).steps}
    assert steps == {
        "target checkpoint": False,
        "target engine": False,
        "draft checkpoint": False,
        "draft engine": False,
    }


@pytest.mark.parametrize("failing,step", [("quantize", "target checkpoint"), ("build", "target engine")])
def test_a_failing_step_names_itself_its_command_and_its_log(fake_tools, tmp_path, monkeypatch, failing, step):
    monkeypatch.setenv("FAKE_FAIL", failing)
    out = tmp_path / "engines"
    with pytest.raises(StepFailed) as exc:
        _run(fake_tools, out)
    text = str(exc.value)
    assert f"step '{step}' failed" in text and "command:" in text
    assert ("CUDA out of memory" if failing == "quantize" else "Engine building failed") in text
    assert exc.value.log_path.is_file()
    monkeypatch.delenv("FAKE_FAIL")
    _run(fake_tools, out)  # the half-made dir is replaced
    assert (out / "target" / "manifest.json").is_file()


@pytest.mark.parametrize(
    "version,on_path,build_module,why",
    [
        ("1.3.0rc21", True, None, "has no TensorRT engine backend"),
        ("1.3.0", True, None, "has no TensorRT engine backend"),
        ("2.0.0", False, False, "has no TensorRT engine backend"),
        ("1.3.0rc20", False, False, "has no trtllm-build"),  # tensorrt_llm/commands/build.py gone
        ("1.2.1", False, True, "trtllm-build is not on PATH"),
    ],
)
def test_real_build_stops_before_any_work_without_the_engine_backend(
    fake_tools, tmp_path, monkeypatch, version, on_path, build_module, why
):
    """Nothing planned, printed or written: one sentence naming the release and the image to use."""
    location = "/fake"
    if build_module is not None:
        package = tmp_path / "site-packages" / "tensorrt_llm"
        (package / "commands").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        if build_module:
            (package / "commands" / "build.py").write_text("")
        location = str(package)
    monkeypatch.setattr(environment, "installed_trtllm", lambda: Package("tensorrt_llm", version, location))
    if not on_path:
        bin_dir = str(tmp_path / "bin")
        monkeypatch.setenv("PATH", os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != bin_dir))
        if shutil.which("trtllm-build"):
            pytest.skip("this machine has a trtllm-build of its own")
    buffer = io.StringIO()
    with pytest.raises(trtllm.BuildPlanError) as exc:
        run_build(fake_tools, tmp_path / "engines", console=Console(file=buffer, width=200))
    text = str(exc.value)
    assert why in text and "\n" not in text and text.endswith(".")
    assert "TensorRT-LLM 1.2.1" in text and environment.CONTAINER_IMAGE in text
    assert buffer.getvalue() == "" and not (tmp_path / "engines").exists()


def test_real_build_on_a_1_3_pre_release_with_the_backend_says_it_is_outside_the_line(
    fake_tools, tmp_path, monkeypatch
):
    monkeypatch.setattr(environment, "installed_trtllm", lambda: Package("tensorrt_llm", "1.3.0rc20", "/fake"))
    monkeypatch.setenv("FAKE_TRTLLM_VERSION", "1.3.0rc20")  # a trtllm-build writes its own release into the engine
    log = _run(fake_tools, tmp_path / "engines")
    assert "note: TensorRT-LLM 1.3.0rc20 is a pre-release outside trtspec's production line (1.2.x)" in log
    assert (tmp_path / "engines" / "target" / "manifest.json").is_file()


def test_real_build_refuses_a_pair_that_does_not_fit(fake_tools, tmp_path, monkeypatch):
    gpus = [Gpu(i, "NVIDIA L4", 23034 / 1024, 89, "nvidia-smi") for i in range(4)]
    monkeypatch.setattr(environment, "detect_gpus", lambda: environment.GpuReport(gpus))
    with pytest.raises(trtllm.BuildPlanError, match=r"do not fit the GPUs:\n  - GPU 0 \(NVIDIA L4, 22.5 GiB\) needs"):
        _run(fake_tools, tmp_path / "engines")


def test_calibration_set_is_a_hub_name_or_a_local_directory(tmp_path):
    """quantize.py fetches cnn_dailymail from the Hub; a build host without it needs a local directory, and a single
    file is refused there with NotImplementedError, so it is refused here first."""
    from trtspec.config import ConfigError

    config = yaml.safe_load(EXAMPLES["70b"].read_text())
    data = tmp_path / "calib"
    data.mkdir()
    (data / "train.jsonl").write_text('{"text": "calibration text"}\n')
    config["calibration"] = {"dataset": "calib"}  # relative to the config file
    path = _write_example(tmp_path, config)
    plan = trtllm.plan(load_config(path, plan_only=True), tmp_path / "out")
    quantize = next(s for s in plan.steps if s.kind == "checkpoint")
    assert quantize.argv[quantize.argv.index("--calib_dataset") + 1] == str(data)
    config["calibration"] = {"dataset": "calib/train.jsonl"}
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match="calibration.dataset.*is a file"):
        load_config(path, plan_only=True)
    config["calibration"] = {"dataset": "cnn_dailymail"}
    path.write_text(yaml.safe_dump(config))
    console = Console(record=True, width=200)
    trtllm.print_plan(trtllm.plan(load_config(path, plan_only=True), tmp_path / "out"), console)
    assert "from the Hugging Face Hub" in console.export_text()
