"""Bringing an engine model back after its process died, for the BLS.

Triton does not restart a decoupled Python-backend model whose stub process died (python_backend's python_be.cc
has only a "TODO: Implement restart on decoupled"): new calls fail at once ("Stub process '<model>_0_0' is not
healthy"), the calls that were open get no further response, and `is_model_ready` still says ready (until Triton
25.12). Under explicit model control (as `trtspec serve` runs the server) a BLS model can load it again: with no
call open to it, by unloading it and loading it afresh; with calls left open (they hold the model, so an unload
would never finish), by a load with a config override that differs from the loaded one, which makes Triton load a
new model (a new stub) beside the old and switch to it, the old one left behind, never freed.

`Reloader` does that in the background, once at a time per model (the override is the repository's own config with
a `trtspec_reload` parameter that changes each time), and tries again with a growing pause until it loads (a load
can fail while the host is short of memory). It remembers when each model was last seen dead, so that calls left open
can be given up (trtspec.triton.engine_client), and requests that need the model wait for it with `wait`.

It also keeps each model's run of engine-side failures (`answered`, `failed`: trtspec.engine_health), the liveness
signal for what no reload can mend: a `tensorrtllm` executor that fails every call while its model stays READY, and
any model under mpirun, where Triton refuses loads. A failure while the model is being reloaded is not counted: the
reload is bounded by itself (a model that never loads again is unready, which `/health/live` reads too).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path

import triton_python_backend_utils as pb_utils

from trtspec.engine_health import EngineHealth

# What Triton answers for a model that cannot serve now: its stub died, it is being unloaded or loaded again, or it
# is not loaded at all (a load that failed leaves it so).
_UNAVAILABLE_SIGNS = (
    "is not healthy",
    "is not ready",
    "unknown model",
    "has no available versions",
    "is not found",
    "is unloading",
    "unavailable",
)
# Triton without explicit model control refuses every load and unload: nothing to retry (under mpirun, a dead
# worker is left to the pod's liveness probe).
_NOT_ALLOWED = "not allowed"
FIRST_PAUSE_SECONDS, LONGEST_PAUSE_SECONDS = 1.0, 30.0
POLL_SECONDS = 0.1  # how often a waiting request looks at the model
PROBE_SECONDS = 1.0  # at most one liveness probe per model this often
_loads = itertools.count(1)  # each reload's config differs from every earlier one


def unavailable(message: str) -> bool:
    """Whether an engine model's error says it cannot serve now (rather than that the request failed)."""
    message = message.lower()
    return any(sign in message for sign in _UNAVAILABLE_SIGNS)


class Reloader:
    """Reloads models whose process died, retrying until each loads; `owner` names the BLS in its log lines,
    `repository` is the model repository's root (each model's config.pbtxt is read from it)."""

    def __init__(
        self,
        owner: str,
        repository: Path,
        *,
        first_pause: float = FIRST_PAUSE_SECONDS,
        longest_pause: float = LONGEST_PAUSE_SECONDS,
    ):
        self.owner, self.repository = owner, Path(repository)
        self.first_pause, self.longest_pause = first_pause, longest_pause
        self._lock = threading.Lock()
        self._reloading: set[str] = set()
        self._deaths: dict[str, float] = {}  # model -> when it was last seen dead (time.monotonic())
        self._probes: dict[str, float] = {}  # model -> when it was last probed
        self._open: dict[str, int] = {}  # model -> the BLS's calls to it that have not ended (see `opened`)
        self._closed = threading.Event()
        self.health = EngineHealth()  # the BLS points its on_change at its metrics

    def answered(self, model: str) -> None:
        """`model` answered a call (a response without an error)."""
        self.health.answered(model)

    def failed(self, model: str) -> None:
        """`model` failed a call on its side (not a refusal of the call as invalid, not a full queue)."""
        if not self.reloading(model):
            self.health.failed(model)

    def opened(self, model: str, by: int) -> None:
        """A call to `model` began (by 1) or ended (by -1); a call to a dead model never ends."""
        with self._lock:
            self._open[model] = self._open.get(model, 0) + by

    def reloading(self, model: str) -> bool:
        with self._lock:
            return model in self._reloading

    def died_since(self, model: str, since: float) -> bool:
        with self._lock:
            return self._deaths.get(model, float("-inf")) >= since

    def may_probe(self, model: str) -> bool:
        """Whether a call may probe `model` now (one probe per PROBE_SECONDS answers for every silent call)."""
        now = time.monotonic()
        with self._lock:
            if now - self._probes.get(model, float("-inf")) < PROBE_SECONDS:
                return False
            self._probes[model] = now
            return True

    def notice(self, model: str, cause: Exception) -> None:
        """Reload `model` in the background when `cause` says its process died; at most one reload per model."""
        if "not healthy" not in str(cause):
            return
        with self._lock:
            self._deaths[model] = time.monotonic()
            if model in self._reloading or self._closed.is_set():
                return
            self._reloading.add(model)
        threading.Thread(target=self._reload, args=(model,), name=f"reload-{model}", daemon=True).start()

    def wait(self, model: str, until: float, check: Callable[[], None] = lambda: None) -> bool:
        """Wait until `model` is ready and no reload of it is under way, or until the `time.monotonic()` instant
        `until`; True if it is ready. `check` runs between looks and may raise (the client left, a deadline)."""
        while True:
            check()
            if not self.reloading(model) and self._ready(model):
                return True
            if time.monotonic() >= until or self._closed.is_set():
                return False
            time.sleep(POLL_SECONDS)

    def close(self) -> None:
        self._closed.set()

    @staticmethod
    def _ready(model: str) -> bool:
        try:
            return bool(pb_utils.is_model_ready(model_name=model))
        except Exception:  # asking failed: as good as not ready
            return False

    def config(self, model: str) -> str:
        """`model`'s config.pbtxt as the JSON a config override takes, with a `trtspec_reload` parameter no earlier
        load had: loading a model again with its own, unchanged config would do nothing."""
        from google.protobuf import json_format, text_format
        from tritonclient.grpc import model_config_pb2

        config = model_config_pb2.ModelConfig()
        text_format.Parse((self.repository / model / "config.pbtxt").read_text(), config)
        config.parameters["trtspec_reload"].string_value = str(next(_loads))
        return json_format.MessageToJson(config, preserving_proto_field_name=True)

    def _calls_left_open(self, model: str, grace: float = 1.0) -> bool:
        """Whether calls to `model` stay open: a call that got the dead model's error ends at once, one that was
        open when it died never does."""
        until = time.monotonic() + grace
        while True:
            with self._lock:
                if self._open.get(model, 0) <= 0:
                    return False
            if time.monotonic() >= until:
                return True
            time.sleep(POLL_SECONDS / 2)

    def _reload(self, model: str) -> None:
        pause, tries, unloaded = self.first_pause, 0, False
        try:
            while not self._closed.is_set():
                tries += 1
                try:
                    stuck = self._calls_left_open(model)
                    if stuck:  # an unload would wait for them forever
                        pb_utils.load_model(model_name=model, config=self.config(model))
                    else:
                        if not unloaded:
                            pb_utils.unload_model(model_name=model)
                            unloaded = True
                        pb_utils.load_model(model_name=model)
                    pb_utils.Logger.log_info(
                        f"{self.owner}: reloaded {model}, whose process had died"
                        + (f" ({tries} tries)" if tries > 1 else "")
                        + (" (beside the old model, which calls left open still hold)" if stuck else "")
                    )
                    return
                except Exception as exc:
                    if _NOT_ALLOWED in str(exc):
                        pb_utils.Logger.log_warn(f"{self.owner}: could not reload {model}: {exc}")
                        return
                    pb_utils.Logger.log_warn(
                        f"{self.owner}: could not reload {model} (try {tries}): {exc}; trying again in {pause:g} s"
                    )
                if self._closed.wait(pause):
                    return
                pause = min(2 * pause, self.longest_pause)
        finally:
            with self._lock:
                self._reloading.discard(model)
