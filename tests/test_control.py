"""The speculation control receiver of `trtspec serve`: an operator's force and Alertmanager's webhook, over real
HTTP, written to the control file the BLS reads; a token on every request and JSON on every POST; connections that
cannot hold it; errors that name the field. (The BLS acting on the file, inside a real tritonserver:
tests/test_serving.py.)"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from trtspec.control import MAX_SECONDS, ControlError, ControlServer, Watcher, read

TOKEN = "test-control-token-0123456789"  # what tests/test_serving.py and tests/test_monitoring.py use too
JSON = "application/json"


def call(url: str, body=None, token: str | None = TOKEN, content_type: str | None = JSON) -> tuple[int, dict]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if content_type:
        headers["Content-Type"] = content_type
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def control(tmp_path):
    lines: list[str] = []
    server = ControlServer(tmp_path / "force.json", token=TOKEN, log=lines.append).start()
    server.lines = lines
    yield server
    server.stop()


def alert(name: str, status: str, mode: str | None) -> dict:
    labels = {"alertname": name, "severity": "critical"} | ({"trtspec_mode": mode} if mode else {})
    return {"status": status, "labels": labels, "annotations": {}}


def payload(*alerts) -> dict:  # Alertmanager's webhook body (version 4), the fields trtspec reads
    return {
        "version": "4",
        "status": "firing" if any(a["status"] == "firing" for a in alerts) else "resolved",
        "receiver": "trtspec-governor",
        "groupLabels": {},
        "commonLabels": {},
        "alerts": list(alerts),
    }


def test_an_operator_forces_a_mode_for_a_time_and_releases_it(control):
    url = f"http://127.0.0.1:{control.port}/control"
    assert call(url) == (200, {"mode": "auto"})
    status, body = call(url, {"mode": "plain", "for_seconds": 120, "reason": "draft upgrade"})
    assert status == 200 and body["mode"] == "plain" and body["source"] == "operator"
    force = read(control.path)
    assert force.mode == "plain" and 110 < force.remaining() <= 120 and force.reason == "draft upgrade"
    assert call(url)[1]["remaining_seconds"] in range(110, 121)
    assert call(url, {"mode": "auto"}) == (200, {"mode": "auto"})
    assert read(control.path) is None and not control.path.exists()
    assert control.lines[0].startswith("speculation forced to plain for") and "released" in control.lines[1]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"mode": "off"}, "mode"),
        ({"mode": "plain", "for_seconds": 0}, "for_seconds"),
        ({"mode": "plain", "for_seconds": "10"}, "for_seconds"),
        ({"mode": "plain", "reason": ""}, "reason"),
        ([1, 2], "JSON object"),
        (b"{not json", "Expecting"),
    ],
)
def test_bad_requests_name_the_field_and_change_nothing(control, body, field):
    status, answer = call(f"http://127.0.0.1:{control.port}/control", body)
    assert status == 400 and field in answer["error"]
    assert not control.path.exists()


def test_alertmanager_forces_the_most_conservative_mode_and_releases_when_resolved(control):
    url = f"http://127.0.0.1:{control.port}/alertmanager"
    status, body = call(
        url,
        payload(
            alert("TrtspecAcceptanceBelowBreakEven", "firing", "reduced"),
            alert("TrtspecErrorRatioCritical", "firing", "plain"),
            alert("SomethingElse", "firing", None),
        ),
    )
    assert status == 200 and body["mode"] == "plain" and body["source"] == "alertmanager"
    assert body["reason"] == "alert TrtspecAcceptanceBelowBreakEven, TrtspecErrorRatioCritical"
    call(
        url,
        payload(
            alert("TrtspecErrorRatioCritical", "resolved", "plain"),
            alert("TrtspecAcceptanceBelowBreakEven", "firing", "reduced"),
        ),
    )
    assert read(control.path).mode == "reduced"
    call(url, payload(alert("TrtspecAcceptanceBelowBreakEven", "resolved", "reduced")))
    assert read(control.path) is None


def test_alerts_never_override_an_operator(control):
    call(f"http://127.0.0.1:{control.port}/control", {"mode": "speculating", "for_seconds": 300, "reason": "load test"})
    call(
        f"http://127.0.0.1:{control.port}/alertmanager", payload(alert("TrtspecLatencyP99Critical", "firing", "plain"))
    )
    assert read(control.path).mode == "speculating"
    call(
        f"http://127.0.0.1:{control.port}/alertmanager",
        payload(alert("TrtspecLatencyP99Critical", "resolved", "plain")),
    )
    assert read(control.path).mode == "speculating"  # resolved alerts release only what Alertmanager set


def test_a_bad_alert_label_is_refused(control):
    status, body = call(f"http://127.0.0.1:{control.port}/alertmanager", payload(alert("X", "firing", "off")))
    assert status == 400 and "trtspec_mode" in body["error"]
    assert call(f"http://127.0.0.1:{control.port}/alertmanager", {"hello": 1})[0] == 400


def test_a_token_is_required_on_loopback_too(tmp_path):
    for host in ("127.0.0.1", "0.0.0.0"):
        with pytest.raises(ControlError, match="token"):
            ControlServer(tmp_path / "f.json", host=host)
    with pytest.raises(ControlError, match="at least 16 characters"):
        ControlServer(tmp_path / "f.json", token="s3cret")


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token-0123456789abc"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": f"Bearer {TOKEN[:-1]}"},
    ],
)
def test_every_request_without_the_token_is_refused(control, headers):
    url = f"http://127.0.0.1:{control.port}"
    for path, body in (("/control", None), ("/control", {"mode": "plain"}), ("/alertmanager", payload())):
        request = urllib.request.Request(
            url + path,
            data=None if body is None else json.dumps(body).encode(),
            headers=headers | {"Content-Type": JSON},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401 and refused.value.headers["WWW-Authenticate"] == "Bearer"
        assert "Authorization: Bearer" in json.loads(refused.value.read())["error"]
    assert not control.path.exists()
    assert call(url + "/control", {"mode": "plain"}, token=f" {TOKEN} ")[0] == 200


def test_the_token_is_checked_before_the_body_is_read(control):
    """A client without the token that announces a body and never sends it is answered at once."""
    with socket.create_connection(("127.0.0.1", control.port), timeout=5) as sock:
        sock.sendall(
            b"POST /control HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        )
        assert sock.recv(100).startswith(b"HTTP/1.0 401")


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_a_post_must_say_it_is_json(control, content_type):
    """What a web page can post to another origin without a CORS preflight (which the receiver never answers) is
    refused: the body is the same JSON, the header is not."""
    for path, body in (("/control", {"mode": "speculating", "for_seconds": 60}), ("/alertmanager", payload())):
        status, answer = call(f"http://127.0.0.1:{control.port}{path}", body, content_type=content_type)
        assert status == 415 and "Content-Type: application/json" in answer["error"]
    assert not control.path.exists()
    preflight = urllib.request.Request(
        f"http://127.0.0.1:{control.port}/control",
        method="OPTIONS",
        headers={"Origin": "http://example.com", "Access-Control-Request-Method": "POST"},
    )
    with pytest.raises(urllib.error.HTTPError) as unanswered:  # the browser then sends nothing
        urllib.request.urlopen(preflight, timeout=10)
    assert unanswered.value.code == 501 and "Access-Control-Allow-Origin" not in unanswered.value.headers
    charset = call(f"http://127.0.0.1:{control.port}/control", {"mode": "plain"}, content_type=f"{JSON}; charset=utf-8")
    assert charset[0] == 200


def test_a_force_lasts_a_day_at_most(control):
    url = f"http://127.0.0.1:{control.port}/control"
    assert MAX_SECONDS == 86400
    status, answer = call(url, {"mode": "plain", "for_seconds": 86401})
    assert status == 400 and "for_seconds" in answer["error"] and "86400" in answer["error"]
    assert not control.path.exists()
    assert call(url, {"mode": "plain", "for_seconds": 86400})[0] == 200


def test_the_reason_reaches_the_log_on_one_line(control):
    url = f"http://127.0.0.1:{control.port}/control"
    status, body = call(url, {"mode": "plain", "reason": "draft\nupgrade\r\n\x1b[31mFAKE\u202e line\t"})
    assert status == 200 and body["reason"] == "draft upgrade [31mFAKE line"
    assert read(control.path).reason == "draft upgrade [31mFAKE line"
    assert "\n" not in control.lines[-1] and "\x1b" not in control.lines[-1]
    assert call(url, {"mode": "plain", "reason": "\n\x00\t"})[0] == 400  # nothing printable: no reason
    call(url, {"mode": "auto"})
    alert_name = "Evil\nspeculation forced to speculating"
    status, body = call(f"http://127.0.0.1:{control.port}/alertmanager", payload(alert(alert_name, "firing", "plain")))
    assert status == 200 and body["reason"] == "alert Evil speculation forced to speculating"


def _half_request(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /control HTTP/1.1\r\nHost: x\r\n")  # and never the rest of the header
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_half_sent_requests_hold_nothing_for_long(tmp_path):
    """Clients that send half a header, or trickle one a byte at a time (each read well within a per-read timeout),
    are cut off once their connection is the receiver's timeout old; connections beyond its cap are told 503 at
    once; everyone else is served meanwhile and after."""
    server = ControlServer(tmp_path / "f.json", token=TOKEN, timeout=1.5, max_connections=3).start()
    url = f"http://127.0.0.1:{server.port}/control"
    socks = []
    try:
        socks.append(_half_request(server.port))
        assert call(url) == (200, {"mode": "auto"})  # served beside it
        time.sleep(0.2)  # that request's slot is back
        socks += [_half_request(server.port), _half_request(server.port)]  # the cap is reached
        time.sleep(0.2)
        start = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as busy:
            urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"}), timeout=5)
        assert busy.value.code == 503 and busy.value.headers["Retry-After"] and time.monotonic() - start < 0.5
        trickle = socks[-1]
        for _ in range(10):  # 3 s of a byte every 0.3 s
            try:
                trickle.sendall(b"X")
            except OSError:
                break
            time.sleep(0.3)
        assert _closed_within(trickle, 0.2), "a trickling client outlived the receiver's timeout"
        assert all(_closed_within(sock, 0.2) for sock in socks)
        assert call(url, {"mode": "reduced", "for_seconds": 5})[0] == 200 and read(server.path).mode == "reduced"
        assert all(call(url)[0] == 200 for _ in range(10))  # every slot came back
    finally:
        for sock in socks:
            sock.close()
        server.stop()


def test_the_watcher_sees_each_change_once(tmp_path):
    path = tmp_path / "force.json"
    watcher = Watcher(path, interval=0.0)
    assert watcher.poll() == (False, None)
    server = ControlServer(path, token=TOKEN).start()
    try:
        call(f"http://127.0.0.1:{server.port}/control", {"mode": "reduced", "for_seconds": 5})
        changed, force = watcher.poll()
        assert changed and force.mode == "reduced"
        assert watcher.poll() == (False, force)
        call(f"http://127.0.0.1:{server.port}/control", {"mode": "auto"})
        assert watcher.poll() == (True, None)
    finally:
        server.stop()
    path.write_text(json.dumps({"mode": "plain", "until": time.time() - 1, "reason": "x", "source": "operator"}))
    assert watcher.poll() == (False, None)  # an ended force is no force
    path.write_text("garbage")
    assert watcher.poll() == (False, None)


def _serve(tmp_path, *args, env=None) -> subprocess.CompletedProcess:
    """`trtspec serve --control-port 0` with a tritonserver that exits at once: what serve prints and makes about the
    control token before and while it starts the server."""
    repo = Path(__file__).resolve().parents[1] / "model_repository"
    return subprocess.run(
        [sys.executable, "-m", "trtspec.cli", "serve", "--repo", str(repo), "--control-port", "0"]
        + ["--tritonserver", shutil.which("false"), "--start-timeout", "5", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "TRTSPEC_CONTROL_TOKEN"}
        | {"XDG_STATE_HOME": str(tmp_path / "state"), "COLUMNS": "80"}
        | (env or {}),
    )


def test_serve_generates_a_token_and_says_where_it_is_never_what(tmp_path):
    first = _serve(tmp_path)
    line = next(x for x in first.stdout.splitlines() if x.startswith("speculation control token:"))
    path = Path(line.split("generated into ", 1)[1])
    assert path.is_relative_to(tmp_path / "state") and path.name == "control-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text().strip()
    assert len(token) >= 32 and token not in first.stdout + first.stderr
    again = _serve(tmp_path)  # the same token on the next start: what an operator or Alertmanager holds stays good
    assert f"generated into {path}" in again.stdout and path.read_text().strip() == token

    given = tmp_path / "given-token"
    given.write_text("x" * 8)
    short = _serve(tmp_path, "--control-token-file", str(given))
    assert short.returncode != 0 and "--control-token-file" in short.stderr and "at least 16" in short.stderr
    given.write_text("operator-token-0123456789")
    assert f"speculation control token: file {given}" in _serve(tmp_path, "--control-token-file", str(given)).stdout
    from_env = _serve(tmp_path, env={"TRTSPEC_CONTROL_TOKEN": "env-token-0123456789abc"})
    assert "speculation control token: $TRTSPEC_CONTROL_TOKEN" in from_env.stdout
    assert "env-token-0123456789abc" not in from_env.stdout + from_env.stderr
