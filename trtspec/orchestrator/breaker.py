"""A deployment's draft model, guarded: after it fails, requests skip it for a cool-down (doubling while it keeps
failing, up to a cap) instead of each paying a failed call, then one request probes it again. The first failure
of an outage (`on_down`) and the recovery (`on_up`) are reported once each, not once per request."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from trtspec.orchestrator.drafters import Draft, DraftFailed, Drafter


class DraftBreaker:
    def __init__(self, *, cooldown: float = 2.0, max_cooldown: float = 60.0,
                 on_down: Callable[[Exception], None] = lambda cause: None, on_up: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic):
        self.base, self.cap, self.clock = cooldown, max_cooldown, clock
        self.on_down, self.on_up = on_down, on_up
        self._lock = threading.Lock()
        self._down_until: float | None = None   # None: the draft model is believed to work
        self._cooldown = cooldown
        self._probing = False
        self.failures = 0

    @property
    def down(self) -> bool:
        return self._down_until is not None

    def allow(self) -> bool:
        """Whether this request may call the draft model: always while it works; during an outage only one
        request at a time, once the cool-down has passed (the probe)."""
        with self._lock:
            if self._down_until is None:
                return True
            if self._probing or self.clock() < self._down_until:
                return False
            self._probing = True
            return True

    def failed(self, cause: Exception) -> None:
        with self._lock:
            self.failures += 1
            first = self._down_until is None
            self._cooldown = self.base if first else min(2 * self._cooldown, self.cap)
            self._down_until = self.clock() + self._cooldown
            self._probing = False
        if first:
            self.on_down(cause)

    def succeeded(self) -> None:
        with self._lock:
            recovered = self._down_until is not None
            self._down_until, self._probing, self._cooldown = None, False, self.base
        if recovered:
            self.on_up()


class GuardedDrafter:
    """A drafter whose calls go through a DraftBreaker; DraftFailed when the breaker says no or the call fails."""

    def __init__(self, inner: Drafter, breaker: DraftBreaker):
        self.inner, self.breaker = inner, breaker

    def propose(self, context: list[int], k: int) -> Draft:
        if not self.breaker.allow():
            raise DraftFailed("the draft model is unavailable after a recent failure")
        try:
            draft = self.inner.propose(context, k)
        except Exception as exc:  # a failed probe, whatever the cause, must not leave the breaker waiting on it
            self.breaker.failed(exc)
            raise
        self.breaker.succeeded()
        return draft

    def observe(self, num_accepted: int, num_drafted: int) -> None:
        self.inner.observe(num_accepted, num_drafted)
