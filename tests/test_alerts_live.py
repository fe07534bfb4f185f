"""The generated alerts and the governor against a real tritonserver, scraped every second by a real Prometheus
evaluating the generated rules with their windows and `for:` scaled down: a killed draft model makes
TrtspecDraftModelFailing fire and the governor step down (draft_down), and once the BLS has the model back the
governor steps up again and the alert resolves."""

from __future__ import annotations

import compileall
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from test_monitoring import PROMETHEUS, needs_prometheus
from test_reliability import _aborted_freeing_a_killed_stub, TRITON_ABORT
from test_serving import grpc_generate
from trtspec.monitoring import write_monitoring
from trtspec.server import free_port

# the rules' 5-minute windows and minutes-long `for:` would make a test of hours: windows of 20 s, `for:` of 2 s
WINDOW, FOR = "20s", "2s"
REQUEST = {"text_input": "The quick brown fox", "max_tokens": 16, "num_draft_tokens": 4,
           "speculation": "draft_model", "adaptive_draft_length": False}


def scaled_rules(out) -> str:
    path = write_monitoring(out)[0]
    text = re.sub(r"\[5m\]", f"[{WINDOW}]", path.read_text())
    text = re.sub(r"(?m)^(\s+for: )\d+m$", rf"\g<1>{FOR}", text)
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from tiny import served_pair

    root = tmp_path_factory.mktemp("alerts")
    server = served_pair(root / "pair", overrides={"draft_timeout_ms": 3000})
    compileall.compile_dir(server.repo, quiet=1)  # as in test_reliability: a reload then loads the model again
    server.start(timeout=300)
    port = free_port()
    config = root / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [scaled_rules(root / "monitoring")],
        "scrape_configs": [{"job_name": "trtspec", "static_configs": [
            {"targets": [server.metrics_url.split("//")[1].split("/")[0]]}]}]}))
    prometheus = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={root / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "prometheus did not start"
            time.sleep(0.5)
        yield server, f"http://127.0.0.1:{port}"
    finally:
        os.killpg(prometheus.pid, signal.SIGTERM)
        prometheus.wait(timeout=30)
        server.stop()


def _get(url: str) -> dict:
    body = json.load(urllib.request.urlopen(url, timeout=10))
    assert body["status"] == "success", body
    return body["data"]


def firing(prometheus: str) -> set[str]:
    return {a["labels"]["alertname"] for a in _get(f"{prometheus}/api/v1/alerts")["alerts"] if a["state"] == "firing"}


def state(prometheus: str) -> str | None:
    query = urllib.parse.urlencode({"query": "trtspec_speculation_state == 1"})
    found = _get(f"{prometheus}/api/v1/query?{query}")["result"]
    return found[0]["metric"]["state"] if found else None


class Traffic:
    """Speculative requests, one after another, on a thread of their own, until stopped."""

    def __init__(self, url: str):
        self.url, self.stopped, self.errors = url, threading.Event(), []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stopped.is_set():
            try:
                grpc_generate(self.url, REQUEST, timeout=60)
            except Exception as exc:  # noqa: BLE001 (kept for the assertion)
                self.errors.append(exc)
            time.sleep(0.2)

    def stop(self):
        self.stopped.set()
        self.thread.join(timeout=90)


def wait_for(what: str, check, timeout: float, timeline: list):
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s; timeline so far: {timeline}"
        time.sleep(1.0)
    timeline.append((round(time.monotonic() - timeline[0][0], 1) if timeline else 0.0, what))


@needs_prometheus
def test_a_killed_draft_fires_its_alert_and_the_governor_steps_down_and_back(live):
    server, prometheus = live
    start = time.monotonic()
    timeline: list = [(start, "traffic starts")]
    traffic = Traffic(server.grpc_url)
    try:
        wait_for("speculating, no alert", lambda: state(prometheus) == "speculating"
                 and "TrtspecDraftModelFailing" not in firing(prometheus), 60, timeline)
        stubs = server.stub_pids("tensorrt_llm_draft")
        assert stubs, "the draft model's stub process was not found"
        for pid in stubs:
            os.kill(pid, signal.SIGKILL)
        timeline.append((round(time.monotonic() - start, 1), "draft model killed"))
        wait_for("governor reduced (draft_down)", lambda: state(prometheus) == "reduced", 60, timeline)
        wait_for("TrtspecDraftModelFailing firing", lambda: "TrtspecDraftModelFailing" in firing(prometheus), 90, timeline)
        # the BLS reloads the model whose process died; the breaker's probe finds it back and lifts the floor
        wait_for("governor speculating again", lambda: state(prometheus) == "speculating", 180, timeline)
        wait_for("TrtspecDraftModelFailing resolved", lambda: "TrtspecDraftModelFailing" not in firing(prometheus),
                 120, timeline)
    except Exception:
        if _aborted_freeing_a_killed_stub(server):
            pytest.xfail(TRITON_ABORT)
        raise
    finally:
        traffic.stop()
    print("timeline (s):", timeline[1:])
    assert not traffic.errors, traffic.errors[:3]   # a dead draft model costs speed, never an answer
    log = server.log_path.read_text()
    assert "speculating -> reduced (draft_down)" in log and "reduced -> speculating (draft_down_cleared)" in log
    changes = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    assert re.search(r'trtspec_speculation_changes_total\{[^}]*reason="draft_down"[^}]*\} 1', changes), changes
