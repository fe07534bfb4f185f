"""The embedded Triton server: a real tritonserver, a real Python-backend model, no mocks."""

from __future__ import annotations

import importlib.util
import os
import socket
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from trtspec.server import ServerError, TritonServer, free_port
from trtspec.server_binary import find_tritonserver, prepare_backend_dir

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "x" data_type: TYPE_INT32 dims: [ -1 ] }} ]
output [ {{ name: "y" data_type: TYPE_INT32 dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""

ECHO = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            y = pb_utils.Tensor("y", (x + 1).astype(np.int32))
            responses.append(pb_utils.InferenceResponse(output_tensors=[y]))
        return responses
"""

BROKEN = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("boom-from-model")

    def execute(self, requests):
        return []
"""


def write_model(repo: Path, name: str, source: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    (repo / name / "1" / "model.py").write_text(source)


def make_server(repo: Path, tmp_path: Path, **kwargs) -> TritonServer:
    return TritonServer(
        repo,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        log_file=tmp_path / "server.log",
        backend_cache_dir=tmp_path / "backends",
        **kwargs,
    )


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.server
def test_serves_a_python_model_and_stops_cleanly(tmp_path: Path) -> None:
    import tritonclient.http as httpclient

    repo = tmp_path / "repo"
    write_model(repo, "echo", ECHO)
    server = make_server(repo, tmp_path)
    started = time.monotonic()
    with server:
        print(f"ready after {time.monotonic() - started:.1f} s")
        pid = server.pid
        assert pid is not None and server.is_running()
        assert server.http_url == f"127.0.0.1:{server.http_port}"

        with urllib.request.urlopen(f"{server.http_base_url}/v2/health/ready", timeout=5) as resp:
            assert resp.status == 200
        # Every endpoint is bound to loopback only.
        listening = _listening_sockets(pid)
        for port in (server.http_port, server.grpc_port, server.metrics_port):
            assert ("127.0.0.1", port) in listening, listening

        client = httpclient.InferenceServerClient(server.http_url)
        try:
            x = httpclient.InferInput("x", [4], "INT32")
            x.set_data_from_numpy(np.array([1, 2, 3, -7], dtype=np.int32))
            y = client.infer("echo", [x]).as_numpy("y")
        finally:
            client.close()
        np.testing.assert_array_equal(y, [2, 3, 4, -6])

        stopping = time.monotonic()
        server.stop()
        assert time.monotonic() - stopping < 10
    assert server.returncode == 0
    assert not server.is_running()
    assert not group_alive(pid), "the server or its Python stubs are still running"
    server.stop()  # idempotent


@pytest.mark.server
def test_busy_port_is_reported_before_launch(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = make_server(repo, tmp_path)
        server.grpc_port = port
        with pytest.raises(ServerError, match=rf"port {port}\b.*--grpc-port"):
            server.start()
    assert server.pid is None  # nothing was launched
    assert not (tmp_path / "server.log").exists()


@pytest.mark.server
def test_model_load_failure_reports_the_models_reason_quickly(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_model(repo, "broken", BROKEN)
    server = make_server(repo, tmp_path)
    started = time.monotonic()
    with pytest.raises(ServerError) as info:
        server.start(timeout=120)
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert "boom-from-model" in message
    assert "broken" in message
    assert str(tmp_path / "server.log") in message
    assert "NVML" not in message and "CUDA driver version" not in message
    assert elapsed < 30, f"took {elapsed:.1f} s: the failure should end startup, not the timeout"
    assert server.pid is None


def test_backend_dir_is_prepared_once_even_concurrently(tmp_path: Path) -> None:
    spec = importlib.util.find_spec("pytriton")
    assert spec is not None and spec.submodule_search_locations
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    with ThreadPoolExecutor(4) as pool:
        dirs = set(pool.map(lambda _: prepare_backend_dir(root, tmp_path), range(4)))
    assert len(dirs) == 1
    backend = dirs.pop()
    assert sorted(p.name for p in (backend / "python").iterdir()) == [
        "libtriton_python.so",
        "triton_python_backend_stub",
        "triton_python_backend_utils.py",
    ]
    assert os.access(backend / "python" / "triton_python_backend_stub", os.X_OK)
    assert [p.name for p in tmp_path.iterdir()] == [backend.name]  # no half-built leftovers
    assert prepare_backend_dir(root, tmp_path) == backend


@pytest.mark.server
def test_explicit_binary_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "tritonserver"
    with pytest.raises(ServerError, match=str(missing)):
        find_tritonserver(str(missing))
    server = TritonServer(
        tmp_path, binary=str(missing), http_port=free_port(), grpc_port=free_port(), metrics_port=free_port()
    )
    with pytest.raises(ServerError, match="--tritonserver"):
        server.start()


def _listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(IPv4 address, port) of the TCP sockets in LISTEN state owned by `pid`.

    gRPC listens on an IPv6 socket bound to the v4-mapped address ::ffff:127.0.0.1; that is
    reported as 127.0.0.1, and any other IPv6 address as-is.
    """
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            raw = bytes.fromhex(addr_hex)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            addr = socket.inet_ntop(family, raw)
            found.add((addr.removeprefix("::ffff:"), int(port_hex, 16)))
    return found


def test_free_port_never_gives_a_port_twice():
    """A server asks for its three ports in a row; the OS may hand a just-released port out again."""
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
