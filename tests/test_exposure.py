"""What a client without a key can do to a deployment started as `trtspec serve` starts it: nothing but health,
metadata and inference on loopback. Against the real tritonserver of the nvidia-pytriton wheel.

Triton's restricted APIs (`--http-restricted-api`, `--grpc-restricted-protocol`) answer 403 over HTTP and
UNAVAILABLE over gRPC to a request without the header; the BLS's own reload of a dead engine model goes through the
server's in-process API, which the restrictions do not touch (tests/test_reliability.py kills stubs under them).
"""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from trtspec import keys
from trtspec.client import ClientError, SpecClient
from trtspec.server import ADMIN_APIS, ServerError, TritonServer, free_port
from trtspec.server_binary import find_tritonserver

PROMPT = "the quick brown fox"


def _http(server: TritonServer, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        server.http_base_url + path,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _planted_model(marker: Path) -> dict:
    """A load request that uploads a Python model whose import writes `marker`: code execution if Triton runs it."""
    code = f"open({str(marker)!r}, 'w').write('ran')\nclass TritonPythonModel:\n    def execute(self, requests):\n"
    code += "        return []\n"
    config = {"backend": "python", "max_batch_size": 0, "input": [], "output": []}
    return {"parameters": {"config": json.dumps(config), "file:1/model.py": base64.b64encode(code.encode()).decode()}}


@pytest.fixture(scope="module")
def server(model_repository, tmp_path_factory):
    """The default deployment: explicit model control (the BLS can reload engine models), the admin key from the
    session's environment (tests/conftest.py)."""
    srv = TritonServer(
        model_repository,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        log_file=tmp_path_factory.mktemp("exposure") / "server.log",
    )
    with srv:
        yield srv


@pytest.mark.server
def test_without_the_admin_key_no_model_is_uploaded_loaded_or_unloaded(server, tmp_path):
    marker = tmp_path / "ran"
    status, body = _http(server, "POST", "/v2/repository/models/planted/load", _planted_model(marker))
    assert status == 403 and keys.ADMIN_HEADER.encode() in body
    for model in ("tensorrt_llm_bls", "tensorrt_llm"):
        status, _ = _http(server, "POST", f"/v2/repository/models/{model}/unload", {})
        assert status == 403
    for path in ("/v2/repository/index", "/v2/models/stats", "/v2/models/tensorrt_llm_bls/config", "/v2/logging"):
        status, _ = _http(server, "POST" if "index" in path else "GET", path, {} if "index" in path else None)
        assert status == 403, path
    status, _ = _http(server, "GET", "/v2/trace/setting")
    assert status == 403

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(Exception, match=keys.ADMIN_HEADER):
            client.unload_model("tensorrt_llm")
        with pytest.raises(Exception, match=keys.ADMIN_HEADER):
            client.load_model("planted", config=json.dumps({"backend": "python"}), files={"file:1/model.py": b"x"})
        with pytest.raises(Exception, match=keys.ADMIN_HEADER):
            client.get_system_shared_memory_status()
        assert client.is_model_ready("tensorrt_llm") and client.is_model_ready("tensorrt_llm_bls")
        # the key as gRPC metadata, under the prefix Triton's gRPC front reads
        admin = {keys.GRPC_PREFIX + keys.ADMIN_HEADER: server.admin_key.value}
        assert client.get_inference_statistics("tensorrt_llm_bls", headers=admin) is not None
        with pytest.raises(Exception, match=keys.ADMIN_HEADER):
            client.get_inference_statistics("tensorrt_llm_bls", headers={keys.ADMIN_HEADER: server.admin_key.value})
    finally:
        client.close()

    assert not marker.exists()
    assert "planted" not in server.log_path.read_text()
    # health, metadata and inference stay open on loopback: NVIDIA's clients need no key
    assert _http(server, "GET", "/v2/health/ready")[0] == 200
    assert _http(server, "GET", "/v2/models/tensorrt_llm_bls")[0] == 200
    status, body = _http(
        server, "POST", "/v2/models/tensorrt_llm_bls/generate", {"text_input": PROMPT, "max_tokens": 4}
    )
    assert status == 200 and "text_output" in json.loads(body)


@pytest.mark.server
def test_the_admin_key_opens_the_admin_apis(server):
    headers = server.admin_headers
    assert _http(server, "GET", "/v2/models/stats", headers=headers)[0] == 200
    assert _http(server, "POST", "/v2/repository/index", {}, headers=headers)[0] == 200
    # a wrong key of the right shape is refused like none
    wrong = {keys.ADMIN_HEADER: "x" * len(server.admin_key.value)}
    assert _http(server, "GET", "/v2/models/stats", headers=wrong)[0] == 403
    # trtspec's own client reads configs with the key, and says where the key is without it
    with SpecClient(server.http_url, headers=headers) as client:
        assert client.model_config("tensorrt_llm_bls")["name"] == "tensorrt_llm_bls"
    with SpecClient(server.http_url, headers={}) as client, pytest.raises(ClientError, match=keys.ADMIN_ENV):
        client.model_config("tensorrt_llm_bls")
    with SpecClient(server.grpc_url, protocol="grpc", headers={}) as client, pytest.raises(ClientError):
        client.model_config("tensorrt_llm_bls")


@pytest.mark.server
def test_beyond_loopback_inference_needs_the_api_key(model_repository, tmp_path):
    """Triton bound to every interface (as a container publishes it): inference answers only with the API key."""
    api_key = keys.Key("k" * 32, "test")
    srv = TritonServer(
        model_repository,
        host="0.0.0.0",
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
        api_key=api_key,
        allow_dev_server_exposure=True,
        log_file=tmp_path / "server.log",
    )
    with srv:
        body = {"text_input": PROMPT, "max_tokens": 4}
        assert _http(srv, "POST", "/v2/models/tensorrt_llm_bls/generate", body)[0] == 403
        status, _ = _http(srv, "POST", "/v2/models/tensorrt_llm_bls/generate", body, {keys.API_HEADER: api_key.value})
        assert status == 200
        assert _http(srv, "GET", "/v2/health/ready")[0] == 200  # probes need no key
        with SpecClient(srv.grpc_url, protocol="grpc", headers=srv.client_headers) as client:
            assert client.generate(PROMPT, max_tokens=4).token_ids
        with SpecClient(srv.grpc_url, protocol="grpc", headers=srv.admin_headers) as client:
            with pytest.raises(ClientError, match=keys.API_HEADER):
                client.generate(PROMPT, max_tokens=4)


def test_triton_beyond_loopback_without_an_api_key_is_refused(model_repository):
    srv = TritonServer(model_repository, host="0.0.0.0")
    with pytest.raises(ServerError, match="--api-key-file"):
        srv.check_exposure(find_tritonserver())
    loopback = TritonServer(model_repository, host="127.0.0.1")
    loopback.check_exposure(find_tritonserver())  # loopback needs neither


def test_the_wheels_tritonserver_stays_on_loopback_unless_told(model_repository):
    binary = find_tritonserver()
    assert binary.is_dev_server  # the test environment's server is the wheel's
    key = keys.Key("k" * 32, "test")
    with pytest.raises(ServerError, match="CVE-2025-23319.*--allow-dev-server-exposure"):
        TritonServer(model_repository, host="0.0.0.0", api_key=key).check_exposure(binary)
    TritonServer(model_repository, host="0.0.0.0", api_key=key, allow_dev_server_exposure=True).check_exposure(binary)


def test_the_command_restricts_every_admin_api_and_prints_no_key(model_repository):
    from trtspec.deploy.launch import server_command_line

    srv = TritonServer(model_repository, host="0.0.0.0", api_key=keys.Key("a" * 32, "test"))
    args = srv.restriction_args()
    admin = f"{','.join(ADMIN_APIS)}:{keys.ADMIN_HEADER}={srv.admin_key.value}"
    assert f"--http-restricted-api={admin}" in args and f"--grpc-restricted-protocol={admin}" in args
    assert f"--http-restricted-api=inference:{keys.API_HEADER}={'a' * 32}" in args
    line = server_command_line(srv)
    assert srv.admin_key.value not in line and "a" * 32 not in line
    assert '"${TRTSPEC_ADMIN_KEY}"' in line and '"${TRTSPEC_API_KEY}"' in line
    # on loopback inference stays open
    assert not any("inference" in a for a in TritonServer(model_repository).restriction_args())


def test_a_generated_key_is_private_and_kept(tmp_path, monkeypatch):
    monkeypatch.delenv(keys.ADMIN_ENV, raising=False)
    path = tmp_path / "state" / "admin-key"
    first = keys.resolve(file=None, option="--admin-key-file", env=keys.ADMIN_ENV, generate_into=path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(first.value) >= keys.MIN_LENGTH and first.value not in repr(first)
    again = keys.resolve(file=None, option="--admin-key-file", env=keys.ADMIN_ENV, generate_into=path)
    assert again.value == first.value  # the next start keeps the operator's key
    path.chmod(0o644)
    with pytest.raises(keys.KeyProblem, match="chmod 600"):
        keys.resolve(file=None, option="--admin-key-file", env=keys.ADMIN_ENV, generate_into=path)


def test_given_keys_win_and_weak_ones_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(keys.API_ENV, "e" * 20)
    assert keys.resolve(file=None, option="--api-key-file", env=keys.API_ENV).source == f"${keys.API_ENV}"
    given = tmp_path / "api.key"
    given.write_text("f" * 20 + "\n")
    assert keys.resolve(file=given, option="--api-key-file", env=keys.API_ENV).value == "f" * 20
    given.write_text("short")
    with pytest.raises(keys.KeyProblem, match="--api-key-file.*at least 16"):
        keys.resolve(file=given, option="--api-key-file", env=keys.API_ENV)
    given.write_text("a:b=c" * 5)
    with pytest.raises(keys.KeyProblem, match="letters, digits"):
        keys.resolve(file=given, option="--api-key-file", env=keys.API_ENV)
    monkeypatch.delenv(keys.API_ENV)
    assert keys.resolve(file=None, option="--api-key-file", env=keys.API_ENV) is None  # never generated
    key = keys.Key("g" * 20, "test")
    assert key.matches("g" * 20) and not key.matches("g" * 19 + "h") and not key.matches(None)


def test_serve_prints_the_key_file_not_the_key(model_repository, tmp_path):
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path)}
    env.pop(keys.ADMIN_ENV, None)
    out = subprocess.run(
        [sys.executable, "-m", "trtspec.cli", "serve", "--repo", str(model_repository), "--print-command"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=120,
    ).stdout
    key_file = keys.state_dir(model_repository).relative_to(keys.state_dir()).name
    generated = next(tmp_path.glob(f"trtspec/{key_file}/admin-key")).read_text().strip()
    assert generated not in out and "--http-restricted-api=model-repository" in out
