"""Bringing an engine model back after its process died, for the BLS.

Triton does not restart a Python-backend model whose stub process died: every request to it fails ("Stub process
'<model>_0_0' is not healthy") until the model is loaded again, which explicit model control (as `trtspec serve`
runs the server) lets a BLS model do. `Reloader` reloads such a model in the background, once at a time, and
tries again with a growing pause until it loads (a load can fail while the host is short of memory, or while the
old process's resources are being released); requests that need the model wait for it with `wait`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import triton_python_backend_utils as pb_utils

# What Triton answers for a model that cannot serve now: its stub died, it is being unloaded or loaded again, or it
# is not loaded at all (a load that failed leaves it so).
_UNAVAILABLE_SIGNS = ("is not healthy", "is not ready", "unknown model", "has no available versions",
                      "is not found", "is unloading", "unavailable")
# Triton without explicit model control refuses every load and unload: nothing to retry (under mpirun, a dead
# worker is left to the pod's liveness probe).
_NOT_ALLOWED = "not allowed"
FIRST_PAUSE_SECONDS, LONGEST_PAUSE_SECONDS = 1.0, 30.0
POLL_SECONDS = 0.1  # how often a waiting request looks at the model


def unavailable(message: str) -> bool:
    """Whether an engine model's error says it cannot serve now (rather than that the request failed)."""
    message = message.lower()
    return any(sign in message for sign in _UNAVAILABLE_SIGNS)


class Reloader:
    """Reloads models whose process died, retrying until each loads; `owner` names the BLS in its log lines."""

    def __init__(self, owner: str, *, first_pause: float = FIRST_PAUSE_SECONDS,
                 longest_pause: float = LONGEST_PAUSE_SECONDS):
        self.owner, self.first_pause, self.longest_pause = owner, first_pause, longest_pause
        self._lock = threading.Lock()
        self._reloading: set[str] = set()
        self._closed = threading.Event()

    def reloading(self, model: str) -> bool:
        with self._lock:
            return model in self._reloading

    def notice(self, model: str, cause: Exception) -> None:
        """Reload `model` in the background when `cause` says its process died; at most one reload per model."""
        if "not healthy" not in str(cause):
            return
        with self._lock:
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

    def _reload(self, model: str) -> None:
        # Loading a model that Triton still counts as loaded does nothing unless its files changed, and a dead stub
        # is not a change: unload it first (once), then load it afresh (a new stub process) until that works.
        pause, unloaded, tries = self.first_pause, False, 0
        try:
            while not self._closed.is_set():
                tries += 1
                try:
                    if not unloaded:
                        pb_utils.unload_model(model_name=model)
                        unloaded = True
                    pb_utils.load_model(model_name=model)
                    pb_utils.Logger.log_info(f"{self.owner}: reloaded {model}, whose process had died"
                                             + (f" ({tries} tries)" if tries > 1 else ""))
                    return
                except Exception as exc:
                    if _NOT_ALLOWED in str(exc):
                        pb_utils.Logger.log_warn(f"{self.owner}: could not reload {model}: {exc}")
                        return
                    pb_utils.Logger.log_warn(f"{self.owner}: could not reload {model} (try {tries}): {exc}; "
                                             f"trying again in {pause:g} s")
                if self._closed.wait(pause):
                    return
                pause = min(2 * pause, self.longest_pause)
        finally:
            with self._lock:
                self._reloading.discard(model)
