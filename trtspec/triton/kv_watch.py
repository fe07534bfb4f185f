"""The target's KV-cache pressure, for the governor: the fraction of its KV-cache blocks in use, read once a second
from the server's own metrics endpoint. TensorRT-LLM's backend reports its blocks in the family below
(triton_backend/inflight_batcher_llm/src/custom_metrics_reporter/custom_metrics_reporter.cc), and the embedded engine
reports its budget the same way (trtspec.triton.engine_model), so one reader serves both.

`trtspec serve` tells the BLS where its metrics are (METRICS_ENV). A tritonserver started some other way has no
such variable, and the governor then goes without this signal (said once in the log)."""

from __future__ import annotations

import re
import threading
import urllib.request
from collections.abc import Callable

METRICS_ENV = "TRTSPEC_METRICS_URL"
FAMILY = "nv_trt_llm_kv_cache_block_metrics"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def kv_fraction(scrape: str, model: str) -> float | None:
    """Used over max KV blocks of `model` in a Prometheus text scrape (None when the scrape has neither)."""
    blocks: dict[str, float] = {}
    for line in scrape.splitlines():
        if not line.startswith(FAMILY + "{"):
            continue
        labels, _, value = line[len(FAMILY) + 1 :].rpartition("}")
        found = dict(_LABEL.findall(labels))
        if found.get("model") == model and found.get("kv_cache_block_type") in ("used", "max"):
            blocks[found["kv_cache_block_type"]] = float(value.split()[0])
    return blocks["used"] / blocks["max"] if blocks.get("max") and "used" in blocks else None


class KvWatch:
    """Reads `url` every `period` seconds on a daemon thread and hands `model`'s fraction (None when unknown) to
    `on_fraction`; `on_problem` hears the first failure of a run of failures."""

    def __init__(
        self,
        url: str,
        model: str,
        on_fraction: Callable[[float | None], None],
        *,
        on_problem: Callable[[str], None] = lambda message: None,
        period: float = 1.0,
    ):
        self.url, self.model, self.period = url, model, period
        self.on_fraction, self.on_problem = on_fraction, on_problem
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trtspec-kv-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failing = False
        while not self._stop.wait(self.period):
            try:
                with urllib.request.urlopen(self.url, timeout=max(1.0, self.period)) as answer:
                    fraction = kv_fraction(answer.read().decode(), self.model)
                failing = False
            except Exception as exc:  # the server is starting or stopping: no signal until it answers
                if not failing:
                    self.on_problem(f"cannot read KV-cache metrics at {self.url}: {exc}")
                failing, fraction = True, None
            self.on_fraction(fraction)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
