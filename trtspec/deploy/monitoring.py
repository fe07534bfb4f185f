"""Prometheus recording and alerting rules and a Grafana dashboard for a deployment's metrics (docs/metrics.md),
from one table of thresholds: `trtspec deploy --monitoring DIR` writes `prometheus-rules.yaml` and
`grafana-dashboard.json`.

The thresholds are the operators' own: request latency p99 above 3 s is a warning and above 5 s critical (roll back
to plain decoding); an error ratio above 2 % a warning and above 5 % critical (roll back at once); acceptance below
the break-even the deployment has learned means drafting costs more than it returns; GPU memory above
92 % / 97 % asks for fewer draft tokens. On TensorRT-LLM the KV cache is reserved when the engines load, so GPU
memory sits near its planned
level from the first minute: the memory alerts fire only above both the threshold and the plan
(trtspec_gpu_memory_planned_ratio), and the same thresholds apply to the KV-cache blocks in use, the memory that moves
with load (the governor acts on those itself). Every alert names the action it asks for and a runbook line, and holds
its fire below a minimum of traffic, where a ratio or a percentile of a few requests says nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from trtspec.orchestrator.governor import KV_CRITICAL, KV_WARNING

RULES_FILE = "prometheus-rules.yaml"
DASHBOARD_FILE = "grafana-dashboard.json"
ALERTMANAGER_FILE = "alertmanager.yml"
# The control receiver the Alertmanager example sends to: `trtspec serve --control-port 8004` (trtspec.control).
EXAMPLE_CONTROL_URL = "http://127.0.0.1:8004/alertmanager"
# The receiver's token, copied where Alertmanager can read it: the file `trtspec serve` names at start.
EXAMPLE_CONTROL_TOKEN_FILE = "/etc/alertmanager/trtspec-control-token"
WINDOW = "5m"
# Below this many finished requests per second (15 in the 5-minute window) no alert fires.
MIN_REQUESTS_PER_SECOND = 0.05
# Below this many draft tokens per second the acceptance says nothing either.
MIN_DRAFT_TOKENS_PER_SECOND = 1.0
ROLL_BACK = (
    "roll back to plain decoding: `trtspec deploy --default-num-draft-tokens 0` (or requests with "
    "num_draft_tokens 0), then find the cause"
)


@dataclass(frozen=True)
class Alert:
    name: str
    severity: str  # warning | critical
    condition: str  # PromQL over the recording rules, before the traffic guard
    threshold: float
    for_: str
    action: str
    summary: str
    runbook: str
    guard: str = "trtspec:requests_finished:rate5m"
    guard_minimum: float = MIN_REQUESTS_PER_SECOND
    forces: str | None = None  # the mode Alertmanager forces through trtspec serve's control receiver while it fires
    guard_on: str = "model"  # the label the condition and the guard share ("": the deployment's whole traffic)

    @property
    def expr(self) -> str:
        guard = self.guard if self.guard_on else f"sum({self.guard})"
        return (
            f"({self.condition.format(threshold=self.threshold)}) "
            f"and on ({self.guard_on}) ({guard} >= {self.guard_minimum:g})"
        )


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
    "trtspec:draft_error_ratio:rate5m": "sum by (model) "
    f'(rate(trtspec_fallbacks_total{{reason="draft_error"}}[{WINDOW}])) / '
    "trtspec:requests_finished:rate5m",
    # per engine model (label model: tensorrt_llm, tensorrt_llm_draft): TensorRT-LLM's family, which the embedded
    # engine reports too
    "trtspec:kv_cache_used:ratio": 'max by (model) (nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used"}) / '
    'max by (model) (nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"} > 0)',
    # the fullest GPU of each scraped server
    "trtspec:gpu_memory_used:ratio": "max by (instance) (nv_gpu_memory_used_bytes / nv_gpu_memory_total_bytes)",
}
FEWER_DRAFTS = (
    "fewer draft tokens: `trtspec deploy --default-num-draft-tokens` lower, or force `reduced` through "
    "`trtspec serve --control-port`"
)
# above the plan by more than this, GPU memory is not the KV reservation TensorRT-LLM makes at start
ABOVE_PLAN = 0.02
GPU_MEMORY = (
    "{threshold} and on (instance) trtspec:gpu_memory_used:ratio > on (instance) "
    f"(max by (instance) (trtspec_gpu_memory_planned_ratio) + {ABOVE_PLAN:g})"
)

ALERTS = [
    Alert(
        "TrtspecLatencyP99High",
        "warning",
        "trtspec:request_duration_seconds:p99_5m > {threshold}",
        3.0,
        "5m",
        ROLL_BACK + " if it lasts",
        "Request latency p99 is above 3 s",
        "Compare trtspec_request_duration_seconds by mode: if speculative requests are the slow ones, lower "
        "num_draft_tokens or roll back; if both are, the server is overloaded (scale out).",
    ),
    Alert(
        "TrtspecLatencyP99Critical",
        "critical",
        "trtspec:request_duration_seconds:p99_5m > {threshold}",
        5.0,
        "2m",
        ROLL_BACK,
        "Request latency p99 is above 5 s",
        "Roll back to plain decoding now; then compare latency by mode and the engines' queue "
        "(nv_inference_pending_request_count).",
        forces="plain",
    ),
    Alert(
        "TrtspecErrorRatioHigh",
        "warning",
        "trtspec:request_error_ratio:rate5m > {threshold}",
        0.02,
        "5m",
        ROLL_BACK + " if it lasts",
        "More than 2 % of requests fail",
        "trtspec_request_errors_total by kind: bad_request is the clients'; timeout and refused mean overload; "
        "engine_error is the server's (its log says which engine).",
    ),
    Alert(
        "TrtspecErrorRatioCritical",
        "critical",
        "trtspec:request_error_ratio:rate5m > {threshold}",
        0.05,
        "1m",
        ROLL_BACK + ", at once",
        "More than 5 % of requests fail",
        "Roll back at once; then read trtspec_request_errors_total by kind and the server log.",
        forces="plain",
    ),
    Alert(
        "TrtspecAcceptanceBelowBreakEven",
        "warning",
        'trtspec:acceptance:ratio_rate5m < on (model) max by (model) (trtspec_break_even_acceptance{{load="1"}})',
        0.0,
        "15m",
        "use fewer draft tokens, or plain decoding, for this traffic",
        "Acceptance is below the break-even: drafting costs more than it returns",
        "The draft model does not predict this traffic; the adaptive draft length backs off per request, but "
        "each request pays to find out. Check trtspec_accepted_tokens_by_position_total for where acceptance "
        "falls, and consider speculation prompt_lookup or a better-matched draft.",
        guard="trtspec:draft_tokens:rate5m",
        guard_minimum=MIN_DRAFT_TOKENS_PER_SECOND,
        forces="reduced",
    ),
    Alert(
        "TrtspecDraftModelFailing",
        "warning",
        "trtspec:draft_error_ratio:rate5m > {threshold}",
        0.05,
        "1m",
        "bring the draft model back; until then requests decode without it (the governor reduces the draft length)",
        "The draft model fails for more than 5 % of requests",
        "The server log names the draft model's error; the BLS reloads a model whose process died. "
        'trtspec_speculation_changes_total{reason="draft_down"} shows the governor\'s step down.',
    ),
    Alert(
        "TrtspecEngineNotAnswering",
        "critical",
        "(trtspec_engine_consecutive_failures >= {threshold}) and on (model, engine) "
        "(time() - trtspec_engine_failing_since_timestamp_seconds > 60)",
        3,
        "1m",
        "restart the server (the liveness probe on the front's /health/live does it for the target); if it comes "
        "back, replace the GPU or node the server log's error names",
        "An engine model has failed every call for more than a minute",
        "TensorRT-LLM's executor fails every request after a sticky CUDA error (an Xid) while its model stays READY: "
        "only a new process mends it. The server log names the engine's error; a draft model failing so costs speed, "
        "not answers (the draft alerts and the governor cover it).",
    ),
    Alert(
        "TrtspecKvCacheHigh",
        "warning",
        "trtspec:kv_cache_used:ratio > {threshold}",
        KV_WARNING,
        "5m",
        "fewer draft tokens: the governor reduces the draft length while the KV cache is this full",
        "The KV cache is more than 92 % used",
        "Each draft token holds KV cache too. If it lasts at a lower draft length, the server is overloaded: "
        "scale out, or lower max_tokens.",
        guard="trtspec:requests_finished:rate5m",
        guard_on="",
        forces="reduced",
    ),
    Alert(
        "TrtspecKvCacheCritical",
        "critical",
        "trtspec:kv_cache_used:ratio > {threshold}",
        KV_CRITICAL,
        "2m",
        ROLL_BACK + " while it lasts",
        "The KV cache is more than 97 % used",
        "Requests wait for KV cache: plain decoding frees the draft tokens' share; then scale out.",
        guard_on="",
        forces="plain",
    ),
    Alert(
        "TrtspecGpuMemoryHigh",
        "warning",
        "trtspec:gpu_memory_used:ratio > " + GPU_MEMORY,
        0.92,
        "10m",
        FEWER_DRAFTS,
        "GPU memory is above 92 % and above the deployment's plan",
        "Compare nv_gpu_memory_used_bytes with trtspec_gpu_memory_planned_ratio: memory beyond the plan is another "
        "process, activations, or a leak. The KV-cache alerts say whether requests are short of KV.",
        guard_on="",
        forces="reduced",
    ),
    Alert(
        "TrtspecGpuMemoryCritical",
        "critical",
        "trtspec:gpu_memory_used:ratio > " + GPU_MEMORY,
        0.97,
        "2m",
        FEWER_DRAFTS + ", at once",
        "GPU memory is above 97 % and above the deployment's plan",
        "An allocation may fail next: find what holds the memory beyond the plan (nvidia-smi).",
        guard_on="",
        forces="reduced",
    ),
]


def rules() -> dict:
    """The rule file: a group of recording rules and a group of alerts."""
    return {
        "groups": [
            {
                "name": "trtspec-recording",
                "rules": [{"record": name, "expr": expr} for name, expr in RECORDING_RULES.items()],
            },
            {
                "name": "trtspec-alerts",
                "rules": [
                    {
                        "alert": a.name,
                        "expr": a.expr,
                        "for": a.for_,
                        "labels": {"severity": a.severity} | ({"trtspec_mode": a.forces} if a.forces else {}),
                        "annotations": {"summary": a.summary, "action": a.action, "runbook": a.runbook},
                    }
                    for a in ALERTS
                ],
            },
        ]
    }


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]  # (PromQL with $model, legend)
    lines: tuple[float, ...] = ()  # thresholds drawn as lines (the alerts')
    gpu_only: bool = False  # reads TensorRT-LLM's or the GPU's metrics, absent on the embedded engine


M = 'model="$model"'
LATENCY_LINES = tuple(a.threshold for a in ALERTS if a.name.startswith("TrtspecLatencyP99"))


def _per_token(mode: str) -> str:
    return (
        f'(sum(rate(trtspec_request_duration_seconds_sum{{{M},mode="{mode}"}}[{WINDOW}])) / '
        f'sum(rate(trtspec_generated_tokens_total{{{M},mode="{mode}"}}[{WINDOW}])))'
    )


PANELS = [
    Panel(
        "Acceptance against the learned break-even",
        "percentunit",
        (
            (f"trtspec:acceptance:ratio_rate5m{{{M}}}", "acceptance"),
            (f"max by (load) (trtspec_break_even_acceptance{{{M}}})", "break-even, load {{load}}"),
        ),
    ),
    Panel(
        "Acceptance by draft position",
        "percentunit",
        (
            (
                f"sum by (position) (rate(trtspec_accepted_tokens_by_position_total{{{M}}}[{WINDOW}])) / "
                f"sum by (position) (rate(trtspec_draft_tokens_by_position_total{{{M}}}[{WINDOW}]))",
                "position {{position}}",
            ),
        ),
    ),
    Panel(
        "Request latency p99 by mode",
        "s",
        (
            (
                "histogram_quantile(0.99, sum by (mode, le) "
                f"(rate(trtspec_request_duration_seconds_bucket{{{M}}}[{WINDOW}])))",
                "{{mode}}",
            ),
        ),
        lines=LATENCY_LINES,
    ),
    Panel(
        "Time to first token p50 by mode",
        "s",
        (
            (
                "histogram_quantile(0.5, sum by (mode, le) "
                f"(rate(trtspec_time_to_first_token_seconds_bucket{{{M}}}[{WINDOW}])))",
                "{{mode}}",
            ),
        ),
    ),
    # seconds per output token, arrival to last token (the governor's measure): a plain request not streamed has
    # no time per output token of its own (its tokens come at once)
    Panel(
        "Live speed-up: plain over speculative seconds per output token",
        "x",
        ((f"{_per_token('plain')} / {_per_token('speculative')}", "speed-up"),),
    ),
    Panel(
        "Tokens per iteration",
        "none",
        (
            (
                f"sum(rate(trtspec_generated_tokens_total{{{M}}}[{WINDOW}])) / "
                f"sum(rate(trtspec_iterations_total{{{M}}}[{WINDOW}]))",
                "tokens / iteration",
            ),
        ),
    ),
    Panel(
        "Requests by mode", "reqps", ((f"sum by (mode) (rate(trtspec_requests_total{{{M}}}[{WINDOW}]))", "{{mode}}"),)
    ),
    Panel(
        "Errors by kind",
        "reqps",
        (
            (f"sum by (kind) (rate(trtspec_request_errors_total{{{M}}}[{WINDOW}]))", "{{kind}}"),
            (f"trtspec:request_error_ratio:rate5m{{{M}}}", "error ratio"),
        ),
    ),
    Panel(
        "Fallbacks by reason",
        "ops",
        ((f"sum by (reason) (rate(trtspec_fallbacks_total{{{M}}}[{WINDOW}]))", "{{reason}}"),),
    ),
    Panel(
        "KV cache blocks in use",
        "percentunit",
        (("trtspec:kv_cache_used:ratio", "{{model}}"),),
        lines=(KV_WARNING, KV_CRITICAL),
    ),
    Panel(
        "GPU memory used, against the plan",
        "percentunit",
        (
            ("nv_gpu_memory_used_bytes / nv_gpu_memory_total_bytes", "GPU {{gpu_uuid}}"),
            (f"max(trtspec_gpu_memory_planned_ratio{{{M}}})", "planned"),
        ),
        lines=(0.92, 0.97),
        gpu_only=True,
    ),
]


def dashboard() -> dict:
    """A Grafana dashboard of PANELS, two to a row, with a `model` variable (the BLS model) and a data source
    variable."""
    panels = []
    for i, p in enumerate(PANELS):
        steps = [{"color": "green", "value": None}] + [
            {"color": c, "value": v} for c, v in zip(("orange", "red"), p.lines)
        ]
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": p.title + (" (GPU deployments)" if p.gpu_only else ""),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {
                    "defaults": {
                        "unit": p.unit,
                        "thresholds": {"mode": "absolute", "steps": steps},
                        "custom": {"thresholdsStyle": {"mode": "line" if p.lines else "off"}},
                    },
                    "overrides": [],
                },
                "targets": [
                    {"refId": chr(65 + j), "expr": expr, "legendFormat": legend}
                    for j, (expr, legend) in enumerate(p.queries)
                ],
            }
        )
    return {
        "title": "trtspec speculative decoding",
        "uid": "trtspec",
        "schemaVersion": 38,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "tags": ["trtspec"],
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
                {
                    "name": "model",
                    "type": "query",
                    "label": "BLS model",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": "label_values(trtspec_requests_total, model)",
                    "refresh": 2,
                },
            ]
        },
        "panels": panels,
    }


def alertmanager() -> dict:
    """An Alertmanager configuration that sends the alerts labelled `trtspec_mode` to `trtspec serve`'s control
    receiver, which forces that mode while they fire (renewed every repeat_interval, released once resolved)."""
    return {
        "route": {
            "receiver": "default",
            "group_by": ["alertname", "model"],
            "group_wait": "30s",
            "group_interval": "1m",
            "repeat_interval": "10m",  # under the receiver's 15-minute hold
            "routes": [
                {"receiver": "trtspec-governor", "matchers": ['trtspec_mode=~"plain|reduced"'], "continue": True}
            ],
        },
        "receivers": [
            {"name": "default"},  # your paging receiver goes here
            {
                "name": "trtspec-governor",
                "webhook_configs": [
                    {
                        "url": EXAMPLE_CONTROL_URL,
                        "send_resolved": True,
                        # sent as `Authorization: Bearer <token>`, which the receiver asks of every request
                        "http_config": {"authorization": {"credentials_file": EXAMPLE_CONTROL_TOKEN_FILE}},
                    }
                ],
            },
        ],
    }


def files() -> dict[str, str]:
    """The monitoring files by name, as this version of trtspec writes them."""
    return {
        RULES_FILE: "# Written by `trtspec deploy --monitoring`; thresholds in trtspec/deploy/monitoring.py.\n"
        + yaml.safe_dump(rules(), sort_keys=False, width=120),
        DASHBOARD_FILE: json.dumps(dashboard(), indent=2) + "\n",
        ALERTMANAGER_FILE: "# Written by `trtspec deploy --monitoring`: an example Alertmanager configuration. Alerts\n"
        "# labelled trtspec_mode force that mode through `trtspec serve --control-port 8004`, whose token\n"
        "# (the file `trtspec serve` names at start, or your --control-token-file) Alertmanager sends from\n"
        f"# {EXAMPLE_CONTROL_TOKEN_FILE}: copy it there, readable by Alertmanager only.\n"
        + yaml.safe_dump(alertmanager(), sort_keys=False, width=120),
    }


def write_monitoring(out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files().items():
        (out / name).write_text(text)
        written.append(out / name)
    return written


def stale_monitoring(out_dir: str | Path) -> list[str]:
    """The monitoring files in `out_dir` that are missing or differ from what this version writes (rules that
    query renamed metrics never fire, and promtool would not say so)."""
    out = Path(out_dir)
    return [name for name, text in files().items() if not (out / name).is_file() or (out / name).read_text() != text]
