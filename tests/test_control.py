"""The speculation control receiver of `trtspec serve`: an operator's force and Alertmanager's webhook, over real
HTTP, written to the control file the BLS reads; a token where it is bound beyond loopback; errors that name the
field. (The BLS acting on the file, inside a real tritonserver: tests/test_serving.py.)"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from trtspec.control import ControlError, ControlServer, Watcher, read


def call(url: str, body=None, token: str | None = None) -> tuple[int, dict]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request(
        url,
        data=data,
        method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {}),
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture
def control(tmp_path):
    lines: list[str] = []
    server = ControlServer(tmp_path / "force.json", log=lines.append).start()
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


def test_beyond_loopback_a_token_is_required(tmp_path):
    with pytest.raises(ControlError, match="token"):
        ControlServer(tmp_path / "f.json", host="0.0.0.0")
    server = ControlServer(tmp_path / "f.json", host="127.0.0.1", token="s3cret").start()
    try:
        url = f"http://127.0.0.1:{server.port}/control"
        assert call(url)[0] == 401 and call(url, {"mode": "plain"})[0] == 401
        assert call(url, {"mode": "plain"}, token="wrong")[0] == 401 and not (tmp_path / "f.json").exists()
        assert call(url, {"mode": "plain"}, token="s3cret")[0] == 200
    finally:
        server.stop()


def test_the_watcher_sees_each_change_once(tmp_path):
    path = tmp_path / "force.json"
    watcher = Watcher(path, interval=0.0)
    assert watcher.poll() == (False, None)
    server = ControlServer(path).start()
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
