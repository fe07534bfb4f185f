"""Engine checks on engine dirs written from TensorRT-LLM's documented layout (a good pair, one broken dir per check,
the embedded backend's dirs), and the trtllm deployment: the tensorrtllm model configs, the orchestrator-mode
launch, the Kubernetes manifests (checked against the Kubernetes schemas) and the Dockerfile (hadolint)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from google.protobuf import text_format
from support.trtllm_layout import engine_config, hf_config, write_checkpoint, write_engine
from tritonclient.grpc import model_config_pb2

from trtspec import environment
from trtspec.cli import cli
from trtspec.compile import trtllm
from trtspec.config import load_config
from trtspec.deploy.checks import validate_repository
from trtspec.deploy.launch import Launch, repository_launch
from trtspec.deploy.writer import write_repository
from trtspec.engine.validate import Expected, validate_engines
from trtspec.environment import Package
from trtspec.serving_settings import CONCURRENT_REQUESTS_PER_BATCH_SLOT

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_70B = ROOT / "build_configs" / "llama-3.1-70b_llama-3.2-1b_4xh100.yaml"
FP8 = Expected("FP8", "FP8", check_quantization=True)


@pytest.fixture(autouse=True)
def no_trtllm(monkeypatch):
    monkeypatch.setattr(environment, "installed_trtllm", lambda: Package("tensorrt_llm", None, None))


def target_config(**kw):
    return engine_config(role="target", hf=hf_config("Llama-3.1-70B-Instruct"), tp_size=4, **kw)


def draft_config(**kw):
    return engine_config(role="draft", hf=hf_config("Llama-3.2-1B-Instruct"), max_seq_len=8202, **kw)


@pytest.fixture
def pair(tmp_path):
    return write_engine(tmp_path / "target", target_config()), write_engine(tmp_path / "draft", draft_config())


def check(pair, **kw):
    kw.setdefault("num_draft_tokens", 4)
    kw.setdefault("expect", {"target": FP8, "draft": FP8})
    kw.setdefault("runtime_version", "1.2.1")
    return validate_engines(*pair, **kw)


def edit_config(path: Path, fn) -> None:
    config = json.loads((path / "config.json").read_text())
    fn(config)
    (path / "config.json").write_text(json.dumps(config))


# ---- engine checks -------------------------------------------------------------------------------------------


def test_good_pair_passes(pair):
    assert check(pair) == []
    assert check(pair, runtime_version=None, num_draft_tokens=10) == []


BREAKS = {
    # name: (role, how to break it, the failing check's field, a phrase of its message)
    "no config.json": ("target", lambda p: (p / "config.json").unlink(), "target layout", "config.json is missing"),
    "not the layout": (
        "draft",
        lambda p: edit_config(p, lambda c: c.pop("build_config")),
        "draft layout",
        "missing 'build_config",
    ),
    "missing rank": ("target", lambda p: (p / "rank3.engine").unlink(), "target rank files", "rank3.engine is missing"),
    "extra rank": (
        "draft",
        lambda p: (p / "rank1.engine").write_bytes(b"x"),
        "draft rank files",
        "beyond mapping.world_size 1",
    ),
    "no spec mode": (
        "target",
        lambda p: edit_config(p, lambda c: c["build_config"].update(speculative_decoding_mode=1)),
        "target build_config.speculative_decoding_mode",
        "DRAFT_TOKENS_EXTERNAL",
    ),
    "short draft len": (
        "target",
        lambda p: edit_config(p, lambda c: c["build_config"].update(max_draft_len=3)),
        "target build_config.max_draft_len",
        "at least 4",
    ),
    "context logits": (
        "target",
        lambda p: edit_config(p, lambda c: c["build_config"].update(gather_context_logits=True)),
        "target build_config.gather_context_logits",
        "not supported with max_draft_len > 0",
    ),
    "draft drafts": (
        "draft",
        lambda p: edit_config(p, lambda c: c["build_config"].update(max_draft_len=4)),
        "draft max_draft_len",
        "must be 0",
    ),
    "no paged context fmha": (
        "draft",
        lambda p: edit_config(p, lambda c: c["build_config"]["plugin_config"].update(use_paged_context_fmha=False)),
        "draft plugin_config.use_paged_context_fmha",
        "paged context FMHA",
    ),
    "contiguous kv": (
        "target",
        lambda p: edit_config(p, lambda c: c["build_config"].update(kv_cache_type="CONTINUOUS")),
        "target build_config.kv_cache_type",
        "must be PAGED",
    ),
    "not fp8": (
        "target",
        lambda p: edit_config(p, lambda c: c["pretrained_config"]["quantization"].update(quant_algo=None)),
        "target pretrained_config.quantization.quant_algo",
        "asks for FP8",
    ),
    "not fp8 kv": (
        "draft",
        lambda p: edit_config(p, lambda c: c["pretrained_config"]["quantization"].update(kv_cache_quant_algo=None)),
        "draft pretrained_config.quantization.kv_cache_quant_algo",
        "asks for FP8",
    ),
    "weakly typed": (
        "target",
        lambda p: edit_config(p, lambda c: c["build_config"].update(strongly_typed=False)),
        "target build_config.strongly_typed",
        "strongly typed",
    ),
    "other release": (
        "draft",
        lambda p: edit_config(p, lambda c: c.update(version="1.2.0")),
        "draft version",
        "differs from the installed TensorRT-LLM 1.2.1",
    ),
    "too old": (
        "target",
        lambda p: edit_config(p, lambda c: c.update(version="0.19.0")),
        "target version",
        "older than 0.20.0",
    ),
    "other backend": (
        "draft",
        lambda p: edit_config(p, lambda c: c.update(trtspec={"backend": "torch"})),
        "draft backend",
        "differs from the target",
    ),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_each_broken_dir_fails_its_check(pair, name):
    role, breaker, field, phrase = BREAKS[name]
    breaker(pair[0] if role == "target" else pair[1])
    problems = check(pair)
    assert problems, name
    assert any(p.field == field and phrase in str(p) for p in problems), [str(p) for p in problems]


def test_draft_logits_need_generation_logits_and_equal_vocabs(pair, tmp_path):
    assert any(p.field == "target build_config.gather_generation_logits" for p in check(pair, use_draft_logits=True))
    t = write_engine(tmp_path / "t2", target_config(gather_generation_logits=True))
    d = write_engine(tmp_path / "d2", draft_config(gather_generation_logits=True, vocab_size=128000))
    problems = check((t, d), use_draft_logits=True)
    assert [p.field for p in problems] == ["draft pretrained_config.vocab_size"]
    assert check((t, d)) == []  # token matching needs equal ids, not equal vocab sizes
    # ModelOpt's export of a bf16 model: float16 logits, which the backend would refuse against the declared FP32
    edit_config(
        d,
        lambda c: c["pretrained_config"].update(
            logits_dtype="float16", vocab_size=c["pretrained_config"]["vocab_size"]
        ),
    )
    t3 = write_engine(tmp_path / "t3", target_config(gather_generation_logits=True))
    d3 = write_engine(tmp_path / "d3", draft_config(gather_generation_logits=True))
    edit_config(d3, lambda c: c["pretrained_config"].update(logits_dtype="float16"))
    problems = check((t3, d3), use_draft_logits=True)
    assert [p.field for p in problems] == ["draft pretrained_config.logits_dtype"]
    assert "--logits_dtype float32" in str(problems[0])
    assert check((t3, d3)) == []  # without draft logits no logits are served


def test_cli_names_every_failed_check(pair):
    edit_config(pair[0], lambda c: c["build_config"].update(max_draft_len=2, gather_context_logits=True))
    (pair[1] / "rank0.engine").unlink()
    result = CliRunner().invoke(
        cli, ["validate", "engines", "--target", str(pair[0]), "--draft", str(pair[1]), "--num-draft-tokens", "4"]
    )
    assert result.exit_code == 1
    assert "3 problems" in result.output
    for field in ("target build_config.max_draft_len", "target build_config.gather_context_logits", "draft rank files"):
        assert field in result.output
    result = CliRunner().invoke(cli, ["validate", "engines", "--target", str(pair[0])])
    assert result.exit_code == 1 and "1 problem" in result.output


def test_embedded_engine_dirs_pass_and_fail_the_same_checks(built_fp8, tmp_path):
    result = CliRunner().invoke(
        cli,
        [
            "validate",
            "engines",
            "--target",
            str(built_fp8.target),
            "--draft",
            str(built_fp8.draft),
            "--num-draft-tokens",
            "3",
            "-c",
            str(built_fp8.config),
        ],
    )
    assert result.exit_code == 0, result.output
    broken = Path(shutil.copytree(built_fp8.draft, tmp_path / "draft"))
    (broken / "rank0.safetensors").unlink()
    problems = validate_engines(built_fp8.target, broken, num_draft_tokens=5)
    assert {p.field for p in problems} == {"draft rank files", "target build_config.max_draft_len"}


# ---- deploying trtllm engines -----------------------------------------------------------------------------------


@pytest.fixture
def deployed(tmp_path):
    """The 70B example deployed on engine dirs from the layout (with the manifest `trtspec build` writes)."""
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    config = yaml.safe_load(EXAMPLE_70B.read_text())
    for role, name in (("target", "Llama-3.1-70B-Instruct"), ("draft", "Llama-3.2-1B-Instruct")):
        config[role]["checkpoint"] = str(write_checkpoint(tmp_path / "hf" / role, name, weights=True, tokenizer=tok))
        config[role].pop("hf_config")
    path = tmp_path / "build.yaml"
    path.write_text(yaml.safe_dump(config))
    engines = tmp_path / "volume" / "engines"
    for role, cfg in (("target", target_config()), ("draft", draft_config())):
        write_engine(engines / role, cfg, tokenizer=tok)
        (engines / role / "manifest.json").write_text(
            json.dumps({"backend": "trtllm", "limits": {"max_input_len": 4096, "max_seq_len": 8192}})
        )
    return path, engines, tmp_path / "volume" / "model_repository"


def parse(repo: Path, model: str):
    return text_format.Parse((repo / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def params(config) -> dict:
    return {k: v.string_value for k, v in config.parameters.items()}


def test_deploy_writes_tensorrtllm_models_that_validate(deployed, tmp_path):
    config, engines, repo = deployed
    result = CliRunner().invoke(
        cli,
        [
            "deploy",
            "-c",
            str(config),
            "--engines",
            str(engines),
            "--repo",
            str(repo),
            "--k8s",
            str(tmp_path / "k8s"),
            "--image",
            "registry.example/trtspec:0.1.0",
        ],
    )
    assert result.exit_code == 0, result.output
    assert validate_repository(repo) == []
    target, draft, bls = parse(repo, "tensorrt_llm"), parse(repo, "tensorrt_llm_draft"), parse(repo, "tensorrt_llm_bls")
    assert target.backend == draft.backend == "tensorrtllm" and target.model_transaction_policy.decoupled
    assert not (repo / "tensorrt_llm" / "1" / "model.py").exists()
    t, d = params(target), params(draft)
    assert t["gpt_model_path"] == str(engines / "target") and d["gpt_model_path"] == str(engines / "draft")
    for p in (t, d):
        assert p["gpt_model_type"] == "inflight_fused_batching" and p["enable_kv_cache_reuse"] == "true"
        assert p["exclude_input_in_output"] == "false" and p["enable_chunked_context"] == "true"
        # read with no fallback by the backend at load; empty: no guided decoding
        assert p["tokenizer_dir"] == p["guided_decoding_backend"] == p["xgrammar_tokenizer_info_path"] == ""
        assert "logits_datatype" not in p and "encoder_input_features_data_type" not in p  # not backend parameters
        assert "participant_ids" not in p
        # orchestrator mode: the executor's receiving thread sleeps between polls instead of spinning a core
        # (model_instance_state.cc: "recv_poll_period_ms is not set, will use busy loop")
        assert p["recv_poll_period_ms"] == "1"
    assert t["gpu_device_ids"] == "0,1,2,3" and d["gpu_device_ids"] == "0"
    # they share GPU 0: each is capped at its share of what the engines leave free there (trtspec.compile.memory), the
    # same as the build's plan, far beyond the bare 16 x 8224 tokens; the fractions keep the caps binding
    plan = trtllm.plan(load_config(config), tmp_path / "plan", check_existing=False).memory
    planned = {e.role: e.kv_cap_tokens for e in plan.engines}
    assert t["max_tokens_in_paged_kv_cache"] == str(planned["target"]) and int(planned["target"]) >= 5 * 16 * 8224
    assert d["max_tokens_in_paged_kv_cache"] == str(planned["draft"])
    fractions = plan.kv_fractions()
    assert float(t["kv_cache_free_gpu_mem_fraction"]) == fractions["target"]
    assert float(d["kv_cache_free_gpu_mem_fraction"]) == fractions["draft"]
    # the BLS serves twice the target's batch at once: what the cache keeps between their calls
    assert params(bls)["max_concurrent_requests"] == str(CONCURRENT_REQUESTS_PER_BATCH_SLOT * 16) == "32"
    assert params(bls)["max_input_len"] == "4096"  # the prompt limit, not the engines' 8191
    # GPU 0 holds both engines (their files and 2 GiB each) and 0.9 of the rest as KV cache: the GPU-memory alerts
    # fire above this plan, not at the level the KV reservation reaches at start
    from trtspec.compile.memory import GIB, RUNTIME_OVERHEAD_GIB

    held = (
        sum((engines / role / "rank0.engine").stat().st_size for role in ("target", "draft"))
        + 2 * RUNTIME_OVERHEAD_GIB * GIB
    )
    total = environment.GPU_TYPES[load_config(config).config.gpu.type].memory_gib * GIB
    assert float(params(bls)["gpu_memory_planned_fraction"]) == pytest.approx(1 - 0.1 * (1 - held / total), abs=1e-4)
    launch = repository_launch(repo)
    assert launch == Launch(
        mpi=True,
        world_size=1,
        spawn_processes=True,
        engine_models=["tensorrt_llm", "tensorrt_llm_draft"],
        devices=[0, 1, 2, 3],
    )
    assert launch.gpus == 4


def test_serve_prints_the_orchestrator_command(deployed, tmp_path):
    config, engines, repo = deployed
    write_repository(load_config(config), engines, repo)
    binary = tmp_path / "tritonserver"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    result = CliRunner().invoke(cli, ["serve", "--repo", str(repo), "--print-command", "--tritonserver", str(binary)])
    assert result.exit_code == 0, result.output
    line = result.output.strip()
    as_root = " --allow-run-as-root" if os.geteuid() == 0 else ""  # OpenMPI wants it only as root
    # the BLS reads the target's KV-cache blocks from the server's metrics (trtspec.triton.kv_watch)
    # and the costs measured at start from the file the BLS polls (trtspec.calibration)
    prefix = (
        "TRTLLM_ORCHESTRATOR=1 TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES=1 "
        "TRTSPEC_METRICS_URL=http://127.0.0.1:8002/metrics TRTSPEC_CALIBRATION_FILE="
    )
    assert line.startswith(prefix), line
    calibration, rest = line[len(prefix) :].split(" ", 1)
    assert calibration.endswith("/calibration.json")
    assert rest.startswith(f"mpirun{as_root} -n 1 {binary} --model-repository {repo}")
    # launch_triton_server.py's flags for a spawning multi-model server: no memory pools on the engines' GPUs
    assert line.endswith(
        "--pinned-memory-pool-byte-size=0 --enable-peer-access=false "
        + " ".join(f"--cuda-memory-pool-byte-size={g}:0" for g in range(4))
        + " --disable-auto-complete-config --backend-config=python,shm-region-prefix-name=prefix0_"
    )


def test_validate_repo_refuses_a_busy_looping_orchestrator(deployed):
    config, engines, repo = deployed
    write_repository(load_config(config), engines, repo)
    path = repo / "tensorrt_llm_draft" / "config.pbtxt"
    path.write_text(path.read_text().replace('key: "recv_poll_period_ms"', 'key: "unused_poll"'))
    assert [p.field for p in validate_repository(repo)] == [
        "tensorrt_llm_draft/config.pbtxt parameter recv_poll_period_ms"
    ]


def test_memory_pools_are_switched_off_on_the_placements_own_gpus(deployed, tmp_path):
    config_path, engines, repo = deployed
    config = yaml.safe_load(config_path.read_text())
    config["gpu"].update(count=8, target_devices=[4, 5, 6, 7], draft_devices=[4])
    config_path.write_text(yaml.safe_dump(config))
    write_repository(load_config(config_path), engines, repo)
    cmd = repository_launch(repo).command(["tritonserver", "--model-repository", "R"])
    assert [a for a in cmd if a.startswith("--cuda-memory-pool-byte-size")] == [
        f"--cuda-memory-pool-byte-size={g}:0" for g in (4, 5, 6, 7)
    ]
    # a marker written before the ids were kept names a count: GPUs 0..n-1, as it was launched then
    assert Launch.from_dict({"mpi": True, "gpus": 2}).devices == [0, 1]


def test_fast_logits_launch_runs_one_server_per_rank(deployed, tmp_path):
    config_path, engines, repo = deployed
    config = yaml.safe_load(config_path.read_text())
    config["speculation"]["use_draft_logits"] = True
    config["gpu"]["fast_logits"] = True
    config_path.write_text(yaml.safe_dump(config))
    for role in ("target", "draft"):
        edit_config(engines / role, lambda c: c["build_config"].update(gather_generation_logits=True))
    write_repository(load_config(config_path), engines, repo)
    assert validate_repository(repo) == []
    t, d = params(parse(repo, "tensorrt_llm")), params(parse(repo, "tensorrt_llm_draft"))
    assert (d["participant_ids"], t["participant_ids"]) == ("1", "2,3,4,5")
    assert t["speculative_decoding_fast_logits"] == d["speculative_decoding_fast_logits"] == "1"
    launch = repository_launch(repo)
    assert (launch.world_size, launch.spawn_processes, launch.env["TRTLLM_ORCHESTRATOR_SPAWN_PROCESSES"]) == (
        6,
        False,
        "0",
    )
    cmd = launch.command(["tritonserver", "--model-repository", "R"])
    assert cmd.count(":") == 5 and cmd.count("--model-control-mode=explicit") == 5
    assert "--pinned-memory-pool-byte-size=0" not in cmd  # NVIDIA's script adds them only when spawning
    assert cmd[-8:] == [
        "--model-control-mode=explicit",
        "--load-model=tensorrt_llm",
        "--load-model=tensorrt_llm_draft",
        # only rank 0 serves: the others would try its ports (tests/test_mpi_ranks.py)
        "--allow-http=false",
        "--allow-grpc=false",
        "--allow-metrics=false",
        "--disable-auto-complete-config",
        "--backend-config=python,shm-region-prefix-name=prefix5_",
    ]
    assert cmd.count("--allow-http=false") == 5 and cmd.index("--allow-http=false") > cmd.index(":")


def test_kubernetes_manifests_validate_against_the_schemas(deployed, tmp_path):
    import kubernetes_validate

    config, engines, repo = deployed
    out = tmp_path / "k8s"
    result = CliRunner().invoke(
        cli, ["deploy", "-c", str(config), "--engines", str(engines), "--repo", str(repo), "--k8s", str(out)]
    )
    assert result.exit_code == 0, result.output
    docs = {p.name: yaml.safe_load(p.read_text()) for p in sorted(out.glob("*.yaml"))}
    assert sorted(docs) == [
        "deployment.yaml",
        "grafana-dashboard.yaml",
        "hpa.yaml",
        "networkpolicy.yaml",
        "prometheus-adapter.yaml",
        "prometheusrule.yaml",
        "service.yaml",
        "servicemonitor.yaml",
    ]
    for doc in docs.values():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            _validate_prometheus_operator(doc)  # not in the core schemas
        else:
            kubernetes_validate.validate(doc, "1.30.0", strict=True)  # raises on any schema error
    from trtspec.deploy.monitoring import dashboard, rules

    service, monitor = docs["service.yaml"], docs["servicemonitor.yaml"]
    assert (
        monitor["kind"] == "ServiceMonitor"
        and monitor["spec"]["selector"]["matchLabels"] == service["metadata"]["labels"]
    )
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert docs["prometheusrule.yaml"]["kind"] == "PrometheusRule" and docs["prometheusrule.yaml"]["spec"] == rules()
    board = docs["grafana-dashboard.yaml"]
    assert (
        board["metadata"]["labels"]["grafana_dashboard"] == "1"
        and json.loads(board["data"]["trtspec.json"]) == dashboard()
    )
    adapter = yaml.safe_load(docs["prometheus-adapter.yaml"]["data"]["config.yaml"])["rules"][0]
    assert adapter["name"]["as"] == docs["hpa.yaml"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    pod = docs["deployment.yaml"]["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    # Triton's /v2/health/ready is on the pod's loopback: the probes ask the front's unauthenticated /health, and
    # whether to restart, /health/live
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8002"
    assert container["args"][:3] == ["serve", "--repo", str(repo)]
    assert container["volumeMounts"][0]["mountPath"] == str(tmp_path / "volume")
    assert docs["hpa.yaml"]["spec"]["metrics"][0]["pods"]["metric"]["name"] == "nv_inference_pending_request_count"
    assert {p["port"] for p in docs["service.yaml"]["spec"]["ports"]} == {9000, 8002}  # the front and the metrics


def _validate_prometheus_operator(doc: dict) -> None:
    """Strictly against the prometheus-operator's CRD schemas (cloudcoil's models are generated from them): every
    field of the right type (no coercion), and none unknown (the models drop unknown fields, so a round trip must
    give the document back)."""
    from cloudcoil.models.prometheus_operator import v1

    model = getattr(v1, doc["kind"]).model_validate(doc, strict=True)
    assert model.model_dump(mode="json", by_alias=True, exclude_unset=True) == doc, f"{doc['kind']}: unknown fields"


def test_the_prometheus_operator_check_finds_what_its_schema_refuses():
    from pydantic import ValidationError

    from trtspec.deploy.monitoring import rules

    good = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "r"},
        "spec": rules(),
    }
    _validate_prometheus_operator(good)
    unknown = json.loads(json.dumps(good))
    unknown["spec"]["groups"][1]["rules"][0]["severity"] = "critical"  # belongs under labels
    with pytest.raises(AssertionError, match="unknown fields"):
        _validate_prometheus_operator(unknown)
    wrong = json.loads(json.dumps(good))
    wrong["spec"]["groups"][1]["rules"][0]["labels"] = ["severity"]
    with pytest.raises(ValidationError):
        _validate_prometheus_operator(wrong)


def test_dockerfile_passes_hadolint_and_uses_the_pinned_container():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    dockerfile = ROOT / "docker" / "Dockerfile"
    result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"ARG BASE_IMAGE={environment.CONTAINER_IMAGE}\n" in dockerfile.read_text()


def test_a_single_gpu_target_alone_is_served_without_mpi(tmp_path):
    config = yaml.safe_load(EXAMPLE_70B.read_text())
    config.pop("draft")
    config["speculation"]["method"] = "prompt_lookup"
    config["target"]["tp_size"] = 1
    config["gpu"] = {"type": "H200", "count": 1}
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps({"model": {"vocab": {"a": 0}}}))
    config["target"]["checkpoint"] = str(
        write_checkpoint(tmp_path / "hf", "Llama-3.1-70B-Instruct", weights=True, tokenizer=tok)
    )
    path = tmp_path / "build.yaml"
    path.write_text(yaml.safe_dump(config))
    engines = tmp_path / "engines"
    write_engine(
        engines / "target", engine_config(role="target", hf=hf_config("Llama-3.1-70B-Instruct")), tokenizer=tok
    )
    repo = write_repository(load_config(path), engines, tmp_path / "repo")
    assert validate_repository(repo) == []
    assert repository_launch(repo) is None
    t = params(parse(repo, "tensorrt_llm"))
    assert t["kv_cache_free_gpu_mem_fraction"] == "0.9" and "max_tokens_in_paged_kv_cache" not in t


def test_serve_waits_for_models_as_long_as_their_engines_need(deployed, tmp_path):
    """180 s is not enough to load a 405B pair: the wait grows with the backend and the engines' bytes, and the
    Kubernetes startup probe waits at least as long."""
    from trtspec.server import START_BASE_SECONDS, START_READ_BYTES_PER_SECOND, start_timeout_for

    config, engines, repo = deployed
    with open(engines / "target" / "rank0.engine", "wb") as f:  # sparse: 50 GB of engine without the disk
        f.truncate(50 * 10**9)
    write_repository(load_config(config), engines, repo)
    size = sum(p.stat().st_size for d in ("target", "draft") for p in (engines / d).rglob("*") if p.is_file())
    wait = start_timeout_for(repo)
    assert wait == pytest.approx(START_BASE_SECONDS["trtllm"] + size / START_READ_BYTES_PER_SECOND)
    assert wait > 600 + 199
    assert start_timeout_for(tmp_path) == START_BASE_SECONDS["torch"]  # not a trtspec repository
    from trtspec.deploy.k8s import manifests

    container = manifests(load_config(config), repo, image="i", pvc="p")["deployment.yaml"]["spec"]["template"]["spec"][
        "containers"
    ][0]
    probe = container["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= max(wait, 1800)
    # a model the BLS is loading again after its process died is given as long before the pod is restarted: the
    # front's /health/live counts that time (trtspec.openai_api.liveness), `serve` gives it the same wait
    probe = container["livenessProbe"]
    assert probe["httpGet"]["path"] == "/health/live" and probe["periodSeconds"] * probe["failureThreshold"] <= 120


def test_validate_repo_finds_what_the_tensorrtllm_backend_would_refuse(deployed):
    """The parameters the backend reads with no fallback, and the perf outputs it writes undeclared or not."""
    config, engines, repo = deployed
    write_repository(load_config(config), engines, repo)
    path = repo / "tensorrt_llm" / "config.pbtxt"
    text = path.read_text()
    broken = "\n".join(
        line for line in text.splitlines() if '"tokenizer_dir"' not in line and "first_token_time_ns" not in line
    )
    path.write_text(broken.replace('"inflight_fused_batching"', '"batched"'))
    problems = [str(p) for p in validate_repository(repo)]
    assert any("parameter tokenizer_dir" in p and "fails without it" in p for p in problems), problems
    assert any("parameter gpt_model_type" in p and "'batched'" in p for p in problems), problems
    assert any("first_token_time_ns" in p and "return_perf_metrics" in p for p in problems), problems
