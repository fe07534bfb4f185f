"""Prometheus recording and alerting rules for a deployment's metrics (docs/metrics.md), from one table of
thresholds: `trtspec deploy --monitoring DIR` writes them as `prometheus-rules.yaml`.

The thresholds are the operators' own: request latency p99 above 3 s is a warning and above 5 s critical (roll back
to plain decoding); an error ratio above 2 % a warning and above 5 % critical (roll back at once); acceptance below
the break-even the deployment has learned means drafting costs more than it returns. Every alert names the action
it asks for and a runbook line, and holds its fire below a minimum of traffic, where a ratio or a percentile of a
few requests says nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

RULES_FILE = "prometheus-rules.yaml"
WINDOW = "5m"
# Below this many finished requests per second (15 in the 5-minute window) no alert fires.
MIN_REQUESTS_PER_SECOND = 0.05
# Below this many draft tokens per second the acceptance says nothing either.
MIN_DRAFT_TOKENS_PER_SECOND = 1.0
ROLL_BACK = ("roll back to plain decoding: `trtspec deploy --default-num-draft-tokens 0` (or requests with "
             "num_draft_tokens 0), then find the cause")


@dataclass(frozen=True)
class Alert:
    name: str
    severity: str      # warning | critical
    condition: str     # PromQL over the recording rules, before the traffic guard
    threshold: float
    for_: str
    action: str
    summary: str
    runbook: str
    guard: str = "trtspec:requests_finished:rate5m"
    guard_minimum: float = MIN_REQUESTS_PER_SECOND

    @property
    def expr(self) -> str:
        return (f"({self.condition.format(threshold=self.threshold)}) "
                f"and on (model) ({self.guard} >= {self.guard_minimum:g})")


RECORDING_RULES = {
    "trtspec:requests_finished:rate5m": f"sum by (model) (rate(trtspec_requests_total[{WINDOW}])) + "
                                        f"sum by (model) (rate(trtspec_request_errors_total[{WINDOW}]))",
    "trtspec:request_error_ratio:rate5m": f"sum by (model) (rate(trtspec_request_errors_total[{WINDOW}])) / "
                                          "trtspec:requests_finished:rate5m",
    "trtspec:request_duration_seconds:p99_5m": "histogram_quantile(0.99, sum by (model, le) "
                                               f"(rate(trtspec_request_duration_seconds_bucket[{WINDOW}])))",
    "trtspec:draft_tokens:rate5m": f"sum by (model) (rate(trtspec_draft_tokens_total[{WINDOW}]))",
    "trtspec:acceptance:ratio_rate5m": f"sum by (model) (rate(trtspec_accepted_tokens_total[{WINDOW}])) / "
                                       "trtspec:draft_tokens:rate5m",
}

ALERTS = [
    Alert("TrtspecLatencyP99High", "warning", "trtspec:request_duration_seconds:p99_5m > {threshold}", 3.0, "5m",
          ROLL_BACK + " if it lasts", "Request latency p99 is above 3 s",
          "Compare trtspec_request_duration_seconds by mode: if speculative requests are the slow ones, lower "
          "num_draft_tokens or roll back; if both are, the server is overloaded (scale out)."),
    Alert("TrtspecLatencyP99Critical", "critical", "trtspec:request_duration_seconds:p99_5m > {threshold}", 5.0, "2m",
          ROLL_BACK, "Request latency p99 is above 5 s",
          "Roll back to plain decoding now; then compare latency by mode and the engines' queue "
          "(nv_inference_pending_request_count)."),
    Alert("TrtspecErrorRatioHigh", "warning", "trtspec:request_error_ratio:rate5m > {threshold}", 0.02, "5m",
          ROLL_BACK + " if it lasts", "More than 2 % of requests fail",
          "trtspec_request_errors_total by kind: bad_request is the clients'; timeout and refused mean overload; "
          "engine_error is the server's (its log says which engine)."),
    Alert("TrtspecErrorRatioCritical", "critical", "trtspec:request_error_ratio:rate5m > {threshold}", 0.05, "1m",
          ROLL_BACK + ", at once", "More than 5 % of requests fail",
          "Roll back at once; then read trtspec_request_errors_total by kind and the server log."),
    Alert("TrtspecAcceptanceBelowBreakEven", "warning",
          "trtspec:acceptance:ratio_rate5m < on (model) max by (model) (trtspec_break_even_acceptance{{load=\"1\"}})",
          0.0, "15m", "use fewer draft tokens, or plain decoding, for this traffic",
          "Acceptance is below the break-even: drafting costs more than it returns",
          "The draft model does not predict this traffic; the adaptive draft length backs off per request, but "
          "each request pays to find out. Check trtspec_accepted_tokens_by_position_total for where acceptance "
          "falls, and consider speculation prompt_lookup or a better-matched draft.",
          guard="trtspec:draft_tokens:rate5m", guard_minimum=MIN_DRAFT_TOKENS_PER_SECOND),
]


def rules() -> dict:
    """The rule file: a group of recording rules and a group of alerts."""
    return {"groups": [
        {"name": "trtspec-recording", "rules": [{"record": name, "expr": expr} for name, expr in RECORDING_RULES.items()]},
        {"name": "trtspec-alerts", "rules": [
            {"alert": a.name, "expr": a.expr, "for": a.for_,
             "labels": {"severity": a.severity},
             "annotations": {"summary": a.summary, "action": a.action, "runbook": a.runbook}}
            for a in ALERTS]},
    ]}


def write_monitoring(out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RULES_FILE
    path.write_text("# Written by `trtspec deploy --monitoring`; thresholds in trtspec/monitoring.py.\n"
                    + yaml.safe_dump(rules(), sort_keys=False, width=120))
    return [path]
