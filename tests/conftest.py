"""Shared fixtures: one tiny draft/target pair and its engines, made once per test session.

The pair shares one BPE tokenizer (same corpus, same size): a 2-layer Llama target and a 1-layer Qwen2
draft, both float32. Engines are built once with FP8 (target per tensor, draft per channel) and once
unquantized; tests that change builds work on their own copies.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# Every server the tests start restricts Triton's admin APIs to an admin key (trtspec.keys). One key for the session,
# in the environment, where both the servers and the clients (SpecClient, `trtspec` subprocesses) read it; generated
# keys go to a state directory of the session's own, never the user's. Tests of the generated key unset the variable.
os.environ["TRTSPEC_ADMIN_KEY"] = secrets.token_urlsafe(24)
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="trtspec-test-state-")
atexit.register(shutil.rmtree, os.environ["XDG_STATE_HOME"], ignore_errors=True)

# The tiny models' matrices are 64 wide: one thread is fastest, and with other processes on this 2-core
# machine a second thread makes every op wait for a busy core (10x slower under load).
torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))

from support.tiny import make_checkpoint, write_config  # noqa: E402

MAX_DRAFT_LEN = 4
MAX_INPUT_LEN = 64
MAX_SEQ_LEN = 96
# the tests read both kinds of logits, which an engine returns only when built for them
ENGINE = {
    "max_input_len": MAX_INPUT_LEN,
    "max_seq_len": MAX_SEQ_LEN,
    "max_batch_size": 4,
    "gather_context_logits": True,
    "gather_generation_logits": True,
}
SPECULATION = {"max_draft_len": MAX_DRAFT_LEN, "num_draft_tokens": 3}


@dataclass
class TinyPair:
    root: Path
    target: Path
    draft: Path


@dataclass
class Built:
    config: Path
    engines: Path

    @property
    def target(self) -> Path:
        return self.engines / "target"

    @property
    def draft(self) -> Path:
        return self.engines / "draft"


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> TinyPair:
    root = tmp_path_factory.mktemp("tiny")
    target = make_checkpoint(root / "target", layers=2, seed=0)
    draft = make_checkpoint(root / "draft", layers=1, seed=1, architecture="qwen2")
    return TinyPair(root, target, draft)


def _build(tiny_pair: TinyPair, name: str, target: dict, draft: dict) -> Built:
    from trtspec.compile import run_build

    folder = tiny_pair.root / name
    folder.mkdir()
    config = write_config(
        folder / "build.yaml",
        tiny_pair.target,
        tiny_pair.draft,
        name=name,
        target=target,
        draft=draft,
        speculation=SPECULATION,
        engine=ENGINE,
    )
    engines = run_build(config, folder / "engines")
    return Built(config, engines)


@pytest.fixture(scope="session")
def built_fp8(tiny_pair) -> Built:
    """FP8 engines: the target scaled per tensor, the draft per channel."""
    return _build(
        tiny_pair,
        "fp8",
        {"quantization": "fp8", "fp8_scaling": "per_tensor"},
        {"quantization": "fp8", "fp8_scaling": "per_channel"},
    )


@pytest.fixture(scope="session")
def built_fp8_head(tiny_pair) -> Built:
    """FP8 engines with the output head in FP8 too (quantize_lm_head): per channel on the target, per tensor on the
    draft."""
    return _build(
        tiny_pair,
        "fp8-head",
        {"quantization": "fp8", "fp8_scaling": "per_channel", "quantize_lm_head": True},
        {"quantization": "fp8", "quantize_lm_head": True},
    )


@pytest.fixture(scope="session")
def built_none(tiny_pair) -> Built:
    """Unquantized float32 engines: the same weights as the checkpoints."""
    return _build(
        tiny_pair,
        "none",
        {"quantization": "none", "kv_cache_dtype": "auto"},
        {"quantization": "none", "kv_cache_dtype": "auto"},
    )


# ---- the model repository and a real Triton server on it -----------------------------------------------------

# The models the shared server loads (explicit model control): everything but the BLS, whose adapter is tested
# on its own. Add "tensorrt_llm_bls" here once a test needs it served.
SERVED_MODELS = ("preprocessing", "postprocessing", "tensorrt_llm", "tensorrt_llm_draft", "ensemble")


@pytest.fixture(scope="session")
def model_repository(built_fp8, tmp_path_factory) -> Path:
    """`trtspec deploy` of the FP8 engines (engine models on CPU). Read-only: tests that break it copy it."""
    from trtspec.config import load_config
    from trtspec.deploy.writer import write_repository

    out = tmp_path_factory.mktemp("deploy") / "model_repository"
    return write_repository(load_config(built_fp8.config), built_fp8.engines, out, device="cpu")


@pytest.fixture(scope="session")
def unary_repository(built_fp8, tmp_path_factory) -> Path:
    """`trtspec deploy --decoupled-mode false` of the same engines: unary engine models, which plain infer over HTTP
    and gRPC reaches (the default, decoupled, is served in test_serving.py, test_nvidia_clients.py,
    test_reliability.py)."""
    from trtspec.config import load_config
    from trtspec.deploy.writer import write_repository

    out = tmp_path_factory.mktemp("deploy-unary") / "model_repository"
    return write_repository(
        load_config(built_fp8.config), built_fp8.engines, out, device="cpu", overrides={"decoupled_mode": False}
    )


def free_ports(count: int) -> list[int]:
    from trtspec.server import free_port

    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


@pytest.fixture(scope="session")
def triton_server(unary_repository):
    """A real tritonserver serving SERVED_MODELS of `unary_repository` on free loopback ports.

    Close the clients you open on it: the server waits for open keep-alive connections when it stops."""
    from trtspec.server import TritonServer

    http, grpc, metrics = free_ports(3)
    server = TritonServer(
        unary_repository,
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        model_control_explicit_models=SERVED_MODELS,
    )
    with server:
        yield server


# `pytest -m "not server"` is the quick loop: the tests below need no Triton server. A test is marked `server`
# when it uses one of these fixtures or carries the mark itself; the guard under it fails any unmarked test that
# starts a server, so the quick loop cannot silently grow slow.
SERVER_FIXTURES = {
    "triton_server",
    "bench_server",
    "unary_models",
    "default_models",
    "server",
    "scraped",
    "triton",
    "small_kv_server",
    "spec_server",
    "llama3_ends",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.server)


_running: list = [None]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running[0] = item
    try:
        return (yield)
    finally:
        _running[0] = None


@pytest.fixture(scope="session", autouse=True)
def _server_tests_are_marked():
    from trtspec.server import TritonServer

    start = TritonServer.start

    def guarded(self, *args, **kwargs):
        item = _running[0]
        if item is not None and item.get_closest_marker("server") is None:
            pytest.fail(
                f"{item.nodeid} starts a Triton server: mark it @pytest.mark.server, or name its fixture in "
                f"SERVER_FIXTURES (tests/conftest.py)",
                pytrace=False,
            )
        return start(self, *args, **kwargs)

    TritonServer.start = guarded
    yield
    TritonServer.start = start
