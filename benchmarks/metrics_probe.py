"""A Python-backend model for benchmarks/metrics_cost.py: what the BLS's Prometheus metrics cost per request.

It makes the BLS's own metric families (trtspec.triton.metrics.Metrics) and, per request, calls what the BLS calls
once per request (the running and waiting gauges as it is admitted, starts and ends, `record`, then `governor` and
`break_even` as `_govern` does) on statistics shaped like
a 64-token speculative request, `rounds` times, and answers with the median microseconds of one such request's
metric updates. Every update of a Python-backend metric is a message to the server process, so this is Triton's
cost as much as trtspec's."""

from __future__ import annotations

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from trtspec.orchestrator.stats import RequestStats
from trtspec.triton.metrics import Metrics


def _stats() -> RequestStats:
    stats = RequestStats()
    for i in range(16):  # 16 iterations of 4 drafts, 2.5 accepted on average: 64 tokens
        accepted = (3, 2)[i % 2]
        stats.record(
            num_draft_tokens=4,
            num_accepted_tokens=accepted,
            emitted=accepted + 1,
            draft_seconds=0.004,
            verify_seconds=0.02,
            source="draft_model",
        )
    stats.fallbacks["low_acceptance"] = 1
    return stats


class TritonPythonModel:
    def initialize(self, args):
        self.metrics = Metrics(
            args["model_name"],
            {"target": "t", "draft": "d", "quantization": "fp8", "max_draft_len": "4", "trtspec_version": "0"},
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            rounds = int(pb_utils.get_input_tensor_by_name(request, "rounds").as_numpy().reshape(-1)[0])
            stats, times = _stats(), []
            for _ in range(rounds + 3):  # the first three warm up
                now = time.monotonic_ns()
                started = time.perf_counter()
                self.metrics.requests_in_flight(0, 1)  # admitted, then started, then done: as the BLS shows them
                self.metrics.requests_in_flight(1, 0)
                self.metrics.record(stats, [now - 900_000_000, now - 899_000_000, now - 850_000_000, now])
                self.metrics.requests_in_flight(0, 0)
                self.metrics.governor("1", "speculating", 4)
                self.metrics.break_even("1", 0.4)
                times.append(time.perf_counter() - started)
            median = float(np.median(times[3:])) * 1e6
            payload = np.array([json.dumps({"us_per_request": median}).encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("result", payload)]))
        return responses
