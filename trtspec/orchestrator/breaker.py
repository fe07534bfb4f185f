"""A deployment's draft model, guarded: after it fails, requests skip it for a cool-down (doubling while it keeps
failing, up to a cap) instead of each paying a failed call, then one request probes it again. The first failure
of an outage (`on_down`) and the recovery (`on_up`) are reported once each, not once per request; `on_failure`
hears the first failure and every failed probe (e.g. to bring back a model whose process died).

Only the probe's outcome moves the breaker during an outage. Calls admitted before the outage was known (several
requests draft at once) fail late, some only when their deadline passes; counting them as failed probes would
stretch the cool-down to its cap for one outage."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from trtspec.errors import Cancelled
from trtspec.orchestrator.drafters import Draft, Drafter, DraftFailed

CALL, PROBE = "call", "probe"


class DraftBreaker:
    def __init__(
        self,
        *,
        cooldown: float = 2.0,
        max_cooldown: float = 60.0,
        on_down: Callable[[Exception], None] = lambda cause: None,
        on_up: Callable[[], None] = lambda: None,
        on_failure: Callable[[Exception], None] = lambda cause: None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.base, self.cap, self.clock = cooldown, max_cooldown, clock
        self.on_down, self.on_up, self.on_failure = on_down, on_up, on_failure
        self._lock = threading.Lock()
        self._down_until: float | None = None  # None: the draft model is believed to work
        self._cooldown = cooldown
        self._probing = False
        self.failures = 0

    @property
    def down(self) -> bool:
        return self._down_until is not None

    def admit(self) -> str | None:
        """Whether this request may call the draft model: CALL while it works; during an outage PROBE for one
        request at a time once the cool-down has passed, else None (skip it)."""
        with self._lock:
            if self._down_until is None:
                return CALL
            if self._probing or self.clock() < self._down_until:
                return None
            self._probing = True
            return PROBE

    def failed(self, cause: Exception, admitted: str = CALL) -> None:
        with self._lock:
            first = self._down_until is None
            if not first and admitted != PROBE:
                return  # a call from before the outage was known: the outage is already counted
            self.failures += 1
            self._cooldown = self.base if first else min(2 * self._cooldown, self.cap)
            self._down_until = self.clock() + self._cooldown
            self._probing = False
        if first:
            self.on_down(cause)
        self.on_failure(cause)

    def released(self, admitted: str = CALL) -> None:
        """A call that ended for its request's own reason (the client left): it says nothing about the model, and a
        probe gives its turn to the next request."""
        if admitted == PROBE:
            with self._lock:
                self._probing = False

    def succeeded(self, admitted: str = CALL) -> None:
        with self._lock:
            if self._down_until is not None and admitted != PROBE:
                return  # a late answer from before the outage proves nothing about the model now
            recovered = self._down_until is not None
            self._down_until, self._probing, self._cooldown = None, False, self.base
        if recovered:
            self.on_up()


class GuardedDrafter:
    """A drafter whose calls go through a DraftBreaker; DraftFailed when the breaker says no or the call fails."""

    def __init__(self, inner: Drafter, breaker: DraftBreaker):
        self.inner, self.breaker = inner, breaker

    def propose(self, context: list[int], k: int) -> Draft:
        admitted = self.breaker.admit()
        if admitted is None:
            raise DraftFailed("the draft model is unavailable after a recent failure")
        try:
            draft = self.inner.propose(context, k)
        except Cancelled:
            self.breaker.released(admitted)
            raise
        except Exception as exc:  # a failed probe, whatever the cause, must not leave the breaker waiting on it
            self.breaker.failed(exc, admitted)
            raise
        self.breaker.succeeded(admitted)
        return draft

    def observe(self, *, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.inner.observe(num_draft_tokens=num_draft_tokens, num_accepted_tokens=num_accepted_tokens)
