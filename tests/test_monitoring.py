"""The generated Prometheus rules, checked by Prometheus's own promtool: `check rules`, and `test rules` unit tests
per alert (fires past its threshold once its `for` has passed, not before; silent below the threshold and below the
traffic guard); and every metric the rules read exists in a scrape of a real tritonserver serving the tiny pair."""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request

import pytest
import yaml

from trtspec.monitoring import ALERTS, RECORDING_RULES, write_monitoring

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: apt install prometheus)")
MODEL = 'model="tensorrt_llm_bls"'
MINUTES = 40


def counter(name: str, per_minute: float, **labels) -> dict:
    label_text = ",".join([MODEL] + [f'{k}="{v}"' for k, v in labels.items()])
    return {"series": f"{name}{{{label_text}}}", "values": f"0+{per_minute:g}x{MINUTES}"}


def traffic(requests_per_minute: float, errors_per_minute: float = 0.0, latency_bucket: str = "1") -> list[dict]:
    """Requests and errors at these rates, every request's latency in the bucket ending at `latency_bucket`."""
    edges = ["0.1", "0.25", "0.5", "1", "2", "3", "5", "10", "30", "60", "120", "+Inf"]
    at = edges.index(latency_bucket)
    series = [counter("trtspec_requests_total", requests_per_minute, mode="plain"),
              counter("trtspec_request_errors_total", errors_per_minute, kind="engine_error")]
    series += [counter("trtspec_request_duration_seconds_bucket", requests_per_minute if i >= at else 0,
                       mode="plain", le=edge) for i, edge in enumerate(edges)]
    return series


def drafting(draft_per_minute: float, accepted_per_minute: float, break_even: float = 0.4) -> list[dict]:
    return traffic(60) + [counter("trtspec_draft_tokens_total", draft_per_minute),
                          counter("trtspec_accepted_tokens_total", accepted_per_minute),
                          {"series": f'trtspec_break_even_acceptance{{{MODEL},load="1"}}',
                           "values": f"{break_even}x{MINUTES}"}]


def expected(name: str) -> list[dict]:
    alert = next(a for a in ALERTS if a.name == name)
    return [{"exp_labels": {"severity": alert.severity, "model": "tensorrt_llm_bls"},
             "exp_annotations": {"summary": alert.summary, "action": alert.action, "runbook": alert.runbook}}]


def minutes(duration: str) -> int:
    return int(re.fullmatch(r"(\d+)m", duration).group(1))


# (alert, input series where it must fire, where it must not: below the threshold, below the traffic guard)
CASES = {
    "TrtspecLatencyP99High": (traffic(60, latency_bucket="5"), traffic(60, latency_bucket="3"),
                              traffic(1, latency_bucket="5")),
    "TrtspecLatencyP99Critical": (traffic(60, latency_bucket="10"), traffic(60, latency_bucket="5"),
                                  traffic(1, latency_bucket="10")),
    "TrtspecErrorRatioHigh": (traffic(60, 3), traffic(60, 0.6), traffic(1, 1)),
    "TrtspecErrorRatioCritical": (traffic(60, 6), traffic(60, 3), traffic(1, 1)),
    "TrtspecAcceptanceBelowBreakEven": (drafting(600, 60), drafting(600, 300), drafting(30, 3)),
}


def test_every_alert_has_its_cases():
    assert sorted(CASES) == sorted(a.name for a in ALERTS)


@needs_promtool
def test_promtool_checks_the_rules(tmp_path):
    (path,) = write_monitoring(tmp_path)
    result = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(RECORDING_RULES) + len(ALERTS)} rules found" in result.stdout


@needs_promtool
@pytest.mark.parametrize("name", sorted(CASES))
def test_promtool_unit_tests_per_alert(tmp_path, name):
    (path,) = write_monitoring(tmp_path)
    alert = next(a for a in ALERTS if a.name == name)
    fires, below, quiet = CASES[name]
    settle = MINUTES - 5  # well past the rate window and the alert's `for`
    assert minutes(alert.for_) + 6 < settle
    tests = [
        {"interval": "1m", "input_series": fires, "alert_rule_test": [
            {"eval_time": f"{settle}m", "alertname": name, "exp_alerts": expected(name)},
            # the condition holds from about the second minute; before its `for` has passed it is only pending
            {"eval_time": f"{minutes(alert.for_)}m", "alertname": name, "exp_alerts": []}]},
        {"interval": "1m", "input_series": below, "alert_rule_test": [
            {"eval_time": f"{settle}m", "alertname": name, "exp_alerts": []}]},
        {"interval": "1m", "input_series": quiet, "alert_rule_test": [
            {"eval_time": f"{settle}m", "alertname": name, "exp_alerts": []}]},
    ]
    spec = tmp_path / "test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [path.name], "evaluation_interval": "1m", "tests": tests}))
    result = subprocess.run([PROMTOOL, "test", "rules", spec.name], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_metric_the_rules_read_is_exported(tmp_path):
    """The names the rules query, taken against a scrape of a real tritonserver serving the tiny pair after one
    request (a rule on a name nobody exports can never fire, and promtool accepts it)."""
    from test_serving import grpc_generate
    from tiny import served_pair

    server = served_pair(tmp_path)
    server.start(timeout=300)
    try:
        grpc_generate(server.grpc_url, {"text_input": "The quick brown fox", "max_tokens": 8, "num_draft_tokens": 4})
        scrape = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    finally:
        server.stop()
    exported = {line.split("{")[0].split(" ")[0] for line in scrape.splitlines() if line and not line.startswith("#")}
    text = " ".join(RECORDING_RULES.values()) + " " + " ".join(a.expr for a in ALERTS)
    queried = set(re.findall(r"\b(?:trtspec|nv)_[a-z0-9_]+", text))  # metric names (recorded ones have a colon)
    assert queried and not queried - exported, f"not exported: {sorted(queried - exported)}"
