"""The deployment's speculation governor: a rollback that is reversible and never silent (docs/governor.md).

The adaptive draft length (adaptive.py) decides per request and each request pays to find out; the governor
decides for the deployment, from the requests that finished lately. It steps down from the full draft length to a
reduced one (half) to plain decoding when requests fail (server errors and timeouts, not bad requests) or
speculation does not pay (acceptance below the learned break-even, or speculative time per output token no better
than plain), and steps back up only on evidence: in plain decoding one request in `probe_every` speculates at the
reduced length (a probe), and the deployment returns to reduced once the probes pay, to full once reduced pays.
After each change it holds for `hold_seconds` and judges only requests admitted after the change.

Two live conditions put a floor under the level while they last, whatever the judging says: KV-cache pressure
(the target's used KV blocks above `kv_warning` of its blocks: reduced; above `kv_critical`: plain; lifted once
below `kv_release`, since each draft token holds KV too) and an outage of the draft model (reduced: requests keep
drafting from prompt lookup where `auto` allows, and the draft breaker keeps trying the model, whose recovery lifts
the floor). Entering and leaving a floor are changes like any other, logged and counted with their reason.

An operator (or Alertmanager, through `trtspec serve --control-port`: trtspec.control) can force a level for a
time: the governor then neither judges nor probes, and when the time is up (or the force is released) it returns to
the level it had before and judges again from there, as after any change. A force never lifts a floor: a forced
`speculating` still drafts less while the KV cache is full or the draft model is down, since drafting then takes
the KV cache that admits requests, or calls a model that does not answer.

Whether speculation pays depends on the load: a verifying pass that carries the drafts of many requests is
compute-bound where a lone request's is bound by the weights' bytes. So a deployment has one governor per load
range (`LoadGovernors`: requests in flight, 1, 2, 3-4, 5-8, ..., as the learned costs): the range of the load at a
request's admission caps it, the range of the most requests it ran beside judges it (and, where that range rolled
back, caps each later iteration: a burst's first requests are admitted at a lighter load than the one they run at),
and a burst that does not pay rolls back its own range and leaves lone requests speculating. The floors and a force
hold for every range.

Plain requests share those passes too: beside speculating requests, a plain request waits on their verifications,
and its time per token flatters speculation (seen at four requests: the range went back to speculating on "pays"
half a minute after low acceptance took it down). So above one request in flight, the plain time per token that
speculation is held against comes only from plain requests admitted while the range decoded plainly. A range that
has no such reference yet goes to plain to take one (`no_plain_reference`) where it would step down, and from
reduced, where it got by other means (errors): at reduced only low acceptance could take it further down, and at
four requests on a 2-core CPU the acceptance at the reduced length stayed above the learned break-even (the costs a
request pays itself) while the range ran at two thirds of target-only's rate. Straight to plain saves a fresh
deployment's first burst the hold at reduced, which could only end in plain. Its probes then bring it back where
speculation pays against that reference.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass

from trtspec.orchestrator.adaptive import load_bucket, load_range, nearest_lighter

LEVELS = ("speculating", "reduced", "plain")
# The source material's GPU-memory thresholds, applied to the KV-cache blocks in use (the memory that moves: the
# engines reserve the rest at start); trtspec.deploy.monitoring's KV alerts use the same numbers.
KV_WARNING, KV_CRITICAL, KV_RELEASE = 0.92, 0.97, 0.85
STATES = (*LEVELS, "probing")  # probing: plain, with probes running


@dataclass(frozen=True)
class Outcome:
    """A finished request as the governor sees it."""

    speculative: bool  # it drafted at least once
    seconds_per_token: float | None  # arrival to last token, per output token (the same for either mode)
    _: KW_ONLY
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    failed: bool = False  # a server error or a timeout
    probe: bool = False  # admitted as a probe
    admitted_at: float = 0.0  # when the governor admitted it (its clock)


class Governor:
    def __init__(
        self,
        k_full: int,
        *,
        window: int = 40,
        min_samples: int = 10,
        min_probes: int = 5,
        min_failures: int = 2,
        error_warning: float = 0.02,
        error_critical: float = 0.05,
        probe_every: int = 8,
        hold_seconds: float = 30.0,
        pays_below: float = 0.95,
        kv_warning: float = KV_WARNING,
        kv_critical: float = KV_CRITICAL,
        kv_release: float = KV_RELEASE,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[str, str, str], None] = lambda old, new, reason: None,
        level: int = 0,
        shared: bool = False,
    ):
        """`shared`: its requests share forward passes with others (a load range above one request), so a plain
        request's time per token is its reference only when the range decoded plainly (the module's docstring)."""
        self.k_full, self.min_samples, self.min_probes = k_full, min_samples, min_probes
        self.min_failures = min_failures  # one failure is an incident, not a rate
        self.error_warning, self.error_critical = error_warning, error_critical
        self.probe_every, self.hold_seconds, self.pays_below = probe_every, hold_seconds, pays_below
        self.kv_warning, self.kv_critical, self.kv_release = kv_warning, kv_critical, kv_release
        self.clock, self.on_change, self.shared = clock, on_change, shared
        self.judged = level if k_full > 0 else 2  # the level judging (or a force) set; `level` adds the floors
        self.floors: dict[str, int] = {}  # live conditions' floors: kv_cache, draft_down
        self.changed_at = float("-inf")
        self.recent: deque[Outcome] = deque(maxlen=window)
        self.plain_tpot: float | None = None  # the last known plain time per output token (kept across changes)
        self._admitted = 0
        self._probes = 0  # probes admitted since the last change
        self._lock = threading.RLock()  # requests finish on many threads
        self.forced_until: float | None = None  # while forced: until when (its clock)
        self._level_before = self.judged  # the level a force interrupted, restored after it

    @property
    def level(self) -> int:
        """The level in force: the judged (or forced) level raised to the highest floor."""
        return max(self.judged, *self.floors.values()) if self.floors else self.judged

    @property
    def unforced(self) -> int:
        """The level judging reached, a force aside."""
        return self._level_before if self.forced else self.judged

    @property
    def state(self) -> str:
        return "probing" if self.level == 2 and self._probes else LEVELS[self.level]

    @property
    def forced(self) -> bool:
        return self.forced_until is not None

    def force(self, state: str | None, seconds: float = 0.0, reason: str = "operator") -> None:
        """Hold `state` (one of LEVELS) for `seconds`; None releases a force at once. Each change is reported."""
        with self._lock:
            if state is None:
                if self.forced:
                    self._unforce(f"{reason}_release")
                return
            if state not in LEVELS:
                raise ValueError(f"state {state!r}: choose one of {', '.join(LEVELS)}")
            if not self.forced:
                self._level_before = self.judged
            old = self.state
            self.forced_until = self.clock() + seconds
            self._go(LEVELS.index(state), reason, always=True, old=old)

    def _unforce(self, reason: str) -> None:
        old = self.state
        self.forced_until = None
        self._go(self._level_before, reason, always=True, old=old)

    def kv_cache(self, fraction: float | None) -> None:
        """The target's KV-cache blocks in use, as a fraction of its blocks (None: not known)."""
        with self._lock:
            floor = self.floors.get("kv_cache", 0)
            if fraction is None or fraction < self.kv_release:
                floor = 0
            elif fraction >= self.kv_critical:
                floor = 2
            elif fraction >= self.kv_warning:
                floor = max(floor, 1)
            self._floor("kv_cache", floor)

    def draft_down(self, down: bool) -> None:
        """The draft model failed (an outage begins) or answers again (it ends)."""
        with self._lock:
            self._floor("draft_down", 1 if down and self.k_full > 0 else 0)

    def _floor(self, name: str, floor: int) -> None:
        if floor == self.floors.get(name, 0):
            return
        old_state, old_level = self.state, self.level
        if floor:
            self.floors[name] = floor
        else:
            del self.floors[name]
        if self.level != old_level:
            self.changed_at, self._probes = self.clock(), 0
            self.recent.clear()
            self.on_change(old_state, self.state, name if floor else f"{name}_cleared")

    def _expire(self) -> None:
        if self.forced and self.clock() >= self.forced_until:
            self._unforce("force_expired")

    @property
    def reduced_k(self) -> int:
        return max(1, self.k_full // 2)

    def cap(self) -> int:
        """The draft-length cap of the current level (plain: 0)."""
        return (self.k_full, self.reduced_k, 0)[self.level] if self.k_full > 0 else 0

    def rolled_back_cap(self) -> int | None:
        """The cap where the level rolled back (reduced, plain); None at the full draft length."""
        with self._lock:
            self._expire()
            return self.cap() if self.level > 0 else None

    def admit(self) -> tuple[int, bool, float]:
        """(draft-length cap, whether the request is a probe, admission time) for a new request."""
        with self._lock:
            return self._admit()

    def _admit(self) -> tuple[int, bool, float]:
        self._expire()
        self._admitted += 1
        probes = not self.forced and self.level == 2 and self.floors.get("kv_cache", 0) == 0  # probes take KV too
        if probes and self.k_full > 0 and self._admitted % self.probe_every == 0:
            self._probes += 1
            return self.reduced_k, True, self.clock()
        return self.cap(), False, self.clock()

    def observe(self, outcome: Outcome, break_even: float) -> None:
        """A finished request; `break_even`: the acceptance below which drafting costs more than it returns."""
        with self._lock:
            self._observe(outcome, break_even)

    def _observe(self, outcome: Outcome, break_even: float) -> None:
        if (
            not outcome.speculative
            and not outcome.failed
            and outcome.seconds_per_token is not None
            and self._clean(outcome)
        ):
            self.plain_tpot = (
                outcome.seconds_per_token
                if self.plain_tpot is None
                else 0.8 * self.plain_tpot + 0.2 * outcome.seconds_per_token
            )
        self._expire()
        if outcome.admitted_at < self.changed_at or self.forced:
            return  # admitted under the previous level, or held by an operator: nothing to judge
        self.recent.append(outcome)
        if self.clock() - self.changed_at < self.hold_seconds:
            return
        done = list(self.recent)
        failures = sum(o.failed for o in done)
        if len(done) >= self.min_samples and failures >= self.min_failures:
            errors = failures / len(done)
            if errors > self.error_critical:
                return self._go(2, "errors")
            if errors > self.error_warning and self.judged == 0:
                return self._go(1, "errors")
        judging = [o for o in done if o.speculative and not o.failed and (self.judged < 2 or o.probe)]
        enough = len(judging) >= (self.min_probes if self.judged == 2 else self.min_samples)
        if not enough:
            return
        num_draft_tokens = sum(o.num_draft_tokens for o in judging)
        num_accepted_tokens = sum(o.num_accepted_tokens for o in judging)
        acceptance = num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0
        tpots = [o.seconds_per_token for o in judging if o.seconds_per_token is not None]
        faster = self.plain_tpot is None or not tpots or sum(tpots) / len(tpots) < self.pays_below * self.plain_tpot
        if self.judged < 2 and acceptance < break_even:
            if self.shared and self.plain_tpot is None:
                # reduced would have nothing but acceptance to be held against, and goes on to plain after its hold
                # whatever it shows (below): it goes there now
                return self._go(2, "no_plain_reference")
            return self._go(self.judged + 1, "low_acceptance")
        if self.judged < 2 and not faster:
            return self._go(self.judged + 1, "slower_than_plain")
        if self.judged == 1 and self.shared and self.plain_tpot is None:
            return self._go(2, "no_plain_reference")  # reduced once already, and nothing to show it pays
        if (
            self.judged > 0
            and acceptance >= break_even
            and faster
            and (self.judged == 2 or self.plain_tpot is not None)
        ):
            return self._go(self.judged - 1, "probes_pay" if self.judged == 2 else "pays")

    def _clean(self, outcome: Outcome) -> bool:
        """Whether a plain request's time per token can be the plain reference: no speculating request's
        verification shared its passes (alone in its range, or admitted while the range decoded plainly)."""
        return not self.shared or (self.level == 2 and outcome.admitted_at >= self.changed_at)

    def _go(self, level: int, reason: str, *, always: bool = False, old: str | None = None) -> None:
        """Judge the deployment to `level`; reported when the level in force changes, or `always` (a force taken
        or ended: `old` is the state before it)."""
        level = max(0, min(2, level))
        if level == self.judged and not always:
            return
        old = self.state if old is None else old
        before = self.level
        self.judged, self.changed_at, self._probes = level, self.clock(), 0
        self.recent.clear()
        if always or self.level != before:
            self.on_change(old, self.state, reason)


class LoadGovernors:
    """A Governor per load range, made as each range is first seen; the floors and a force reach every one, those
    made later included. A range not seen yet starts at the judged level of the nearest lighter range that was
    (speculation pays less the heavier the load). `on_change(load, old, new, reason, cap)`: `load` is the range's
    label, `cap` its draft-length cap after the change."""

    def __init__(
        self, k_full: int, *, on_change: Callable[[str, str, str, str, int], None] = lambda *change: None, **options
    ):
        self.k_full, self._options, self._on_change = k_full, options, on_change
        self._clock: Callable[[], float] = options.get("clock", time.monotonic)
        self._lock = threading.RLock()
        self._kv: float | None = None  # the last KV-cache signal and draft outage, for ranges made later
        self._draft_down = False
        self._force: tuple[str, float, str] | None = None  # (state, until, reason) of a force in progress
        self._reference: Callable[[int], float | None] | None = None  # measured plain seconds per token at a load
        self.by_load: dict[int, Governor] = {}
        self.at(1)

    def at(self, load: int) -> Governor:
        """The governor of `load`'s range (made on first use)."""
        bucket = load_bucket(load)
        with self._lock:
            if bucket not in self.by_load:
                lighter = nearest_lighter(self.by_load, bucket)
                label = load_range(bucket)
                gov = Governor(
                    self.k_full,
                    level=0 if lighter is None else lighter.unforced,
                    shared=bucket > 0,  # above one request in flight
                    **self._options,
                )
                # it starts under the floors and the force in progress: no change of its own to report
                gov.kv_cache(self._kv)
                gov.draft_down(self._draft_down)
                if self._reference is not None:
                    gov.plain_tpot = self._reference(2**bucket)
                if self._force is not None and self._force[1] > self._clock():
                    gov.force(self._force[0], self._force[1] - self._clock(), self._force[2])
                gov.on_change = lambda old, new, reason: self._on_change(label, old, new, reason, gov.cap())
                self.by_load[bucket] = gov
            return self.by_load[bucket]

    def admit(self, load: int) -> tuple[int, bool, float]:
        return self.at(load).admit()

    def seed_plain(self, reference: Callable[[int], float | None]) -> None:
        """The plain time per output token each range holds speculation against, measured for the machine
        (trtspec.calibration) at the heaviest load of the range: a range starts with a reference (no burst spent
        taking one: `no_plain_reference`), and plain requests refine it as before."""
        with self._lock:
            self._reference = reference
            for bucket, gov in self.by_load.items():
                with gov._lock:
                    gov.plain_tpot = reference(2**bucket)

    def observe(self, outcome: Outcome, break_even: float, load: int) -> None:
        """A finished request, judged in the range of `load`: the most requests it ran beside (one admitted alone
        that shared its passes with a burst judges the burst's range, not the lone requests')."""
        self.at(load).observe(outcome, break_even)

    def ranges(self) -> list[tuple[str, Governor]]:
        """(label, governor) of every range seen, lightest first."""
        with self._lock:
            return [(load_range(b), self.by_load[b]) for b in sorted(self.by_load)]

    def force(self, state: str | None, seconds: float = 0.0, reason: str = "operator") -> None:
        with self._lock:
            if state is not None and state not in LEVELS:
                raise ValueError(f"state {state!r}: choose one of {', '.join(LEVELS)}")
            self._force = None if state is None else (state, self._clock() + seconds, reason)
            for gov in self.by_load.values():
                gov.force(state, seconds, reason)

    def kv_cache(self, fraction: float | None) -> None:
        with self._lock:
            self._kv = fraction
            for gov in self.by_load.values():
                gov.kv_cache(fraction)

    def draft_down(self, down: bool) -> None:
        with self._lock:
            self._draft_down = down
            for gov in self.by_load.values():
                gov.draft_down(down)
