"""The BLS's metrics on Triton's metrics port (names and meanings in docs/metrics.md): what speculation did, how
long requests took by decoding mode, what failed, and where drafting stops paying.

Names follow Prometheus's conventions: counters end in `_total`, times are seconds, ratios are 0..1. Every trtspec_*
metric carries the label `model` (the BLS model's name). The field's vLLM-named series (trtspec.field_metrics) carry
vLLM's labels instead, `model_name` (the same name) and `engine`, and move with trtspec's own in the same update."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from trtspec import field_metrics as field
from trtspec.engine_health import FAILURES, SINCE, Run
from trtspec.orchestrator.governor import STATES
from trtspec.orchestrator.stats import RequestStats
from trtspec.triton.common import METRIC_CALLS

MODES = ("speculative", "plain")
# what a failed request is counted as: its own fault, past its deadline, refused at the door, or the server's
ERROR_KINDS = ("bad_request", "timeout", "refused", "engine_error")
# why a request was not speculated, or was for only part of it
FALLBACK_REASONS = ("low_acceptance", "load", "draft_error", "governor", "calibration")
# Latency buckets with edges at 3 s and 5 s: the warning and critical thresholds of the alerting rules.
DURATION_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0, 120.0]
TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0]
TPOT_BUCKETS = [0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0]
ACCEPTANCE_BUCKETS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


def time_per_output_token(times_ns: list[int], tokens: int) -> float | None:
    """Seconds per output token after the first (times as Metrics.record takes them), or None when it has no meaning:
    one token, or all of them in one piece (a plain request not streamed: its tokens' times are not seen)."""
    first, last = times_ns[2], times_ns[3]
    return (last - first) / 1e9 / (tokens - 1) if first and last > first and tokens > 1 else None


def seconds_per_output_token(times_ns: list[int], tokens: int) -> float | None:
    """Arrival to last token, per output token: what a request cost whether its tokens came apart or at once."""
    arrival, last = times_ns[0], times_ns[3]
    return (last - arrival) / 1e9 / tokens if last and tokens else None


class Metrics:
    """The BLS's metric families, created once per model instance; `record` and `error` are thread-safe."""

    def __init__(self, model: str, build: dict[str, str], draft_version: str = "1"):
        self._families = []  # a family must outlive its metrics, so every family is kept here
        self._lock = METRIC_CALLS  # shared with every other metric call of the process (see METRIC_CALLS)
        self.labels = {"model": model}
        counter, gauge, histogram = (
            pb_utils.MetricFamily.COUNTER,
            pb_utils.MetricFamily.GAUGE,
            pb_utils.MetricFamily.HISTOGRAM,
        )

        def family(name, description, kind=counter):
            self._families.append(pb_utils.MetricFamily(name=name, description=description, kind=kind))
            return self._families[-1]

        def one(name, description, kind=counter):
            return family(name, description, kind).Metric(labels=self.labels)

        def by_mode(name, description, buckets):
            fam = family(name, description, histogram)
            return {m: fam.Metric(labels=self.labels | {"mode": m}, buckets=buckets) for m in MODES}

        # by the draft model's version (`trtspec promote`), so that a new draft's acceptance is told from the old's
        self._draft = family("trtspec_draft_tokens_total", "Draft tokens proposed to the target, by draft_version")
        self._accepted = family("trtspec_accepted_tokens_total", "Draft tokens the target accepted, by draft_version")
        generated = family("trtspec_generated_tokens_total", "Tokens returned to clients, by decoding mode")
        self._generated = {m: generated.Metric(labels=self.labels | {"mode": m}) for m in MODES}
        self._iterations = one(
            "trtspec_iterations_total", "Draft-then-verify iterations (plain decoding steps included)"
        )
        self._draft_seconds = one("trtspec_draft_seconds_total", "Seconds requests spent drafting")
        self._verify_seconds = one("trtspec_verify_seconds_total", "Seconds requests spent in target calls")
        self._by_position = family(
            "trtspec_accepted_tokens_by_position_total", "Accepted draft tokens by draft position (0 = first)"
        )
        self._drafted_by_position = family(
            "trtspec_draft_tokens_by_position_total", "Draft tokens proposed by draft position (0 = first)"
        )
        requests = family("trtspec_requests_total", "Finished requests by decoding mode")
        self._requests = {m: requests.Metric(labels=self.labels | {"mode": m}) for m in MODES}
        self._fallbacks = family(
            "trtspec_fallbacks_total",
            "Times speculation was switched off for a request, by reason (low_acceptance, load, draft_error, governor)",
        )
        errors = family(
            "trtspec_request_errors_total",
            "Requests that ended in an error, by kind (bad_request, timeout, refused, engine_error)",
        )
        self._errors = {k: errors.Metric(labels=self.labels | {"kind": k}) for k in ERROR_KINDS}
        self._duration = by_mode(
            "trtspec_request_duration_seconds",
            "Request latency, arrival to last response, by decoding mode",
            DURATION_BUCKETS,
        )
        self._ttft = by_mode(
            "trtspec_time_to_first_token_seconds", "Arrival to first token, by decoding mode", TTFT_BUCKETS
        )
        self._tpot = by_mode(
            "trtspec_time_per_output_token_seconds",
            "Mean time per output token after the first, by decoding mode",
            TPOT_BUCKETS,
        )
        self._acceptance = family(
            "trtspec_request_acceptance_ratio",
            "Per request: accepted / drafted tokens (requests that drafted)",
            histogram,
        ).Metric(labels=self.labels, buckets=ACCEPTANCE_BUCKETS)
        self._break_even = family(
            "trtspec_break_even_acceptance",
            "The acceptance below which drafting costs more than it returns, as the deployment's learned costs say, "
            "by load (requests in flight)",
            gauge,
        )
        self._calibration = family(
            "trtspec_calibration_seconds",
            "The engines' costs measured at start (trtspec.calibration), by kind: plain (a step, by batch), verify (a "
            "pass verifying k draft tokens per request, by batch and k), draft (a call of k tokens), round_trip; "
            "plain_long, verify_long, draft_long: the same at batch 1 on the long context (context_tokens)",
            gauge,
        )
        self._info = family(
            "trtspec_build_info",
            "The deployment (value 1): target, draft, quantization, max_draft_len, versions",
            gauge,
        ).Metric(labels=self.labels | build)
        self._info.set(1)
        self._state = family(
            "trtspec_speculation_state",
            "The speculation level of each load range (requests in flight; 1 for the current state): "
            "speculating, reduced, plain, probing (plain, with probes)",
            gauge,
        )
        self._cap = family(
            "trtspec_draft_length_cap",
            "The governor's draft-length cap for new requests, by load (requests in flight; 0: plain)",
            gauge,
        )
        self._changes = family(
            "trtspec_speculation_changes_total",
            "Changes of the speculation level, by load (requests in flight), the state entered and the reason",
        )
        self._planned = family(
            "trtspec_gpu_memory_planned_ratio",
            "The fullest GPU's planned steady memory use, as a "
            "fraction of its memory (TensorRT-LLM reserves its KV cache at start); absent without a "
            "GPU plan",
            gauge,
        )
        # the liveness signal (trtspec.engine_health): read by the OpenAI front's /health/live and the alert rules
        self._failures = family(
            FAILURES,
            "Engine-side failures of calls to an engine model since it last answered, by engine (0: answering)",
            gauge,
        )
        self._failing_since = family(
            SINCE,
            "Unix time of the first of those failures, by engine (0: answering)",
            gauge,
        )
        # the field's schema (trtspec.field_metrics): vLLM's acceptance counters and the endpoint picker's gauges
        self.field_labels = {"model_name": model, "engine": field.ENGINE}
        self._field_spec = {
            key: family(name, description).Metric(labels=self.field_labels)
            for key, name, description in (
                ("drafts", field.SPEC_DRAFTS, "Verification steps that carried a draft (vLLM's num_drafts)"),
                ("drafted", field.SPEC_DRAFT_TOKENS, "Draft tokens proposed (= trtspec_draft_tokens_total)"),
                ("accepted", field.SPEC_ACCEPTED, "Draft tokens accepted (= trtspec_accepted_tokens_total)"),
            )
        }
        self._field_per_pos = family(field.SPEC_ACCEPTED_PER_POS, "Accepted tokens per draft position (0 = first)")
        self._field_gauges = {
            key: family(name, description, gauge)
            for key, name, description in (
                ("waiting", field.REQUESTS_WAITING, "Requests admitted and waiting for the BLS to start them"),
                ("running", field.REQUESTS_RUNNING, "Requests the BLS is serving"),
                ("kv", field.KV_CACHE_USAGE, "The target's KV-cache blocks in use, as a fraction (1 = full)"),
            )
        }
        self._children: dict[tuple, object] = {}  # metrics of families whose label values come as requests do
        self._shown: dict = {}  # the gauges' last values sent
        for reason in FALLBACK_REASONS:  # at 0 from the start, so rates over them (the alerts') have data
            self._child(self._fallbacks, reason=reason)
        self.draft_versions(draft_version)
        # vLLM makes a series per position up to its draft length, at 0 from the start; so does this
        max_draft_len = build.get("max_draft_len", "")
        for i in range(int(max_draft_len) if max_draft_len.isdigit() else 0):
            self._field_child(self._field_per_pos, position=str(i))
        self.requests_in_flight(0, 0)

    def _field_child(self, family, **labels):
        """`family`'s metric for these labels beside vLLM's labels."""
        return self._child(family, base=self.field_labels, **labels)

    def _child(self, family, base: dict | None = None, **labels):
        """`family`'s metric for these labels, made on first use (the caller holds the lock)."""
        key = (id(family), tuple(sorted(labels.items())))  # families live as long as self (_families)
        if key not in self._children:
            self._children[key] = family.Metric(labels=(self.labels if base is None else base) | labels)
        return self._children[key]

    def record(self, stats: RequestStats, times_ns: list[int], draft_version: str = "1") -> None:
        """A finished request: its statistics and its times (arrival, first target call, first and last token,
        nanoseconds of one clock), and the version of the draft model it ran with."""
        mode = "speculative" if stats.num_drafts else "plain"
        arrival, _, first, last = times_ns
        with self._lock:
            drafted, accepted = self.draft_versions(draft_version)
            # each update is a message to the server: counters that did not move are left alone
            for metric, amount in (
                (drafted, stats.num_draft_tokens),
                (accepted, stats.num_accepted_tokens),
                (self._generated[mode], stats.generated_tokens),
                (self._iterations, stats.iterations),
                (self._draft_seconds, stats.draft_seconds),
                (self._verify_seconds, stats.verify_seconds),
                (self._field_spec["drafts"], stats.num_drafts),
                (self._field_spec["drafted"], stats.num_draft_tokens),
                (self._field_spec["accepted"], stats.num_accepted_tokens),
            ):
                if amount:
                    metric.increment(amount)
            for i, (drafted, accepted) in enumerate(zip(stats.drafted_per_position, stats.accepted_per_position)):
                self._child(self._drafted_by_position, position=str(i)).increment(drafted)
                # made at 0 too: a position never accepted reads 0, not no data
                by_position = self._child(self._by_position, position=str(i))
                field_position = self._field_child(self._field_per_pos, position=str(i))
                if accepted:
                    by_position.increment(accepted)
                    field_position.increment(accepted)
            self._requests[mode].increment(1)
            for reason, count in stats.fallbacks.items():
                if count:
                    self._child(self._fallbacks, reason=reason).increment(count)
            if last:
                self._duration[mode].observe((last - arrival) / 1e9)
            if first:
                self._ttft[mode].observe((first - arrival) / 1e9)
            tpot = time_per_output_token(times_ns, stats.generated_tokens)
            if tpot is not None:
                self._tpot[mode].observe(tpot)
            if stats.num_draft_tokens:
                self._acceptance.observe(stats.num_accepted_tokens / stats.num_draft_tokens)

    def draft_versions(self, version: str):
        """The drafted and accepted counters of a draft version, made (at 0) on first use; the caller holds the lock
        or is the constructor."""
        return self._child(self._draft, draft_version=version), self._child(self._accepted, draft_version=version)

    def gpu_memory_planned(self, fraction: float) -> None:
        if fraction > 0:
            with self._lock:
                self._child(self._planned).set(fraction)

    def governor(self, load: str, state: str, cap: int) -> None:
        """A load range's state and cap, sent only when they changed (each update is a message to the server)."""
        with self._lock:
            if (state, cap) == self._shown.get(("governor", load)):
                return
            self._shown[("governor", load)] = (state, cap)
            for name in STATES:
                self._child(self._state, load=load, state=name).set(1 if name == state else 0)
            self._child(self._cap, load=load).set(cap)

    def governor_change(self, load: str, state: str, reason: str) -> None:
        with self._lock:
            self._child(self._changes, load=load, state=state, reason=reason).increment(1)

    def engine_health(self, engine: str, run: Run | None) -> None:
        """An engine model's run of failures (None: it answered), as trtspec.engine_health.EngineHealth reports it."""
        with self._lock:
            self._child(self._failures, engine=engine).set(run.failures if run else 0)
            self._child(self._failing_since, engine=engine).set(run.since if run else 0)

    def requests_in_flight(self, running: int, waiting: int) -> None:
        """The BLS's requests being served and those admitted but not started (vLLM's running and waiting, which the
        endpoint picker routes by); sent when they changed."""
        with self._lock:
            for key, value in (("running", running), ("waiting", waiting)):
                if self._shown.get(key) != value:
                    self._shown[key] = value
                    self._field_child(self._field_gauges[key]).set(value)

    def kv_cache_usage(self, fraction: float | None) -> None:
        """The target's KV-cache blocks in use over its blocks (trtspec.triton.kv_watch); None (not known yet, or
        the server's metrics did not answer) leaves the last value."""
        if fraction is None:
            return
        with self._lock:
            if self._shown.get("kv") != fraction:
                self._shown["kv"] = fraction
                self._field_child(self._field_gauges["kv"]).set(fraction)

    def error(self, kind: str) -> None:
        with self._lock:
            self._errors[kind].increment(1)

    def calibration(self, calibration) -> None:
        """The calibration in use (trtspec.calibration.Calibration), one series per figure of its table."""
        with self._lock:
            for batch, seconds in calibration.plain_seconds.items():
                self._child(self._calibration, kind="plain", batch=str(batch), k="0").set(seconds)
            for batch, ks in calibration.verify_seconds.items():
                for k, seconds in ks.items():
                    self._child(self._calibration, kind="verify", batch=str(batch), k=str(k)).set(seconds)
            for k, seconds in calibration.draft_seconds.items():
                self._child(self._calibration, kind="draft", batch="1", k=str(k)).set(seconds)
            self._child(self._calibration, kind="round_trip", batch="1", k="0").set(calibration.round_trip_seconds)
            if calibration.context_tokens:
                long = [("plain_long", 0, calibration.long_plain_seconds)]
                long += [("verify_long", k, s) for k, s in calibration.long_verify_seconds.items()]
                long += [("draft_long", k, s) for k, s in calibration.long_draft_seconds.items()]
                for kind, k, seconds in long:
                    self._child(self._calibration, kind=kind, batch="1", k=str(k)).set(seconds)

    def break_even(self, load: str, value: float) -> None:
        """Set the break-even acceptance of a load range (when it changed)."""
        with self._lock:
            if self._shown.get(("break_even", load)) == value:
                return
            self._shown[("break_even", load)] = value
            self._child(self._break_even, load=load).set(value)
