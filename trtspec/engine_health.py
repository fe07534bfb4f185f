"""Whether an engine model still answers: the liveness signal of a deployment whose engine fails every call.

TensorRT-LLM's executor survives its own failures: `Executor::Impl::forwardAsync` catches every exception, fails
the requests in flight with "Encountered an error in forwardAsync function: ..." (`terminateActiveRequests`,
cpp/tensorrt_llm/executor/executorImpl.cpp, 1.2.0rc2 b35ac1b6) and goes on, and the `tensorrt_llm` model stays READY.
After a sticky CUDA error (an Xid, an illegal address) every later call fails the same way, and nothing in Triton
says so. The BLS sees each of those failures: `EngineHealth` keeps, per engine model, the run of engine-side
failures since the model last answered, the BLS exports it (trtspec.triton.metrics: FAILURES and SINCE), and the
OpenAI front's `/health/live` reads it back from Triton's metrics (`failing_from_scrape`) and answers 503 by
`LivenessRule`, so that Kubernetes' liveness probe restarts the pod.

Only the engine's own failures count: a call the engine refused as invalid (INVALID_ARG), a full queue, a deadline
or a cancelled call is not one, and a client's bad request never reaches the engine. One answered call ends the run.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

FAILURES = "trtspec_engine_consecutive_failures"
SINCE = "trtspec_engine_failing_since_timestamp_seconds"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Run:
    """An engine model's engine-side failures since it last answered: how many, and when the first came (Unix
    time)."""

    failures: int
    since: float


class EngineHealth:
    """The runs of failures of the engine models one BLS calls; thread-safe. `on_change(model, run)` hears each new
    failure and the end of a run (run None); it is called outside the lock. An answer costs a dict write: it comes
    with every streamed response."""

    def __init__(self, on_change: Callable[[str, Run | None], None] = lambda model, run: None, clock=time.time):
        self.on_change, self.clock = on_change, clock
        self._lock = threading.Lock()
        self._answered: dict[str, float] = {}  # model -> when it last answered
        self._runs: dict[str, Run] = {}  # model -> its failures since then (absent: none)

    def answered(self, model: str) -> None:
        now = self.clock()
        self._answered[model] = now
        if model in self._runs:  # rare: a run that this answer ends
            with self._lock:
                run = self._runs.get(model)
                if run is None or run.since > now:
                    return
                del self._runs[model]
            self.on_change(model, None)

    def failed(self, model: str) -> None:
        now = self.clock()
        with self._lock:
            run = self._runs.get(model)
            if run is None or run.since < self._answered.get(model, float("-inf")):
                run = Run(1, now)  # the first since the model last answered
            else:
                run = Run(run.failures + 1, run.since)
            self._runs[model] = run
        self.on_change(model, run)

    def failing(self, model: str) -> Run | None:
        """`model`'s run of failures, None when its latest call was answered (or none failed)."""
        with self._lock:
            run = self._runs.get(model)
            return run if run is not None and run.since >= self._answered.get(model, float("-inf")) else None


@dataclass(frozen=True)
class LivenessRule:
    """When an engine counts as dead: it failed at least `failures` calls in a row, and answered none for `seconds`
    since the first of them. A few failures of a live engine end at its next answer; a dead one never answers."""

    seconds: float = 60.0
    failures: int = 3

    def dead(self, run: Run | None, now: float) -> bool:
        return run is not None and run.failures >= self.failures and now - run.since >= self.seconds

    def describe(self, engine: str, run: Run, now: float) -> str:
        return (
            f"the engine model '{engine}' has failed every call for {now - run.since:.0f} s ({run.failures} in a "
            f"row, none answered; the limit is {self.seconds:g} s): restart the server"
        )


def failing_from_scrape(scrape: str, bls: str) -> dict[str, Run]:
    """The runs of failures that the BLS `bls` exports in a Prometheus text scrape, by engine model."""
    found: dict[str, dict[str, float]] = {}
    for line in scrape.splitlines():
        name, brace, rest = line.partition("{")
        if not brace or name not in (FAILURES, SINCE):
            continue
        labels, _, value = rest.rpartition("}")
        labels = dict(_LABEL.findall(labels))
        if labels.get("model") == bls and "engine" in labels:
            found.setdefault(labels["engine"], {})[name] = float(value.split()[0])
    return {
        engine: Run(int(v[FAILURES]), v[SINCE]) for engine, v in found.items() if v.get(FAILURES, 0) > 0 and SINCE in v
    }
