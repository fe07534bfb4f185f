"""The generated alerts and the governor against a real tritonserver, scraped every second by a real Prometheus
evaluating the generated rules with their windows and `for:` scaled down: a killed draft model makes
TrtspecDraftModelFailing fire and the governor step down (draft_down), and once the BLS has the model back the
governor steps up again and the alert resolves; a run of prompts the draft cannot predict makes
TrtspecAcceptanceBelowBreakEven fire and the governor step down to plain decoding (low_acceptance), and once they
stop its probes pay and it steps back up to speculating; a full KV cache makes TrtspecKvCacheCritical fire and holds
the governor at plain decoding (kv_cache) until it empties."""

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

from trtspec.deploy.monitoring import write_monitoring

pytestmark = pytest.mark.server

# the rules' 5-minute windows and minutes-long `for:` would make a test of hours: windows of 20 s, `for:` of 2 s
WINDOW, FOR = "20s", "2s"
REQUEST = {"max_tokens": 16, "num_draft_tokens": 4, "speculation": "draft_model", "adaptive_draft_length": False}
# for the numbers-blind pair (tiny.make_numbers_blind_pair): words it predicts, numbers it cannot
WORDS = [
    "The quick brown fox",
    "Speculative decoding drafts tokens",
    "def add(a, b):",
    "Once upon a time",
    "Triton serves models over HTTP",
    "What is the capital of France?",
]
NUMBERS = ["Count with me: 1 2 3", "The year 1999", "Call 555 0123", "Primes: 2 3 5 7", "Page 42"]


def scaled_rules(out):
    path = write_monitoring(out)[0]
    text = re.sub(r"\[5m\]", f"[{WINDOW}]", path.read_text())
    text = re.sub(r"(?m)^(\s+for: )\d+m$", rf"\g<1>{FOR}", text)
    path.write_text(text)
    return path


def serving(tmp_path_factory, name: str, **kwargs):
    """A served pair (tiny.served_pair's `kwargs`) under a folder of its own, started, and stopped afterwards; its
    BLS reads forces from `server.control_file` (as under `trtspec serve --control-port`)."""
    from support.tiny import served_pair

    root = tmp_path_factory.mktemp("alerts")
    server = served_pair(root / name, **kwargs)
    server.control_file = root / "force.json"
    compileall.compile_dir(server.repo, quiet=1)  # as in test_reliability: a reload then loads the model again
    server.start(timeout=300)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serving(tmp_path_factory, "pair", overrides={"draft_timeout_ms": 3000})


@pytest.fixture(scope="module")
def blind_server(tmp_path_factory):
    from support.tiny import make_numbers_blind_pair

    # a governor that judges 3 s after each change, not 30: the test walks it down two levels and up two
    yield from serving(tmp_path_factory, "blind", pair=make_numbers_blind_pair, overrides={"governor_hold_seconds": 3})


@pytest.fixture(scope="module")
def small_kv_server(tmp_path_factory):
    # a 1 MiB KV cache: 64 blocks of 32 tokens, of which a call for 200 tokens holds 7
    yield from serving(tmp_path_factory, "small-kv", engine={"kv_cache_mb": 1})


class Traffic:
    """Requests (`fields` and one of `prompts`, which may change on the way), one after another on each of
    `clients` threads, until stopped."""

    def __init__(self, url: str, prompts: list[str], pause: float = 0.2, clients: int = 1, fields: dict = REQUEST):
        self.url, self.prompts, self.pause, self.fields = url, prompts, pause, fields
        self.stopped, self.errors = threading.Event(), []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def _run(self):
        sent = 0
        while not self.stopped.is_set():
            prompts = self.prompts
            try:
                grpc_generate(self.url, self.fields | {"text_input": prompts[sent % len(prompts)]}, timeout=60)
            except Exception as exc:  # noqa: BLE001 (kept for the assertion)
                self.errors.append(exc)
            sent += 1
            time.sleep(self.pause)

    def stop(self):
        self.stopped.set()
        for thread in self.threads:
            thread.join(timeout=90)


class Watch:
    """What Prometheus sees (alerts firing, the speculation state), and a timeline of what was waited for."""

    def __init__(self, api):
        self.api, self.start, self.timeline = api, time.monotonic(), []

    def firing(self) -> set[str]:
        return {a["labels"]["alertname"] for a in self.api("alerts")["alerts"] if a["state"] == "firing"}

    def state(self) -> str | None:
        found = self.api("query", query='trtspec_speculation_state{load="1"} == 1')["result"]
        return found[0]["metric"]["state"] if found else None

    def changed(self, reason: str) -> bool:
        """Whether the 1 range's level has changed for `reason`: a level that held for less than a scrape or two
        (a draft model reloaded within seconds) may never be seen as a state, but its change is counted."""
        query = f'trtspec_speculation_changes_total{{load="1",reason="{reason}"}} > 0'
        return bool(self.api("query", query=query)["result"])

    def mark(self, what: str) -> None:
        self.timeline.append((round(time.monotonic() - self.start, 1), what))

    def wait_for(self, what: str, check, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s; timeline so far: {self.timeline}"
            time.sleep(1.0)
        self.mark(what)


@needs_prometheus
@kills_a_stub
def test_a_killed_draft_fires_its_alert_and_the_governor_steps_down_and_back(server, tmp_path):
    traffic = Traffic(server.grpc_url, ["The quick brown fox"])
    with prometheus_scraping(server, scaled_rules(tmp_path / "monitoring"), tmp_path) as api:
        watch = Watch(api)
        try:
            watch.wait_for(
                "speculating, no alert",
                lambda: watch.state() == "speculating" and "TrtspecDraftModelFailing" not in watch.firing(),
                60,
            )
            stubs = server.stub_pids("tensorrt_llm_draft")
            assert stubs, "the draft model's stub process was not found"
            for pid in stubs:
                os.kill(pid, signal.SIGKILL)
            watch.mark("draft model killed")
            watch.wait_for(
                "governor reduced (draft_down)", lambda: watch.state() == "reduced" or watch.changed("draft_down"), 60
            )
            watch.wait_for("TrtspecDraftModelFailing firing", lambda: "TrtspecDraftModelFailing" in watch.firing(), 90)
            # the BLS reloads the model whose process died; the breaker's probe finds it back and lifts the floor
            watch.wait_for("governor speculating again", lambda: watch.state() == "speculating", 180)
            watch.wait_for(
                "TrtspecDraftModelFailing resolved", lambda: "TrtspecDraftModelFailing" not in watch.firing(), 120
            )
        finally:
            traffic.stop()
    print("timeline (s):", watch.timeline)
    assert not traffic.errors, traffic.errors[:3]  # a dead draft model costs speed, never an answer
    log = server.log_path.read_text()
    assert "speculating -> reduced (draft_down)" in log and "reduced -> speculating (draft_down_cleared)" in log
    changes = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    assert re.search(r'trtspec_speculation_changes_total\{[^}]*reason="draft_down"[^}]*\} 1', changes), changes


@needs_prometheus
def test_prompts_the_draft_cannot_predict_fire_the_acceptance_alert_and_roll_speculation_back(blind_server, tmp_path):
    alert = "TrtspecAcceptanceBelowBreakEven"
    traffic = Traffic(blind_server.grpc_url, WORDS, pause=0.05)
    with prometheus_scraping(blind_server, scaled_rules(tmp_path / "monitoring"), tmp_path) as api:
        watch = Watch(api)
        try:
            watch.wait_for(
                "speculating on words, no alert",
                lambda: (
                    watch.state() == "speculating"
                    and api("query", query="trtspec:acceptance:ratio_rate5m > 0.9")["result"]
                    and alert not in watch.firing()
                ),
                90,
            )
            traffic.prompts = NUMBERS
            watch.mark("numbers begin")
            watch.wait_for("governor reduced (low_acceptance)", lambda: watch.state() == "reduced", 90)
            watch.wait_for("governor plain (low_acceptance)", lambda: watch.state() in ("plain", "probing"), 90)
            watch.wait_for(f"{alert} firing", lambda: alert in watch.firing(), 90)
            traffic.prompts = WORDS
            watch.mark("numbers end")
            # in plain decoding one request in 8 probes at the reduced length; once the probes pay it steps up
            watch.wait_for("governor reduced (probes_pay)", lambda: watch.state() == "reduced", 180)
            watch.wait_for("governor speculating (pays)", lambda: watch.state() == "speculating", 120)
            watch.wait_for(f"{alert} resolved", lambda: alert not in watch.firing(), 120)
        finally:
            traffic.stop()
    print("timeline (s):", watch.timeline)
    assert not traffic.errors, traffic.errors[:3]
    log = blind_server.log_path.read_text()
    for change in (
        "speculating -> reduced (low_acceptance)",
        "reduced -> plain (low_acceptance)",
        "-> reduced (probes_pay)",
        "reduced -> speculating (pays)",
    ):
        assert change in log, change


@needs_prometheus
def test_a_full_kv_cache_fires_its_alert_and_the_governor_decodes_plainly_until_it_empties(small_kv_server, tmp_path):
    alert = "TrtspecKvCacheCritical"
    with prometheus_scraping(small_kv_server, scaled_rules(tmp_path / "monitoring"), tmp_path) as api:
        watch = Watch(api)
        watch.wait_for(
            "speculating, KV cache empty",
            lambda: (
                watch.state() == "speculating"
                and api("query", query='trtspec:kv_cache_used:ratio{model="tensorrt_llm"} < 0.5')["result"]
            ),
            60,
        )
        # nine clients whose calls hold 7 blocks each want 63 of the 64 blocks: streamed, so that a plain stretch is
        # one call for the rest of the budget (a request that is not streamed takes a stretch at a time)
        traffic = Traffic(
            small_kv_server.grpc_url,
            WORDS,
            pause=0.0,
            clients=9,
            fields={"max_tokens": 200, "min_tokens": 200, "stream": True},
        )
        try:
            watch.wait_for("governor plain (kv_cache)", lambda: watch.state() == "plain", 60)
            watch.wait_for(f"{alert} firing", lambda: alert in watch.firing(), 60)
        finally:
            traffic.stop()
        watch.mark("load ends")
        # the floor lifts; the level is then the one judging reached (the tiny pair's drafts, as costly as the
        # target, may not have paid under that load)
        watch.wait_for(
            "floor lifted (kv_cache_cleared)",
            lambda: (
                "(kv_cache_cleared)" in small_kv_server.log_path.read_text()
                and watch.state() in ("speculating", "reduced")
            ),
            60,
        )
        watch.wait_for(f"{alert} resolved", lambda: alert not in watch.firing(), 60)
    print("timeline (s):", watch.timeline)
    assert not traffic.errors, traffic.errors[:3]  # a full KV cache makes calls wait, never fail
    assert "(kv_cache); draft-length cap now 0" in small_kv_server.log_path.read_text()


def test_a_forced_speculating_still_decodes_plainly_while_the_kv_cache_is_full(small_kv_server):
    """A force never lifts a floor: with speculation forced on through the control receiver, a full KV cache still
    takes the load's range to plain decoding (kv_cache), and once the cache empties the forced level is back."""
    from test_control import TOKEN, call
    from test_serving import read_metrics

    from trtspec.control import ControlServer

    def states() -> dict[str, str]:
        values = read_metrics(small_kv_server.metrics_url)
        return {
            k.split('load="')[1].split('"')[0]: k.split('state="')[1].split('"')[0]
            for k, v in values.items()
            if k.startswith("trtspec_speculation_state{") and v == 1
        }

    def wait_for(what: str, check, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s; states {states()}"
            time.sleep(1.0)

    def log() -> str:
        return small_kv_server.log_path.read_text()[start:]

    start = len(small_kv_server.log_path.read_text())
    control = ControlServer(small_kv_server.control_file, token=TOKEN).start()
    url = f"http://127.0.0.1:{control.port}/control"
    traffic = None
    try:
        assert call(url, {"mode": "speculating", "for_seconds": 600, "reason": "load test"})[0] == 200
        time.sleep(0.6)  # the BLS re-reads the file at most twice a second, on a request
        grpc_generate(small_kv_server.grpc_url, REQUEST | {"text_input": WORDS[0]})
        wait_for("forced", lambda: "speculation forced to speculating" in log(), 10)
        assert set(states().values()) == {"speculating"}
        # as in the alert's test above: nine streamed clients want 63 of the 64 blocks
        traffic = Traffic(
            small_kv_server.grpc_url,
            WORDS,
            pause=0.0,
            clients=9,
            fields={"max_tokens": 200, "min_tokens": 200, "stream": True},
        )
        wait_for("plain under the force (kv_cache)", lambda: "(kv_cache); draft-length cap now 0" in log(), 90)
        assert "plain" in states().values()
        traffic.stop()
        wait_for(
            "the forced level back (kv_cache_cleared)",
            lambda: "(kv_cache_cleared)" in log() and set(states().values()) == {"speculating"},
            90,
        )
        assert "force_expired" not in log() and "force_release" not in log()  # the force held throughout
    finally:
        if traffic is not None:
            traffic.stop()
        call(url, {"mode": "auto"})
        control.stop()
    assert not traffic.errors, traffic.errors[:3]
