"""The generated alerts and the governor against a real tritonserver, scraped every second by a real Prometheus
evaluating the generated rules with their windows and `for:` scaled down: a killed draft model makes
TrtspecDraftModelFailing fire and the governor step down (draft_down), and once the BLS has the model back the
governor steps up again and the alert resolves."""

from __future__ import annotations

import compileall
import os
import re
import signal
import threading
import time
import urllib.request

import pytest

from test_monitoring import needs_prometheus, prometheus_scraping
from test_reliability import kills_a_stub
from test_serving import grpc_generate
from trtspec.monitoring import write_monitoring

# the rules' 5-minute windows and minutes-long `for:` would make a test of hours: windows of 20 s, `for:` of 2 s
WINDOW, FOR = "20s", "2s"
REQUEST = {"text_input": "The quick brown fox", "max_tokens": 16, "num_draft_tokens": 4,
           "speculation": "draft_model", "adaptive_draft_length": False}


def scaled_rules(out):
    path = write_monitoring(out)[0]
    text = re.sub(r"\[5m\]", f"[{WINDOW}]", path.read_text())
    text = re.sub(r"(?m)^(\s+for: )\d+m$", rf"\g<1>{FOR}", text)
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tiny import served_pair

    server = served_pair(tmp_path_factory.mktemp("alerts") / "pair", overrides={"draft_timeout_ms": 3000})
    compileall.compile_dir(server.repo, quiet=1)  # as in test_reliability: a reload then loads the model again
    server.start(timeout=300)
    yield server
    server.stop()


@pytest.fixture
def prometheus(server, tmp_path):
    with prometheus_scraping(server, scaled_rules(tmp_path / "monitoring"), tmp_path) as api:
        yield api


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


@needs_prometheus
@kills_a_stub
def test_a_killed_draft_fires_its_alert_and_the_governor_steps_down_and_back(server, prometheus):
    def firing() -> set[str]:
        return {a["labels"]["alertname"] for a in prometheus("alerts")["alerts"] if a["state"] == "firing"}

    def state() -> str | None:
        found = prometheus("query", query="trtspec_speculation_state == 1")["result"]
        return found[0]["metric"]["state"] if found else None

    start, timeline = time.monotonic(), []

    def wait_for(what: str, check, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s; timeline so far: {timeline}"
            time.sleep(1.0)
        timeline.append((round(time.monotonic() - start, 1), what))

    traffic = Traffic(server.grpc_url)
    try:
        wait_for("speculating, no alert", lambda: state() == "speculating" and "TrtspecDraftModelFailing" not in firing(), 60)
        stubs = server.stub_pids("tensorrt_llm_draft")
        assert stubs, "the draft model's stub process was not found"
        for pid in stubs:
            os.kill(pid, signal.SIGKILL)
        timeline.append((round(time.monotonic() - start, 1), "draft model killed"))
        wait_for("governor reduced (draft_down)", lambda: state() == "reduced", 60)
        wait_for("TrtspecDraftModelFailing firing", lambda: "TrtspecDraftModelFailing" in firing(), 90)
        # the BLS reloads the model whose process died; the breaker's probe finds it back and lifts the floor
        wait_for("governor speculating again", lambda: state() == "speculating", 180)
        wait_for("TrtspecDraftModelFailing resolved", lambda: "TrtspecDraftModelFailing" not in firing(), 120)
    finally:
        traffic.stop()
    print("timeline (s):", timeline)
    assert not traffic.errors, traffic.errors[:3]   # a dead draft model costs speed, never an answer
    log = server.log_path.read_text()
    assert "speculating -> reduced (draft_down)" in log and "reduced -> speculating (draft_down_cleared)" in log
    changes = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    assert re.search(r'trtspec_speculation_changes_total\{[^}]*reason="draft_down"[^}]*\} 1', changes), changes
