"""What a request may do at the deployment's load, and what its outcome teaches the deployment: Triton-free.

The loop (loop.py) runs one request's iterations; this module holds the request-level half around it, so the Triton
adapter (trtspec.triton.bls) only parses, runs and responds, and every rule here is tested without a server.

    Deployment                 one per BLS instance, shared by its requests (thread-safe)
      costs                    DeploymentCosts: the cost models requests start from, per load range (adaptive.py)
      governor                 LoadGovernors: the rollback per load range, and an operator's force (governor.py)
      draft_breaker            DraftBreaker: skips a failing draft model for a cool-down (breaker.py)
      control                  the control file's watcher (trtspec.control): a force reaches the governor here
      start(request, load)  -> Session
    Session                    one request
      admission                the draft length it starts with and why (Admission), the governor's cap, probe
      run()                    the loop's tokens, iteration by iteration (a streamed stretch's as they arrive)
      finish(error)            its costs, draft sources and outcome to the deployment (None: it completed)

A request's draft length (K) is decided in this order, each step able only to lower it:
  1. `draft_length`: the request's num_draft_tokens, else the deployment's K for a named method, else its default;
     prompt lookup with no K named drafts up to max_draft_len; `none` drafts nothing;
  2. `Deployment.admit`: above max_speculative_concurrency requests in flight, plain (fallback `load`); where the
     load range's governor rolled back, at most its cap (fallback `governor`), every source included; an adaptive
     request at a load where the calibrated costs leave no draft length that could pay, plain (fallback
     `calibration`, logged once per load range);
  3. per iteration, the loop: the draft-length policy (fixed K, or adaptive within K, prompt lookup within
     max_draft_len or the cap), and the cap of the heaviest load the request has run beside, a force read since it
     started included (`Session._cap`): at 0 it decodes plainly a stretch at a time and drafts again once the cap
     lifts, from the whole sequence.

Costs. `trtspec serve` measures the engines when it starts (trtspec.calibration) and names the file in
TRTSPEC_CALIBRATION_FILE; the deployment reads it at a request's admission (and again when it changes) and seeds
every load range's costs and each governor's plain reference from it (`Deployment.calibrate`); what requests measure
refines them. An adaptive decision weighs the batch, not the request alone: a verification's k + 1 rows lengthen the
pass that every request in flight shares, and `Deployment.shared_cost` adds what the others lose to the request's own
cost (adaptive.with_shared), so drafting goes on only where the batch's expected tokens per second rise.

Where others hook in: `Deployment.sources` assembles the drafter from its sources; `Session.run` is where tokens
leave for the client; `Session.finish` is where a request ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from trtspec.calibration import Calibration, CalibrationWatch
from trtspec.control import Watcher
from trtspec.errors import Cancelled, DeadlineExceeded, EngineUnavailable, RequestError
from trtspec.interfaces import SPECULATION_METHODS
from trtspec.orchestrator.adaptive import (
    LOOKUP,
    PREDICTION,
    AdaptiveDraftLength,
    ContextCost,
    CostModel,
    DeploymentCosts,
    DraftLengthPolicy,
    FixedDraftLength,
    load_bucket,
    load_range,
    with_shared,
)
from trtspec.orchestrator.breaker import DraftBreaker, GuardedDrafter
from trtspec.orchestrator.drafters import DraftSources, make_drafter
from trtspec.orchestrator.drafters.prediction import PredictionDrafter
from trtspec.orchestrator.governor import LoadGovernors, Outcome
from trtspec.orchestrator.loop import EngineClient, SpecRequest, Trace, speculate
from trtspec.orchestrator.stats import RequestStats
from trtspec.serving_settings import ServingSettings


def draft_length(
    settings: ServingSettings, method: str | None, k: int | None, *, has_draft_model: bool
) -> tuple[str, int]:
    """The request's draft source and the most tokens to draft per iteration (K), from its `speculation` (None: not
    given) and `num_draft_tokens` (None: not given).

    K is the first of: the request's num_draft_tokens; the deployment's speculation_num_draft_tokens when the request
    names a `speculation` method; the deployment's default_num_draft_tokens (0 decodes plainly, as NVIDIA's BLS does).
    The source is the request's `speculation`, else the deployment's default_speculation. K lies within the target
    engine's max_draft_len, the source none drafts nothing, and a K > 0 from the draft model needs a deployment that
    has one. Prompt lookup costs no draft call, so where the request names no K it drafts up to max_draft_len, as it
    does under auto (the deployment's K is the draft model's)."""
    if method is not None and method not in SPECULATION_METHODS:
        raise RequestError("speculation", f"must be one of {', '.join(SPECULATION_METHODS)}, got {method!r}")
    named = k is not None
    if k is None:
        k = settings.speculation_num_draft_tokens if method else settings.default_num_draft_tokens
    method = method or settings.default_speculation
    if method == "prompt_lookup" and not named and k > 0:
        k = settings.max_draft_len
    if k < 0 or k > settings.max_draft_len:
        raise RequestError(
            "num_draft_tokens",
            f"must be between 0 and the target engine's max_draft_len {settings.max_draft_len}, got {k}",
        )
    if method == "none":
        k = 0
    if k > 0 and method == "draft_model" and not has_draft_model:
        raise RequestError(
            "speculation", "this deployment has no draft model; use speculation: prompt_lookup, or num_draft_tokens 0"
        )
    return method, k


@dataclass
class Request:
    """A checked request, as the session runs it."""

    spec: SpecRequest  # spec.num_draft_tokens: K from `draft_length`
    method: str  # the draft source: draft_model, prompt_lookup, auto, none
    adaptive: bool = True  # adaptive_draft_length
    use_logits: bool = False  # use_draft_logits
    request_id: str = ""  # the engine calls of one request share it
    prediction: list[int] | None = None  # the client's predicted output, tokenized (OpenAI's Predicted Outputs)


@dataclass(frozen=True)
class Admission:
    """What a request may do as it starts, at the load it starts at."""

    k: int  # the most tokens it drafts per iteration from the draft model (0: plain)
    cap: int | None  # the governor's cap on every source, where its load range rolled back (None: no cap)
    probe: bool  # it speculates as the governor's probe while its range decodes plainly
    admitted_at: float  # the governor's clock at admission
    fallbacks: dict[str, int] = field(default_factory=dict)  # why K was lowered: load, governor


class Events(Protocol):
    """What the deployment reports: log lines and the gauges the adapter exports (trtspec.triton.metrics)."""

    def log(self, level: str, message: str) -> None:
        """`level`: info or warn."""

    def governed(self, load: str, old: str, new: str, reason: str, cap: int) -> None:
        """A load range's speculation level changed."""

    def governor_state(self, load: str, state: str, cap: int) -> None:
        """A load range's state, reported after each finished request (a range may be new)."""

    def break_even(self, loads: str, acceptance: float) -> None:
        """The break-even acceptance at a load range's costs."""

    def calibrated(self, calibration: Calibration) -> None:
        """The calibration now in use (the adapter exports its table)."""


class Deployment:
    """The request-level state a deployment's requests share: costs, governors, the draft breaker, the control file.
    `draft_name`: the draft model's name, None where the deployment has none."""

    def __init__(
        self,
        settings: ServingSettings,
        events: Events,
        *,
        draft_name: str | None = None,
        control_file: str | None = None,
        calibration_file: str | None = None,
    ):
        self.settings, self.events, self.draft_name = settings, events, draft_name
        self.draft_breaker = DraftBreaker(on_down=self._draft_down, on_up=self._draft_up)
        self.costs = DeploymentCosts(
            CostModel(settings.draft_cost_ratio, settings.verify_cost_per_token, settings.verify_cost_fixed),
            lookup_share=0.0 if draft_name else 1.0,
        )
        events.break_even(*self.costs.break_even_at(1, settings.max_draft_len))
        # the deployment's rollback, per load range: full draft length, reduced, plain (trtspec.orchestrator.governor)
        self.governor = LoadGovernors(
            settings.default_num_draft_tokens or settings.speculation_num_draft_tokens,
            hold_seconds=settings.governor_hold_seconds,
            on_change=events.governed,
        )
        self.show_governors()
        # an operator's or Alertmanager's force, through `trtspec serve --control-port` (trtspec.control)
        self.control, self._control_lock = Watcher(control_file), threading.Lock()
        # what the engines cost on this machine, measured when `trtspec serve` started (trtspec.calibration)
        self.calibration: Calibration | None = None
        self._calibration_watch = CalibrationWatch(calibration_file or "")
        self._shared: dict[int, tuple[float, float]] = {}  # load -> shared_cost, for the calibration in use
        self._plain_loads: set[str] = set()  # load ranges said to decode plainly, each said once

    @property
    def has_draft_model(self) -> bool:
        return self.draft_name is not None

    # ---- a request's start ----------------------------------------------------------------------------------
    def admit(self, request: Request, load: int) -> Admission:
        """The admission of `request` (its K in request.spec.num_draft_tokens) at `load` (requests in flight, itself
        included)."""
        k, fallbacks = request.spec.num_draft_tokens, {}
        limit = self.settings.max_speculative_concurrency  # 0: no limit
        if k > 0 and limit and load > limit:
            k, fallbacks["load"] = 0, 1
        self.refresh()
        cap, probe, admitted_at = self.governor.admit(load)
        rolled_back = cap < self.governor.k_full  # every draft source drafts at most `cap`
        if rolled_back and k > cap:
            k, fallbacks["governor"] = cap, 1
        cap = cap if rolled_back else None
        if k > 0 and request.adaptive and not self.can_pay(request, k, cap, load):
            k, fallbacks["calibration"] = 0, 1
            self._say_plain(load)
        return Admission(k, cap, probe, admitted_at, fallbacks)

    def can_pay(self, request: Request, k: int, cap: int | None, load: int) -> bool:
        """Whether any of the request's draft sources, drafting at most `k` (prompt lookup under auto: max_draft_len or
        the cap), could raise the batch's tokens per second at `load` even were every draft token accepted, by the
        costs requests start from there plus what a verification costs the others in its pass. Without a calibration
        the costs are a prior, not this hardware's: the adaptive policy finds out."""
        if self.calibration is None:
            return True
        costs = self.costs.costs_at(load)
        context = self.context_cost(load, len(request.spec.prompt))
        costs = with_shared(costs if context is None else context.add(costs), self.shared_cost(load))
        margin = AdaptiveDraftLength.margin
        if self.model_drafts(request) and costs.best(1.0, k)[1] >= 1.0 + margin:
            return True
        if request.method in ("auto", "prompt_lookup"):
            bound = self.settings.max_draft_len if cap is None else cap
            bound = bound if request.method == "auto" else k
            free = costs.without_draft()
            return free.best(1.0, bound)[1] >= 1.0 + margin
        return False

    def shared_cost(self, load: int) -> tuple[float, float]:
        """What one request's verification costs the other requests in its pass at `load`, in plain steps at that
        load, as (fixed, per draft token): its k + 1 rows lengthen the pass by its share of a pass where all `load`
        requests verify k, (verify(B, k) - plain(B)) / B, and each of the B - 1 others waits that long (B: the load,
        within the calibrated batches). (0, 0) alone, or without a calibration."""
        calibration = self.calibration
        if calibration is None or load <= 1:
            return 0.0, 0.0
        if load not in self._shared:
            batch = min(load, calibration.max_batch)
            plain = calibration.plain_at(batch)
            ks = sorted(set().union(*calibration.verify_seconds.values()))

            def lost(k: int) -> float:
                return (batch - 1) / batch * max(calibration.verify_at(batch, k) / plain - 1.0, 0.0)

            low, high = ks[0], ks[-1]
            per_token = (lost(high) - lost(low)) / (high - low) if high > low else 0.0
            self._shared[load] = (max(lost(low) - per_token * low, 0.0), max(per_token, 0.0))
        return self._shared[load]

    def context_cost(self, load: int, context: int) -> ContextCost | None:
        """What a sequence of `context` tokens adds to the costs at `load` (ContextCost), from the calibration's long
        measurement; None where it adds nothing or nothing was measured."""
        calibration = self.calibration
        if calibration is None or not calibration.context_share(context):
            return None
        short, long = calibration.cost_model(load), calibration.cost_model(load, context)
        batch = min(max(load, 1), calibration.max_batch)
        return ContextCost(
            draft_cost_ratio=long.draft_cost_ratio - short.draft_cost_ratio,
            verify_cost_fixed=long.verify_cost_fixed - short.verify_cost_fixed,
            verify_cost_per_token=long.verify_cost_per_token - short.verify_cost_per_token,
            step_ratio=calibration.plain_at(batch, context) / calibration.plain_at(batch),
        )

    def _say_plain(self, load: int) -> None:
        label = load_range(load_bucket(load))
        if label not in self._plain_loads:
            self._plain_loads.add(label)
            self.events.log(
                "warn",
                f"at load {label} no draft length can pay on this hardware (calibrated costs, every draft token "
                "accepted): requests there decode plainly from the first (fallback `calibration`)",
            )

    def start(
        self,
        request: Request,
        load: int,
        *,
        target: EngineClient,
        draft: Callable[[], EngineClient] | None = None,
        peak_load: Callable[[], int] | None = None,
        load_now: Callable[[], int] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
        recover: Callable[[EngineUnavailable], None] | None = None,
        arrived: float | None = None,
    ) -> Session:
        """A request's session. `target`: its target client; `draft()`: makes its draft model client (called only if
        it drafts from the model); `peak_load()`: the most requests in flight so far during its life (default: `load`);
        `load_now()`: the requests in flight now (default: `load`), whose passes its verifications share;
        `cancelled`, `recover`: the loop's; `arrived`: when it arrived (time.monotonic(); default now)."""
        return Session(
            self, request, load, target, draft, peak_load or (lambda: load), load_now, cancelled, recover, arrived
        )

    def sources(self, request: Request, admission: Admission, draft: Callable[[], EngineClient] | None):
        """The request's drafter, assembled from its draft sources (None when it does not draft)."""
        if admission.k <= 0:
            return None
        model = None
        if self.model_drafts(request):
            s = request.spec
            model = GuardedDrafter(
                make_drafter(
                    "draft_model",
                    client=draft(),
                    sampling=s.sampling,
                    end_id=s.end_id,
                    pad_id=s.pad_id,
                    use_logits=request.use_logits,
                ),
                self.draft_breaker,
            )
        # a prediction joins the request's sources; it costs no draft call, so it drafts as far as prompt lookup
        predicted = PredictionDrafter(request.prediction, len(request.spec.prompt)) if request.prediction else None
        if request.method == "draft_model" and predicted is None:
            return model
        lookup = None
        if request.method != "draft_model":
            lookup = make_drafter("prompt_lookup", max_matching_ngram_size=self.settings.max_matching_ngram_size)
        # prompt lookup alone is auto without a model: it offers its match at each token of a plain stretch
        lookup_k = self.lookup_k(admission) if request.method == "auto" or predicted else admission.k
        return make_drafter(
            "auto", model=model, lookup=lookup, model_k=admission.k, lookup_k=lookup_k, prediction=predicted
        )

    def policy(
        self, request: Request, admission: Admission, load: int, load_now: Callable[[], int] | None = None
    ) -> DraftLengthPolicy | None:
        """The request's draft-length policy: fixed K, or adaptive from the costs at `load`, each decision weighing
        what its verification costs the others in the pass at `load_now()` (the batch's tokens per second)."""
        if admission.k <= 0:
            return None
        if not request.adaptive:
            return FixedDraftLength(admission.k)
        # auto: prompt lookup, which costs no draft call, drafts up to max_draft_len (the model up to K)
        free = request.method == "auto" or bool(request.prediction)
        bound = max(admission.k, self.lookup_k(admission)) if free else admission.k
        load_now = load_now or (lambda: load)
        return self.costs.policy(
            bound,
            model_drafts=self.model_drafts(request),
            load=load,
            shared=lambda: self.shared_cost(load_now()),
            context=self.context_cost(load, len(request.spec.prompt)),
        )

    def lookup_k(self, admission: Admission) -> int:
        """How far prompt lookup drafts under `auto`: max_draft_len, or the governor's cap when it rolled back."""
        return self.settings.max_draft_len if admission.cap is None else admission.cap

    def model_drafts(self, request: Request) -> bool:
        """Whether the draft model drafts (alone, or in auto beside prompt lookup)."""
        return self.has_draft_model and request.method in ("draft_model", "auto")

    # ---- a request's end ------------------------------------------------------------------------------------
    def govern(self, outcome: Outcome, load: int) -> None:
        """A finished request to its load range's governor, with the break-even of that load's costs (also the
        gauge's); `load`: the most requests in flight during its life."""
        loads, even = self.costs.break_even_at(load, self.settings.max_draft_len, self.shared_cost(load))
        self.events.break_even(loads, even)
        self.governor.observe(outcome, even, load)
        self.show_governors()  # probing starts without a change of level, and a range may be new

    def show_governors(self) -> None:
        for label, gov in self.governor.ranges():
            self.events.governor_state(label, gov.state, gov.cap())

    # ---- what changes the deployment between requests -------------------------------------------------------
    def refresh(self) -> None:
        """Apply a calibration and a force that came since the last request."""
        with self._control_lock:
            calibration = self._calibration_watch.poll()
            if calibration is not None:
                self.calibrate(calibration)
            elif self._calibration_watch.error:
                self.events.log("warn", f"the calibration could not be read: {self._calibration_watch.error}")
                self._calibration_watch.error = None
            self._controlled()

    def calibrate(self, calibration: Calibration) -> None:
        """Start every load range from the costs measured on this machine: the cost models requests start from and the
        governors' plain reference (what finished requests measure refines both from there); log which loads can pay."""
        self.calibration, self._shared, self._plain_loads = calibration, {}, set()
        top = load_bucket(calibration.max_batch)

        def plain(load: int) -> float:  # a range's plain step: at its heaviest load, within the measured batches
            return calibration.plain_at(min(load, calibration.max_batch))

        self.events.calibrated(calibration)
        self.costs.seed({b: (calibration.cost_model(2**b), plain(2**b)) for b in range(top + 1)})
        self.governor.seed_plain(plain)
        k_max = self.settings.max_draft_len
        for b in range(top + 1):
            loads, even = self.costs.break_even_at(2**b, k_max, self.shared_cost(2**b))
            self.events.break_even(loads, even)
            said = f"drafts pay from acceptance {even:.2f}" if even < 1.0 else "no draft pays at any acceptance"
            self.events.log("info", f"calibrated: at load {loads} {said}")
        self.show_governors()

    def _controlled(self) -> None:
        """Apply a force the control file gained or lost since the last request."""
        changed, force = self.control.poll()
        if not changed:
            return
        if force is not None:
            self.events.log(
                "warn",
                f"speculation forced to {force.mode} for {force.remaining():.0f} s "
                f"by the {force.source}: {force.reason}",
            )
            self.governor.force(force.mode, force.remaining(), reason=force.source)
        else:
            self.governor.force(None, reason="force")

    def _draft_down(self, cause: Exception) -> None:
        """The first failure of an outage: said once (a model whose process died is being reloaded: see
        trtspec.triton.recovery)."""
        self.events.log(
            "warn",
            f"{self.draft_name} failed ({cause}); requests decode without it and it is tried again after a cool-down",
        )
        self.governor.draft_down(True)

    def _draft_up(self) -> None:
        self.events.log("info", f"{self.draft_name} answers again; speculation with it resumes")
        self.governor.draft_down(False)


class Session:
    """One request at the deployment: admitted at its load, run by the loop, its outcome reported once."""

    def __init__(
        self,
        deployment: Deployment,
        request: Request,
        load: int,
        target: EngineClient,
        draft: Callable[[], EngineClient] | None,
        peak_load: Callable[[], int],
        load_now: Callable[[], int] | None,
        cancelled: Callable[[], bool],
        recover: Callable[[EngineUnavailable], None] | None,
        arrived: float | None,
    ):
        self.deployment, self.request, self.load, self.peak_load = deployment, request, load, peak_load
        self.target, self.cancelled, self.recover = target, cancelled, recover
        self.admission = deployment.admit(request, load)
        request.spec.num_draft_tokens = self.admission.k
        self.stats = RequestStats(fallbacks=dict(self.admission.fallbacks))
        self.trace = Trace()  # the target's log probs and logits of the emitted tokens, KV blocks
        arrived = time.monotonic() if arrived is None else arrived
        self.times_ns = [int(arrived * 1e9), time.monotonic_ns(), 0, 0]  # arrival, start, first and last token
        self.drafter: DraftSources | None = deployment.sources(request, self.admission, draft)
        self.policy = deployment.policy(request, self.admission, load, load_now)
        self._finished = False

    def _cap(self) -> int | None:
        """The loop's cap before each iteration: that of the range of the most requests it has run beside, where that
        range rolled back (a burst's first requests are admitted at a lighter load than the one they run at), or a
        force came since it started (the control file is read here too); a probe keeps its length."""
        if self.admission.probe:
            return None
        self.deployment.refresh()
        return self.deployment.governor.at(self.peak_load()).rolled_back_cap()

    def run(self) -> Iterator[list[int]]:
        """The request's new tokens, as the loop yields them (where a response goes out to the client)."""
        for chunk in speculate(
            self.request.spec,
            self.target,
            self.drafter,
            policy=self.policy,
            stats=self.stats,
            cancelled=self.cancelled,
            trace=self.trace,
            recover=self.recover,
            cap=self._cap,
        ):
            now = time.monotonic_ns()  # one reading: tokens that came in one piece have first == last
            self.times_ns[2] = self.times_ns[2] or now
            self.times_ns[3] = now
            yield chunk

    @property
    def seconds_per_token(self) -> float | None:
        """Arrival to last token, per output token: what the request cost whether its tokens came apart or at once."""
        arrival, last = self.times_ns[0], self.times_ns[3]
        tokens = self.stats.generated_tokens
        return (last - arrival) / 1e9 / tokens if last and tokens else None

    def finish(self, error: BaseException | None = None) -> None:
        """The request ended (`error`: why it failed; None: it completed): what it measured goes to the most requests
        it ran beside, not to those at its start or end; its costs are learned there, and that load range's governor
        judges it. A failure counts against speculation only where it is the server's (an engine error, a timeout),
        not the client's (a bad request, a cancel). Called once; later calls do nothing."""
        if self._finished:
            return
        self._finished = True
        deployment, stats, admission, load = self.deployment, self.stats, self.admission, self.peak_load()
        if error is not None:
            if isinstance(error, DeadlineExceeded) or not isinstance(error, (Cancelled, RequestError)):
                failed = Outcome(False, None, failed=True, probe=admission.probe, admitted_at=admission.admitted_at)
                deployment.govern(failed, load)
            return
        if isinstance(self.policy, AdaptiveDraftLength):
            deployment.costs.learn(self.policy, model_drafts=deployment.model_drafts(self.request), load=load)
        deployment.costs.drafted(
            load=load,
            lookup_tokens=stats.source_tokens.get(LOOKUP, 0) + stats.source_tokens.get(PREDICTION, 0),
            draft_tokens=stats.num_draft_tokens,
        )
        outcome = Outcome(
            bool(stats.num_drafts),
            self.seconds_per_token,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_tokens=stats.num_accepted_tokens,
            probe=admission.probe,
            admitted_at=admission.admitted_at,
        )
        deployment.govern(outcome, load)
