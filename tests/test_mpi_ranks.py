"""The ranks of a fast-logits launch (`gpu.fast_logits`: one tritonserver per MPI rank on one host).

Every rank is started with the server's own arguments, ports included, as TensorRT-LLM's
`triton_backend/scripts/launch_triton_server.py` does (0a2e2c1f, `add_port_config` for every rank). There the
tensorrtllm backend keeps a worker rank inside its model's load until the orchestrator ends
(`model_instance_state.cc`, 0c8de69a: `mExecutor->shutdown()` then `exit(0)`), and tritonserver opens its endpoints
only after the models load (`src/main.cc`: `TRITONSERVER_ServerNew`, then `StartEndpoints`), so those ports stay
unbound. A rank that does finish loading must not try them: it would fail to bind rank 0's ports and exit, and with
it the MPI job. So ranks >= 1 open no endpoint at all; rank 0 keeps every flag, the admin restrictions included.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from trtspec.deploy.launch import DRAFT_MODEL, TARGET_MODEL, Launch
from trtspec.server import CPU_ENGINE_ENV, TritonServer
from trtspec.server_binary import find_tritonserver

NO_ENDPOINTS = ["--allow-http=false", "--allow-grpc=false", "--allow-metrics=false"]


def fast_logits_launch(world_size: int = 3) -> Launch:
    return Launch(
        mpi=True,
        world_size=world_size,
        spawn_processes=False,
        engine_models=[TARGET_MODEL, DRAFT_MODEL],
        devices=[0, 1],
    )


def ranks(cmd: list[str]) -> list[list[str]]:
    """Each rank's tritonserver arguments of an mpirun command (`-n 1 <args> : -n 1 <args> ...`)."""
    assert cmd[0] == "mpirun"
    parts, current = [], None
    for arg in cmd[1:]:
        if arg == ":":
            parts.append(current)
            current = None
        elif current is None and arg == "-n":
            current = []
        elif current is not None and current == [] and arg == "1":
            continue
        elif current is not None:
            current.append(arg)
    parts.append(current)
    return parts


def test_ranks_after_the_first_open_no_endpoint_and_rank_0_keeps_its_restrictions(tmp_path):
    server = TritonServer(tmp_path, http_port=18000, grpc_port=18001, metrics_port=18002, launch=fast_logits_launch())
    args = ranks(server.command(find_tritonserver(None)))
    assert len(args) == 3
    rank0, *workers = args
    restrictions = server.restriction_args()
    assert restrictions and all(
        flag.split("=", 1)[0] in ("--http-restricted-api", "--grpc-restricted-protocol") for flag in restrictions
    )
    # rank 0 serves: its ports, its restrictions, no endpoint switched off
    for flag in ("--http-port", "--grpc-port", "--metrics-port"):
        assert flag in rank0
    assert all(flag in rank0 for flag in restrictions)
    assert not any(a.startswith(("--allow-http=", "--allow-grpc=")) for a in rank0)
    assert rank0[rank0.index("--allow-metrics") + 1] == "true"
    for rank, worker in enumerate(workers, start=1):
        # the engine models only, no endpoint, after the shared arguments (the last value of a flag wins)
        tail = worker[worker.index("--model-control-mode=explicit") :]
        assert tail[:3] == [
            "--model-control-mode=explicit",
            f"--load-model={TARGET_MODEL}",
            f"--load-model={DRAFT_MODEL}",
        ]
        assert tail[3:6] == NO_ENDPOINTS
        assert worker.index("--allow-metrics") < worker.index("--allow-metrics=false")
        assert tail[-1] == f"--backend-config=python,shm-region-prefix-name=prefix{rank}_"
    # a launch without MPI, or with spawned workers (one rank), is untouched
    assert not any(a in NO_ENDPOINTS for a in Launch().command(["tritonserver"]))
    spawning = Launch(mpi=True, world_size=1, spawn_processes=True, engine_models=[TARGET_MODEL], devices=[0])
    assert not any(a in NO_ENDPOINTS for a in spawning.command(["tritonserver"]))


def _wait_loaded(proc: subprocess.Popen, log_path, models: list[str], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        ready = [m for m in models if any(line.startswith(f"| {m} ") and "READY" in line for line in text.splitlines())]
        if len(ready) == len(models) or proc.poll() is not None:
            return text
        time.sleep(0.5)
    return log_path.read_text(errors="replace")


@pytest.mark.server
def test_a_second_rank_that_finishes_loading_leaves_rank_0_its_ports(triton_server, tmp_path):
    """Rank 1's own arguments, run beside a serving rank 0 on the same host and ports: with the embedded engine
    models (which, unlike TensorRT-LLM's worker ranks, finish loading), rank 1 reaches the point where tritonserver
    opens its endpoints. It must stay up having opened none, and rank 0 keeps serving."""
    launch = fast_logits_launch(world_size=2)
    server = TritonServer(
        triton_server.repo,
        http_port=triton_server.http_port,
        grpc_port=triton_server.grpc_port,
        metrics_port=triton_server.metrics_port,
        launch=launch,
    )
    binary = find_tritonserver(None)
    rank1 = ranks(server.command(binary))[1]
    log_path = tmp_path / "rank1.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            rank1,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**binary.environ(), **CPU_ENGINE_ENV, **launch.env},
            start_new_session=True,
        )
    try:
        text = _wait_loaded(proc, log_path, [TARGET_MODEL, DRAFT_MODEL], timeout=180)
        time.sleep(2.0)  # past StartEndpoints: a failed bind ends the process at once
        text = log_path.read_text(errors="replace")
        assert proc.poll() is None, f"rank 1 exited with {proc.returncode}:\n{text[-3000:]}"
        assert "failed to start" not in text and "Started HTTPService" not in text, text[-3000:]
        assert triton_server.is_ready(timeout=5.0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
