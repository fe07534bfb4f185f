"""The generated Prometheus rules, checked by Prometheus's own promtool: `check rules`, and `test rules` unit tests
per alert (fires past its threshold once its `for` has passed, not before; silent below the threshold and below the
traffic guard); and every metric the rules read exists in a scrape of a real tritonserver serving the tiny pair."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from trtspec.deploy.monitoring import ALERTS, PANELS, RECORDING_RULES, write_monitoring

PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: apt install prometheus)")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus not installed (Debian: apt install prometheus)"
)
MODEL = 'model="tensorrt_llm_bls"'
MINUTES = 40


def counter(name: str, per_minute: float, **labels) -> dict:
    label_text = ",".join([MODEL] + [f'{k}="{v}"' for k, v in labels.items()])
    return {"series": f"{name}{{{label_text}}}", "values": f"0+{per_minute:g}x{MINUTES}"}


def traffic(requests_per_minute: float, errors_per_minute: float = 0.0, latency_bucket: str = "1") -> list[dict]:
    """Requests and errors at these rates, every request's latency in the bucket ending at `latency_bucket`."""
    edges = ["0.1", "0.25", "0.5", "1", "2", "3", "5", "10", "30", "60", "120", "+Inf"]
    at = edges.index(latency_bucket)
    series = [
        counter("trtspec_requests_total", requests_per_minute, mode="plain"),
        counter("trtspec_request_errors_total", errors_per_minute, kind="engine_error"),
    ]
    series += [
        counter("trtspec_request_duration_seconds_bucket", requests_per_minute if i >= at else 0, mode="plain", le=edge)
        for i, edge in enumerate(edges)
    ]
    return series


def drafting(draft_per_minute: float, accepted_per_minute: float, break_even: float = 0.4) -> list[dict]:
    return traffic(60) + [
        counter("trtspec_draft_tokens_total", draft_per_minute),
        counter("trtspec_accepted_tokens_total", accepted_per_minute),
        {"series": f'trtspec_break_even_acceptance{{{MODEL},load="1"}}', "values": f"{break_even}x{MINUTES}"},
    ]


def gauge(series: str, value: float) -> dict:
    """A gauge below any threshold for two minutes, then at `value` (so an alert's `for` counts from minute 2, as
    for the rates)."""
    return {"series": series, "values": f"0 0 {value:g}x{MINUTES - 2}"}


def draft_errors(requests_per_minute: float, errors_per_minute: float) -> list[dict]:
    return traffic(requests_per_minute) + [counter("trtspec_fallbacks_total", errors_per_minute, reason="draft_error")]


def kv_cache(fraction: float, requests_per_minute: float = 60) -> list[dict]:
    """The target engine model's KV blocks, `fraction` of 1000 in use."""
    blocks = 'nv_trt_llm_kv_cache_block_metrics{{model="tensorrt_llm",version="1",kv_cache_block_type="{}"}}'
    return traffic(requests_per_minute) + [
        gauge(blocks.format("used"), 1000 * fraction),
        {"series": blocks.format("max"), "values": f"1000x{MINUTES}"},
    ]


GPU = 'instance="server:8002"'


def gpu_memory(fraction: float, planned: float = 0.93, requests_per_minute: float = 60) -> list[dict]:
    """One GPU of 80 units, `fraction` of them used, against a planned steady `planned`."""
    return traffic(requests_per_minute) + [
        gauge(f'nv_gpu_memory_used_bytes{{{GPU},gpu_uuid="GPU-0"}}', 80 * fraction),
        {"series": f'nv_gpu_memory_total_bytes{{{GPU},gpu_uuid="GPU-0"}}', "values": f"80x{MINUTES}"},
        {"series": f"trtspec_gpu_memory_planned_ratio{{{GPU},{MODEL}}}", "values": f"{planned}x{MINUTES}"},
    ]


def engine_failing(failures: float, requests_per_minute: float = 60) -> list[dict]:
    """The target engine model failing every call from minute 2 (`failures` in a row, the first at 120 s)."""
    engine = f'{MODEL},engine="tensorrt_llm"'
    return traffic(requests_per_minute, requests_per_minute) + [
        gauge(f"trtspec_engine_consecutive_failures{{{engine}}}", failures),
        gauge(f"trtspec_engine_failing_since_timestamp_seconds{{{engine}}}", 120),
    ]


def expected(name: str) -> list[dict]:
    alert = next(a for a in ALERTS if a.name == name)
    where = (
        {"model": "tensorrt_llm"}
        if name.startswith("TrtspecKvCache")
        else {"instance": "server:8002"}
        if name.startswith("TrtspecGpuMemory")
        else {"model": "tensorrt_llm_bls"}
    )
    if name == "TrtspecEngineNotAnswering":
        where |= {"engine": "tensorrt_llm"}
    labels = {"severity": alert.severity} | where | ({"trtspec_mode": alert.forces} if alert.forces else {})
    return [
        {
            "exp_labels": labels,
            "exp_annotations": {"summary": alert.summary, "action": alert.action, "runbook": alert.runbook},
        }
    ]


def minutes(duration: str) -> int:
    return int(re.fullmatch(r"(\d+)m", duration).group(1))


# (alert, input series where it must fire, where it must not: below the threshold, below the traffic guard)
CASES = {
    "TrtspecLatencyP99High": (
        traffic(60, latency_bucket="5"),
        traffic(60, latency_bucket="3"),
        traffic(1, latency_bucket="5"),
    ),
    "TrtspecLatencyP99Critical": (
        traffic(60, latency_bucket="10"),
        traffic(60, latency_bucket="5"),
        traffic(1, latency_bucket="10"),
    ),
    "TrtspecErrorRatioHigh": (traffic(60, 3), traffic(60, 0.6), traffic(1, 1)),
    "TrtspecErrorRatioCritical": (traffic(60, 6), traffic(60, 3), traffic(1, 1)),
    "TrtspecAcceptanceBelowBreakEven": (drafting(600, 60), drafting(600, 300), drafting(30, 3)),
    "TrtspecDraftModelFailing": (draft_errors(60, 6), draft_errors(60, 2), draft_errors(1, 1)),
    "TrtspecEngineNotAnswering": (engine_failing(5), engine_failing(2), engine_failing(5, requests_per_minute=1)),
    "TrtspecKvCacheHigh": (kv_cache(0.95), kv_cache(0.90), kv_cache(0.95, requests_per_minute=1)),
    "TrtspecKvCacheCritical": (kv_cache(0.99), kv_cache(0.96), kv_cache(0.99, requests_per_minute=1)),
    # below: past 92 % but within the plan (TensorRT-LLM's KV reservation), where it sits from the start
    "TrtspecGpuMemoryHigh": (gpu_memory(0.96), gpu_memory(0.94), gpu_memory(0.96, requests_per_minute=1)),
    "TrtspecGpuMemoryCritical": (
        gpu_memory(0.99),
        gpu_memory(0.96, planned=0.96),
        gpu_memory(0.99, requests_per_minute=1),
    ),
}


def test_every_alert_has_its_cases():
    assert sorted(CASES) == sorted(a.name for a in ALERTS)


@needs_promtool
def test_promtool_checks_the_rules(tmp_path):
    path = write_monitoring(tmp_path)[0]
    result = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(RECORDING_RULES) + len(ALERTS)} rules found" in result.stdout


@needs_promtool
@pytest.mark.parametrize("name", sorted(CASES))
def test_promtool_unit_tests_per_alert(tmp_path, name):
    path = write_monitoring(tmp_path)[0]
    alert = next(a for a in ALERTS if a.name == name)
    fires, below, quiet = CASES[name]
    settle = MINUTES - 5  # well past the rate window and the alert's `for`
    assert minutes(alert.for_) + 6 < settle
    tests = [
        {
            "interval": "1m",
            "input_series": fires,
            "alert_rule_test": [
                {"eval_time": f"{settle}m", "alertname": name, "exp_alerts": expected(name)},
                # the condition holds from about the second minute; before its `for` has passed it is only pending
                {"eval_time": f"{minutes(alert.for_)}m", "alertname": name, "exp_alerts": []},
            ],
        },
        {
            "interval": "1m",
            "input_series": below,
            "alert_rule_test": [{"eval_time": f"{settle}m", "alertname": name, "exp_alerts": []}],
        },
        {
            "interval": "1m",
            "input_series": quiet,
            "alert_rule_test": [{"eval_time": f"{settle}m", "alertname": name, "exp_alerts": []}],
        },
    ]
    spec = tmp_path / "test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [path.name], "evaluation_interval": "1m", "tests": tests}))
    result = subprocess.run([PROMTOOL, "test", "rules", spec.name], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@contextlib.contextmanager
def prometheus_scraping(server, rules: Path, root: Path):
    """A real Prometheus on loopback evaluating `rules` and scraping `server` every second; yields its query
    function (PromQL -> result list, asserting success) and stops it on exit."""
    import os
    import signal
    import time

    from trtspec.server import free_port

    port = free_port()
    config = root / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(rules)],
                "scrape_configs": [
                    {
                        "job_name": "trtspec",
                        "static_configs": [{"targets": [server.metrics_url.split("//")[1].split("/")[0]]}],
                    }
                ],
            }
        )
    )
    prometheus = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={root / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def api(path: str, **params):
        url = f"http://127.0.0.1:{port}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
        body = json.load(urllib.request.urlopen(url, timeout=10))
        assert body["status"] == "success", body
        return body["data"]

    try:
        # ready, not just listening: Prometheus answers 503 on its port until its storage has started
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:  # not listening yet (URLError), or 503 while starting (HTTPError)
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.5)
        yield api
    finally:
        os.killpg(prometheus.pid, signal.SIGTERM)
        prometheus.wait(timeout=30)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """A real tritonserver serving the tiny pair, after requests of each kind (speculative, plain, streamed, refused
    as bad, past their deadline), and its scrape; with a real Prometheus scraping it every second and evaluating
    the generated rules when Debian's prometheus is installed (else None)."""
    import time

    from support.tiny import served_pair
    from test_serving import grpc_generate
    from tritonclient.utils import InferenceServerException

    root = tmp_path_factory.mktemp("monitoring")
    server = served_pair(root / "pair")
    server.start(timeout=300)
    try:
        rules = write_monitoring(root / "monitoring")[0]
        with prometheus_scraping(server, rules, root) if PROMETHEUS is not None else contextlib.nullcontext() as api:
            prompt = "The quick brown fox"
            for _ in range(3):
                for fields in (
                    {"num_draft_tokens": 4, "adaptive_draft_length": False},
                    {"num_draft_tokens": 4},
                    {"num_draft_tokens": 0},
                    {"num_draft_tokens": 0, "stream": True},
                ):
                    grpc_generate(server.grpc_url, {"text_input": prompt, "max_tokens": 12, **fields})
                for bad in ({"max_tokens": 0}, {"max_tokens": 200, "timeout_ms": 1, "num_draft_tokens": 0}):
                    with pytest.raises(InferenceServerException):
                        grpc_generate(server.grpc_url, {"text_input": prompt, **bad})
                time.sleep(1.5)
            time.sleep(3)  # two more scrapes and rule evaluations
            scrape = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
            query = (lambda expr: api("query", query=expr)["result"]) if api is not None else None
            yield scrape, query
    finally:
        server.stop()


def test_every_metric_the_rules_and_panels_read_is_exported(scraped):
    """The names the rules and the dashboard query, against a scrape of a real tritonserver serving the tiny pair
    (a rule on a name nobody exports can never fire, and promtool accepts it). The GPU panels read TensorRT-LLM's
    and the GPU's `nv_*` metrics, which the embedded engine on a CPU does not have."""
    scrape, _ = scraped
    exported = {line.split("{")[0].split(" ")[0] for line in scrape.splitlines() if line and not line.startswith("#")}
    text = " ".join(
        [
            *RECORDING_RULES.values(),
            *(a.expr for a in ALERTS),
            *(q for p in PANELS if not p.gpu_only for q, _ in p.queries),
        ]
    )
    queried = set(re.findall(r"\b(?:trtspec|nv)_[a-z0-9_]+", text))  # metric names (recorded ones have a colon)
    # the GPU's memory, and the plan for it, exist on GPU deployments only
    queried -= {"nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes", "trtspec_gpu_memory_planned_ratio"}
    assert queried and not queried - exported, f"not exported: {sorted(queried - exported)}"
    kv = [line for line in scrape.splitlines() if line.startswith("nv_trt_llm_kv_cache_block_metrics{")]
    assert {re.search(r'kv_cache_block_type="(\w+)"', line).group(1) for line in kv} >= {
        "used",
        "max",
        "free",
        "fraction",
    }
    assert {re.search(r'model="(\w+)"', line).group(1) for line in kv} == {"tensorrt_llm", "tensorrt_llm_draft"}
    for histogram in (
        "trtspec_request_duration_seconds",
        "trtspec_time_to_first_token_seconds",
        "trtspec_time_per_output_token_seconds",
    ):
        assert f"{histogram}_bucket" in exported


@needs_prometheus
def test_every_dashboard_query_returns_data_from_a_real_prometheus(scraped):
    _, query = scraped
    for name in RECORDING_RULES:
        if name != "trtspec:gpu_memory_used:ratio":  # GPU deployments only
            assert query(name), f"the recording rule {name} has no data"
    for panel in PANELS:
        if panel.gpu_only:
            continue
        for expr, _ in panel.queries:
            assert query(expr.replace("$model", "tensorrt_llm_bls")), f"{panel.title}: no data for {expr}"


def test_validate_monitoring_finds_stale_files(tmp_path):
    from click.testing import CliRunner

    from trtspec.cli import cli

    write_monitoring(tmp_path)
    assert CliRunner().invoke(cli, ["validate", "monitoring", str(tmp_path)]).exit_code == 0
    rules = tmp_path / "prometheus-rules.yaml"
    rules.write_text(rules.read_text().replace("trtspec_request_errors_total", "trtspec_request_errors"))
    result = CliRunner().invoke(cli, ["validate", "monitoring", str(tmp_path)])
    assert result.exit_code == 1 and "prometheus-rules.yaml" in result.output and "--monitoring" in result.output
    (tmp_path / "grafana-dashboard.json").unlink()
    assert "grafana-dashboard.json" in CliRunner().invoke(cli, ["validate", "monitoring", str(tmp_path)]).output


AMTOOL = shutil.which("amtool")
ALERTMANAGER = shutil.which("alertmanager") or shutil.which("prometheus-alertmanager")  # Debian names it so


@pytest.mark.skipif(AMTOOL is None, reason="amtool not installed (Debian: apt install prometheus-alertmanager)")
def test_amtool_checks_the_alertmanager_example_and_its_routes(tmp_path):
    write_monitoring(tmp_path)
    config = str(tmp_path / "alertmanager.yml")
    check = subprocess.run([AMTOOL, "check-config", config], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    for alert in ALERTS:  # each alert that asks for a mode reaches the governor's receiver, the others do not
        labels = [f"alertname={alert.name}", f"severity={alert.severity}"] + (
            [f"trtspec_mode={alert.forces}"] if alert.forces else []
        )
        routed = subprocess.run(
            [AMTOOL, "config", "routes", "test", f"--config.file={config}", *labels], capture_output=True, text=True
        )
        assert ("trtspec-governor" in routed.stdout) == bool(alert.forces), (alert.name, routed.stdout)


@pytest.mark.skipif(
    ALERTMANAGER is None, reason="alertmanager not installed (Debian: apt install prometheus-alertmanager)"
)
def test_a_real_alertmanager_forces_and_releases_through_the_control_receiver(tmp_path):
    """The generated example, with its waits shortened and its URL pointed at a control receiver: a critical error
    alert makes Alertmanager call the receiver, which forces plain decoding; resolving it releases the force."""
    import time

    from conftest import free_ports
    from test_control import TOKEN

    from trtspec.control import ControlServer, read

    control = ControlServer(tmp_path / "force.json", token=TOKEN).start()
    port = free_ports(1)[0]
    write_monitoring(tmp_path)
    config = yaml.safe_load((tmp_path / "alertmanager.yml").read_text())
    config["route"] |= {"group_wait": "1s", "group_interval": "1s"}
    webhook = config["receivers"][1]["webhook_configs"][0]
    webhook["url"] = f"http://127.0.0.1:{control.port}/alertmanager"
    # the example's token file, here a copy of this receiver's token (the receiver refuses a call without it)
    (tmp_path / "token").write_text(TOKEN + "\n")
    webhook["http_config"]["authorization"]["credentials_file"] = str(tmp_path / "token")
    (tmp_path / "am.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [
            ALERTMANAGER,
            f"--config.file={tmp_path / 'am.yml'}",
            f"--storage.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    api = f"http://127.0.0.1:{port}/api/v2/alerts"
    critical = next(a for a in ALERTS if a.name == "TrtspecErrorRatioCritical")
    labels = {
        "alertname": critical.name,
        "severity": critical.severity,
        "trtspec_mode": critical.forces,
        "model": "tensorrt_llm_bls",
    }

    def post(ends_in: float) -> None:
        now = time.time()
        stamp = lambda t: time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + "Z"  # noqa: E731
        body = json.dumps([{"labels": labels, "startsAt": stamp(now - 60), "endsAt": stamp(now + ends_in)}]).encode()
        urllib.request.urlopen(
            urllib.request.Request(api, data=body, headers={"Content-Type": "application/json"}), timeout=5
        )

    def wait_for(predicate, seconds: float = 30.0):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if predicate():
                return True
            time.sleep(0.2)
        return False

    try:
        assert wait_for(lambda: _answers(f"http://127.0.0.1:{port}/-/ready")), "alertmanager did not start"
        post(300)
        assert wait_for(lambda: (read(control.path) or None) is not None), "no force after the alert fired"
        force = read(control.path)
        assert force.mode == "plain" and force.source == "alertmanager" and critical.name in force.reason
        post(-1)  # resolved
        assert wait_for(lambda: read(control.path) is None), "the force outlived the resolved alert"
    finally:
        proc.terminate()
        proc.wait(10)
        control.stop()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
