"""The draft-then-verify loop, per request, independent of Triton (docs/request-life.md: the whole path).

Words trtspec uses in its own sense (here, in adaptive.py and in governor.py):
  num_drafts, num_draft_tokens, num_accepted_tokens: iterations that verified a draft, draft tokens proposed,
      and of those the ones the target accepted (vLLM's names; tensors keep NVIDIA's: total_draft_tokens, ...).
  bonus token: the token the target adds of its own after the accepted prefix of a draft (at the first rejected
      position, or after the whole draft): a verification emits num_accepted_tokens + 1 tokens, so k < budget.
  plain stretch: tokens the target decodes without a draft in one engine call (or one streaming call): after a
      fallback, while a drafter has nothing to propose, or a whole request that does not speculate.
  fallback: a plain iteration with a reason, counted per reason in RequestStats: `low_acceptance` (the adaptive
      policy finds no draft length that gains: a stretch of plain_stretch tokens), `draft_error` (the drafter
      failed with no other source: plain to the end) or `governor` (the deployment's cap, asked before each
      iteration, is 0: plain in stretches of GOVERNED_STRETCH tokens, asking again after each, so that drafting
      resumes with the deployment's).
  probe: in adaptive.py, drafting again after a low-acceptance stretch, from the prior acceptance (the failures
      before the stretch forgotten); if nothing it drafts is accepted, the next stretch is twice as long. In
      governor.py, a request that speculates at the reduced length while the deployment decodes plainly.
  load bucket: DeploymentCosts keeps learned costs per load (requests in flight when a request starts) in powers
      of two: bucket 0 is 1 request, 1 is 2, 2 is 3-4, 3 is 5-8, ...; an unseen bucket starts from a lighter one.

The first iteration is the target's own prefill and first token, sent at once, so speculation never
delays the first token. Then each iteration (`_Speculation.iteration`; `speculate` owns the loop):
  1. choose k with the draft-length policy (fixed K, or adaptive: see adaptive.py), never more than the
     remaining budget minus one (the bonus token); k = 0 decodes plainly;
  2. draft: the drafter proposes up to k tokens for the whole current sequence (a drafter with several sources,
     auto, first offers what each can draft, and the policy picks one); a drafter that fails (DraftFailed) ends
     drafting from the model for the request, which goes on from where it was with prompt lookup (auto) or plainly;
  3. verify: ONE target call with the sequence, `draft_input_ids` (and `draft_logits`), asking for
     len(draft) + 1 tokens; the engine accepts a prefix of the draft and adds its own next token;
  4. stop rules: end_id, max_tokens, stop words, cancellation;
  5. observe: the drafter and the policy learn what the target accepted and what it cost; the stats count it;
  6. yield the iteration's new tokens, so the caller can stream them.
With no drafter the same loop is plain decoding: the target is asked for the remaining budget in one call
(or what the policy allows before its next probe). A streamed request reads such a plain stretch from ONE
streaming engine call (`StreamingEngineClient.stream`), relaying its tokens as they arrive, as NVIDIA's BLS streams
plain decoding; a stop rule that fires on this side, or an error, stops that call at the engine. An engine that
cannot stream is asked for one token per call instead.

A target that cannot answer for a while (EngineUnavailable: its process died and is being brought back) costs
time, not the request: the loop holds every token so far and sends the whole sequence each call, so with `recover`
(which waits for the target, or raises) it goes on from where it was, repeating nothing it has yielded.

A speculative request's plain stretches (the policy's fallbacks, or nothing to draft from), streamed to the client,
are read from one streaming call for the whole remaining budget: where the stretch ends (and at any token where
prompt lookup finds a match) the policy decides again while the call goes on, and the call is stopped only when
drafting comes back; it is then read on to its end. That stop costs a step: TensorRT-LLM ends a cancelled request
after the step in flight and clears its tokens (forwardSync: clearGeneratedTokens, trtGptModelInflightBatching.cpp
b35ac1b6), so the call's last response holds no token, and the loop counts on none (a token that does come is
relayed). The step is counted (RequestStats.wasted_steps) and its time, at most the stretch's time per token, goes
to the cost the policy observes for the draft the stop made way for. A new engine call joins the batch at the next
forward pass at the earliest, so under load each one costs its request about a step; a request whose drafting never
pays is one call after its first token, as it would be without speculation; one whose policy would draft nothing
even were every source to offer its longest draft starts with that call.
Not streamed to the client, each stretch is one unary call: a response per token would cost every token a trip
through two Python stubs and the server that nobody reads (on a 2-core CPU, 6% of a request's time). So that
prompt lookup is not missed, the call carries as stop words the n-grams after which lookup would find a
continuation the policy drafts (their last token ends the call at the engine), and goes at most LOOKUP_STRETCH
tokens, after which the text it made is looked up too. Where the policy would draft nothing lookup finds (at a load
where verifying does not pay, say), the call has no such words and goes IDLE_STRETCH tokens: under load every extra
call costs its request about a step, which 32-token calls with nothing to end them early made 10% of a request's time
(Spec-Bench at C=8, 4.4 calls a request against target-only's one).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Protocol

import numpy as np

from trtspec.contract import GenerationRequest, GenerationResult, Penalties, SamplingParams, StopWords
from trtspec.errors import Cancelled, EngineUnavailable
from trtspec.orchestrator.adaptive import FREE, Decision, DraftLengthPolicy, FixedDraftLength
from trtspec.orchestrator.drafters import Draft, Drafter, DraftFailed, DraftSources, as_sources
from trtspec.orchestrator.stats import RequestStats


class EngineClient(Protocol):
    def generate(self, request: GenerationRequest) -> GenerationResult: ...


class EngineStream(Protocol):
    """A streaming engine call (TensorRT-LLM's `streaming`): each item holds the tokens since the previous one
    (the last may hold none) and their log probs and logits; the other outputs come with the last."""

    def __iter__(self) -> Iterator[GenerationResult]: ...

    def stop(self) -> None:
        """Stop the call at the engine (a no-op once its last response arrived)."""

    def stop_soon(self) -> None:
        """Stop the call at the engine, and read on: the responses until its last are still iterated. The step in
        progress when the stop arrives is lost with TensorRT-LLM (its token is cleared, never sent)."""


class StreamingEngineClient(EngineClient, Protocol):
    streams: bool  # whether `stream` works (TensorRT-LLM streams from decoupled engine models only)

    def stream(self, request: GenerationRequest) -> EngineStream: ...


@dataclass
class SpecRequest:
    prompt: list[int]
    max_tokens: int
    num_draft_tokens: int = 0
    sampling: SamplingParams = SamplingParams()
    end_id: int | None = None
    pad_id: int | None = None
    stop_words: list[list[int]] = field(default_factory=list)
    # end tokens besides end_id (the engine takes one end id per request): until min_tokens are out, banned at the
    # engine (bad words: its min-length rule masks end_id alone) in calls that end at min_tokens; then sent as stop
    # words and ended on here like end_id
    other_end_ids: list[int] = field(default_factory=list)
    stream: bool = False
    # what the target applies at every position (the drafts are only proposals: the target's rules decide)
    min_tokens: int = 0
    penalties: Penalties = Penalties()
    bad_words: list[list[int]] = field(default_factory=list)
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    return_perf_metrics: bool = False


@dataclass
class Trace:
    """The target's per-token outputs of a request, as the loop emits its tokens: log probs and generation
    logits of every emitted token, and the prompt's context logits (from the first target call)."""

    log_probs: list[float] = field(default_factory=list)
    generation_logits: list[np.ndarray] = field(default_factory=list)
    context_logits: np.ndarray | None = None
    kv_blocks: list[int] = field(default_factory=lambda: [0, 0, 0])  # new, reused, total, over the target calls


def speculate(
    request: SpecRequest,
    target: EngineClient,
    drafter: Drafter | DraftSources | None,
    *,
    policy: DraftLengthPolicy | None = None,
    stats: RequestStats | None = None,
    cancelled: Callable[[], bool] = lambda: False,
    on_draft_failed: Callable[[DraftFailed], None] = lambda exc: None,
    trace: Trace | None = None,
    recover: Callable[[EngineUnavailable], None] | None = None,
    cap: Callable[[], int | None] | None = None,
) -> Iterator[list[int]]:
    """Yield the new tokens of each iteration until a stop rule fires; `stats` (and `trace`, with the target's
    log probs and logits when the request asks for them) are filled as it goes.
    `policy` chooses each iteration's draft length (default: always `request.num_draft_tokens`);
    `on_draft_failed` hears of a drafter's failure (the loop itself goes on without drafts); `recover` is called
    when the target is unavailable and returns once it answers again (or raises: the request ends with it);
    `cap()`: the deployment's draft-length cap as the request goes on, None for none (an iteration drafts at most
    that; at 0 the rest decodes plainly, fallback `governor`)."""
    stats = stats if stats is not None else RequestStats()
    run = _Speculation(request, target, drafter, policy, stats, trace, on_draft_failed, cap)
    while True:
        if cancelled():  # 4. the stop rule checked before each iteration
            stats.finish_reason = "cancelled"
            raise Cancelled()
        it = yield from run.iteration()  # 1. to 5. (a streamed stretch's tokens are yielded as they arrive)
        if it.unavailable is not None and recover is None:
            raise it.unavailable from None
        # 5. the request's stats count it
        stats.record(
            num_draft_tokens=it.num_draft_tokens,
            num_accepted_tokens=it.num_accepted_tokens,
            emitted=len(it.tokens),
            draft_seconds=it.draft_seconds,
            verify_seconds=it.verify_seconds,
            fallback=it.fallback,
            source=it.source,
            wasted_steps=it.wasted_steps,
        )
        run.sequence += it.tokens
        run.generated += len(it.tokens)
        if it.unavailable is not None:
            # the tokens a stream relayed before it broke are the client's already: the request goes on after them
            stats.recoveries += 1
            recover(it.unavailable)
            continue
        # 6. yield
        if it.tokens and not it.streamed:
            yield it.tokens
        if it.finish_reason:
            stats.finish_reason = it.finish_reason
            stats.fallbacks.update(run.policy.fallbacks)
            return


@dataclass
class Iteration:
    """What one iteration did."""

    tokens: list[int]  # its new tokens, cut by the stop rules
    _: KW_ONLY
    num_draft_tokens: int = 0  # draft tokens verified (0: a plain iteration)
    num_accepted_tokens: int = 0  # of those, accepted and kept (the stop rules may cut accepted tokens too)
    source: str | None = None  # the draft source, when it drafted
    fallback: str | None = None  # why it decoded plainly, when that was a fallback
    draft_seconds: float = 0.0  # deciding and drafting
    verify_seconds: float = 0.0  # the target's call
    streamed: bool = False  # its tokens were yielded as they arrived
    finish_reason: str | None = None  # generation ended with it (end_id, stop_words, length)
    unavailable: EngineUnavailable | None = None  # the target failed: `tokens` were relayed before it did
    wasted_steps: int = 0  # target steps lost: the step a stopped streaming call was in (its token cleared)


@dataclass
class _Call:
    """What an iteration's engine call gave: its tokens cut by the stop rules, and what the loop observes of it."""

    new: list[int]
    reason: str | None  # finish reason, when a stop rule fired
    num_accepted_tokens: int = 0
    streamed: bool = False  # its tokens were yielded as they arrived
    wasted: float | None = None  # a stopped stretch's lost step, in seconds
    extend: _Extension | None = None  # where a streamed stretch was extended: the part the policy saw


class _Speculation:
    """A request's state between iterations: its sequence so far, and its drafter and whether it still
    speculates (a drafter that fails is dropped, or narrowed to its other source).

    Each iteration chooses (`_choose`), drafts (`_draft`), then makes ONE kind of engine call: a verification of the
    draft (`_verify`), a plain stretch read from a streaming call (`_stream_plain`), or a plain unary call
    (`_plain`); then the drafter and the policy observe it (`_observe`)."""

    def __init__(
        self,
        request: SpecRequest,
        target: EngineClient,
        drafter: Drafter | DraftSources | None,
        policy: DraftLengthPolicy | None,
        stats: RequestStats,
        trace: Trace | None,
        on_draft_failed: Callable[[DraftFailed], None],
        cap: Callable[[], int | None] | None = None,
    ):
        self.request, self.target, self.stats, self.trace = request, target, stats, trace
        self.drafter: DraftSources | None = as_sources(drafter)
        self.on_draft_failed, self.cap = on_draft_failed, cap
        self.speculative = drafter is not None and request.num_draft_tokens > 0
        self.policy: DraftLengthPolicy = (
            policy if policy is not None else FixedDraftLength(request.num_draft_tokens if self.speculative else 0)
        )
        self.can_stream = getattr(target, "streams", False)  # EngineClient or StreamingEngineClient
        self.sequence = list(request.prompt)  # the engine gets it whole each call
        self.generated = 0
        self.lost: str | None = None  # why speculation stopped for the rest of this request
        self.switch_seconds = 0.0  # the step the last stopped stretch lost, not yet observed

    def iteration(self):
        """One iteration, steps 1 to 5 (the caller records it and yields its tokens): a generator that yields a
        streamed stretch's tokens as they arrive and returns the `Iteration`."""
        request, remaining = self.request, self.request.max_tokens - self.generated
        span = _span(request, self.generated, remaining)  # what this iteration may generate
        start = time.perf_counter()
        decision, offers, first = self._choose(span)  # 1. choose k
        draft, decision = self._draft(decision, span)  # 2. draft
        drafted_at = time.perf_counter()
        # 3. verify (or decode plainly): one engine call, of one kind
        try:
            if draft is not None and draft.tokens:
                call = self._verify(draft, remaining)
            elif self.can_stream and request.stream:
                # 4. the stop rules applied to each part; the stretch's tokens are yielded as they arrive
                call = yield from self._stream_plain(decision, span, first, drafted_at)
            else:
                call = self._plain(decision, span, first, remaining)
        except (EngineUnavailable, _Interrupted) as exc:
            cause, relayed = (exc.cause, exc.tokens) if isinstance(exc, _Interrupted) else (exc, [])
            return Iteration(
                relayed,
                draft_seconds=drafted_at - start,
                verify_seconds=time.perf_counter() - drafted_at,
                streamed=True,
                unavailable=cause,
            )
        verified_at = time.perf_counter()
        num_draft_tokens = len(draft.tokens) if draft else 0
        source = draft.source if num_draft_tokens else None
        if not first:  # 5. observe (a policy tells sources apart only where it was offered several: auto)
            named = source if offers is not None else None
            self._observe(call, num_draft_tokens, named, start, drafted_at, verified_at)
            if num_draft_tokens and offers is not None:
                self._score_offers(source, call.new)
        return Iteration(
            call.new,
            num_draft_tokens=num_draft_tokens,
            num_accepted_tokens=min(call.num_accepted_tokens, len(call.new)),
            source=source,
            fallback=decision.reason if not num_draft_tokens else None,
            draft_seconds=drafted_at - start,
            verify_seconds=verified_at - drafted_at,
            streamed=call.streamed,
            finish_reason=call.reason,
            wasted_steps=int(call.wasted is not None),
        )

    def _choose(self, span: int) -> tuple[Decision, dict[str, int] | None, bool]:
        """Step 1: (the decision, what the sources offered for it, whether it is the target's first token, alone)."""
        cap = self.cap() if self.speculative and self.cap is not None else None
        governed = cap is not None and cap <= 0  # the deployment decodes plainly at the load this request runs at now
        if governed:
            self.stats.fallbacks["governor"] = 1  # a request's fallback, as the session counts one at admission
        # the target's first token, alone, so that drafting can start from it; where the policy would draft nothing
        # even were every source to offer its longest, the request starts with a plain stretch (one call, as
        # target-only makes, where nothing comes to pay)
        first = self.generated == 0 and self.speculative and not governed and self.policy.drafts_soon(span)
        offers = None
        if first:
            decision = Decision(0, plain_tokens=1)
        elif governed:  # a stretch, then the cap is asked again: drafting resumes where the deployment's does
            decision = Decision(0, plain_tokens=min(span, GOVERNED_STRETCH), reason="governor")
        else:
            offers = self.drafter.offers(self.sequence, span - 1) if self.speculative else None
            decision = self.policy.decide(span, offers)
        if cap is not None and decision.k > cap:
            decision = replace(decision, k=cap)
        if not self.speculative:
            decision = Decision(0, plain_tokens=span if self.lost else decision.plain_tokens, reason=self.lost)
        return decision, offers, first

    def _asked(self, decision: Decision, span: int) -> int:
        """The tokens a plain call asks for: the decision's stretch; one where a drafter found nothing to propose
        (prompt lookup without a match: one plain token, then it looks again); one per call where the client reads
        a stream that the engine cannot give."""
        asked = decision.plain_tokens if decision.k == 0 else 1
        return 1 if self.request.stream and not self.can_stream else max(1, min(asked, span))

    def _stretch(self, decision: Decision, first: bool) -> bool:
        """Whether a plain call is a stretch the policy chose (not an empty draft: a drafter of one source says it
        has nothing only by proposing nothing, which is one token and a look)."""
        return self.speculative and not first and decision.k == 0

    def _verify(self, draft: Draft, remaining: int) -> _Call:
        """Step 3, a verification: ONE target call with the draft, asking for len(draft) + 1 tokens."""
        request = self.request
        result = self.target.generate(_verify_request(request, self.sequence, draft, 0, self.generated))
        new = result.new_tokens[:remaining]
        num_accepted_tokens = accepted_prefix(draft.tokens, new)
        # 4. stop rules. The engine returns no end token (as TensorRT-LLM): a verification that ended on it returns no
        # bonus token
        ended = len(new) < num_accepted_tokens + 1
        new, reason = self._stop_rules(new, ended)
        if self.trace is not None:
            _record(self.trace, result, len(new))
        return _Call(new, reason, num_accepted_tokens)

    def _plain(self, decision: Decision, span: int, first: bool, remaining: int) -> _Call:
        """Step 3, a plain unary call. A stretch not streamed to the client is one call, which the engine ends where
        prompt lookup would find a match (with nothing to draft now, the stretch runs until it does)."""
        request, plain = self.request, self._asked(decision, span)
        unary_stretch = self._stretch(decision, first) and not request.stream
        # (while the deployment decodes plainly, a lookup match is no reason to end the call)
        lookup = self._lookup_words(span) if unary_stretch and decision.reason != "governor" else []
        if unary_stretch and (lookup or decision.reason is None):
            plain = min(span if decision.reason is None else plain, LOOKUP_STRETCH if lookup else IDLE_STRETCH)
        result = self.target.generate(_verify_request(request, self.sequence, None, plain, self.generated, lookup))
        new = result.new_tokens[:remaining]
        # 4. stop rules: a plain call that ended on the end token returns fewer tokens than asked
        ended = len(new) < plain
        if ended and lookup and StopWords(lookup).completed_by(self.sequence + new):
            ended = False  # the call ended where prompt lookup finds a match, not on the end token
        new, reason = self._stop_rules(new, ended)
        if self.trace is not None:
            _record(self.trace, result, len(new))
        return _Call(new, reason)

    def _stream_plain(self, decision: Decision, span: int, first: bool, drafted_at: float):
        """Step 3, a plain stretch read from one streaming call, its tokens yielded as they arrive. A stretch the policy
        chose goes on in the same call while it keeps choosing plain (`_Extension`)."""
        plain = self._asked(decision, span)
        extend = (
            _Extension(self.policy, self.drafter, self.sequence, span, plain, drafted_at, self._governed)
            if self._stretch(decision, first)
            else None
        )
        call = _verify_request(self.request, self.sequence, None, span if extend else plain, self.generated)
        new, reason, wasted = yield from _relay(
            self.request,
            self.target.stream(call),
            call.request_output_len,
            self.sequence,
            self.generated,
            self.trace,
            extend,
        )
        return _Call(new, reason, streamed=True, wasted=wasted, extend=extend)

    def _governed(self) -> bool:
        """Whether the deployment's cap is 0 now (it decodes plainly at the load this request runs at)."""
        cap = self.cap() if self.cap is not None else None
        return cap is not None and cap <= 0

    def _stop_rules(self, new: list[int], ended: bool) -> tuple[list[int], str | None]:
        at_budget = self.generated + len(new) >= self.request.max_tokens
        return _apply_stop_rules(self.request, self.sequence, new, at_budget, ended)

    def _observe(
        self,
        call: _Call,
        num_draft_tokens: int,
        source: str | None,
        start: float,
        drafted_at: float,
        verified_at: float,
    ) -> None:
        """Step 5: the drafter and the policy learn what the target accepted and what it cost."""
        if num_draft_tokens:
            self.drafter.observe(num_draft_tokens=num_draft_tokens, num_accepted_tokens=call.num_accepted_tokens)
        stretch_end = verified_at - (call.wasted or 0.0)  # when its last token came, before a stop's lost step
        extend, new = call.extend, call.new
        tail, tail_from = (len(new) - extend.observed, extend.since) if extend else (len(new), drafted_at)
        # the step a stopped stretch lost is the cost of the draft it made way for (a plain iteration's cost is its
        # time per token, which a step with no token would skew)
        switch, self.switch_seconds = (self.switch_seconds, 0.0) if num_draft_tokens else (0.0, 0.0)
        self.policy.observe(
            num_draft_tokens=num_draft_tokens,
            num_accepted_tokens=call.num_accepted_tokens,
            draft_seconds=drafted_at - start,
            verify_seconds=(stretch_end if call.wasted is not None else verified_at) - tail_from + switch,
            tokens=tail,
            source=source,
        )
        if call.wasted is not None:
            # a lost step costs one step: the stretch's own time per token bounds what the stop's wait is charged
            # (the wait also holds the stop's way to the engine, which a busy machine stretches)
            per_token = (stretch_end - drafted_at) / len(new) if new else call.wasted
            self.switch_seconds = min(call.wasted, per_token)

    def _score_offers(self, verified: str | None, new: list[int]) -> None:
        """The free sources' drafts that were offered beside the verified one, scored against the target's tokens:
        their matching prefix is what the target would have accepted of them."""
        for source, tokens in self.drafter.offered().items():
            if source != verified and tokens:
                matched = accepted_prefix(tokens, new)
                rejected = matched < min(len(tokens), len(new))  # past `new`, what the target says is not known
                self.policy.observe_offer(source, num_accepted_tokens=matched, rejected=rejected)

    def _lookup_words(self, remaining: int) -> list[list[int]]:
        """The n-grams whose completion ends a plain call of a request that is not streamed, so that the policy
        decides again there: where prompt lookup will find a continuation long enough for the policy to draft it
        (none when the drafter has no lookup, or the policy would draft nothing it finds)."""
        shortest = self.policy.shortest_lookup_draft(remaining)
        return self.drafter.lookup_words(self.sequence, shortest) if shortest else []

    def _draft(self, decision: Decision, remaining: int) -> tuple[Draft | None, Decision]:
        """Step 2: the draft `decision` asks for (None when it decodes plainly), and the decision it goes on with.
        A drafter that fails goes on with its other source (auto: prompt lookup); one with none leaves the rest of
        the request to plain decoding."""
        if decision.k <= 0:
            return None, decision
        try:
            return self.drafter.propose(self.sequence, decision.k, source=decision.source), decision
        except DraftFailed as exc:
            self.stats.fallbacks["draft_error"] = self.stats.fallbacks.get("draft_error", 0) + 1
            self.on_draft_failed(exc)
            self.drafter = self.drafter.without_model()
            if self.drafter is None:
                self.speculative, self.lost = False, "draft_error"
                return None, Decision(0, plain_tokens=remaining, reason=self.lost)
            return self.drafter.propose(self.sequence, decision.k), decision


def _span(request: SpecRequest, generated: int, remaining: int) -> int:
    """The most tokens one iteration may generate: `remaining`, or while the other end ids are held back, what is
    left of min_tokens, so that no call generates on both sides of it (a call bans them for all its tokens)."""
    if request.other_end_ids and generated < request.min_tokens:
        return min(remaining, request.min_tokens - generated)
    return remaining


# While the deployment's cap is 0 a request decodes plainly this many tokens at a time, asking the cap again after each
# stretch (a streamed stretch goes on in the same call), so that drafting resumes when the deployment's does.
GOVERNED_STRETCH = 32

# A plain call that prompt lookup may end goes at most this far: the n-grams it is given are the sequence's at its
# start, so the text it generates is looked up when the next call starts.
LOOKUP_STRETCH = 32

# A plain call that nothing may end early (the policy would draft nothing prompt lookup finds now) goes at most this
# far before the policy decides again: far enough that its extra calls cost little, near enough that a load that fell
# is seen within the request.
IDLE_STRETCH = 128


class _Interrupted(Exception):
    """A streamed stretch whose target became unavailable after `tokens` had been relayed."""

    def __init__(self, tokens: list[int], cause: EngineUnavailable):
        super().__init__(str(cause))
        self.tokens, self.cause = tokens, cause


class _Extension:
    """Where a plain stretch read from a streaming call ends, the policy decides again (the stretch's tokens
    observed as a plain iteration): plain again extends the stretch in the same call, drafting ends it. It also
    decides again at any token where prompt lookup, which costs no draft call, found a continuation."""

    def __init__(
        self,
        policy: DraftLengthPolicy,
        drafter: DraftSources,
        sequence: list[int],
        remaining: int,
        stretch: int,
        since: float,
        governed: Callable[[], bool] = lambda: False,
    ):
        self.policy, self.drafter, self.sequence, self.remaining = policy, drafter, sequence, remaining
        self.end = stretch  # the stretch ends after this many of the call's tokens
        self.governed = governed  # whether the deployment's cap is 0 now: the stretch goes on whatever the policy says
        self.observed, self.since = 0, since  # tokens the policy has seen, and when the unseen ones began
        self.shortest = policy.shortest_lookup_draft(remaining)  # the least lookup continuation it would draft now

    def due(self, got: list[int]) -> bool:
        """Whether to decide again after the call's tokens so far: at the stretch's end, or where prompt lookup
        found a continuation the policy would draft (none looked for where it would draft none: no search a token)."""
        if len(got) >= self.end:
            return True
        if not self.shortest:
            return False
        offers = self.drafter.offers(self.sequence + got, self.remaining - len(got) - 1)
        return bool(offers and any(offers.get(source, 0) >= self.shortest for source in FREE))

    def __call__(self, got: list[int]) -> bool:
        """Called with the call's tokens so far where `due`; True: read on."""
        now = time.perf_counter()
        self.policy.observe(
            num_draft_tokens=0,
            num_accepted_tokens=0,
            draft_seconds=0.0,
            verify_seconds=now - self.since,
            tokens=len(got) - self.observed,
        )
        self.observed, self.since = len(got), now
        left = self.remaining - len(got)
        if self.governed():
            self.end = len(got) + GOVERNED_STRETCH
            return True
        decision = self.policy.decide(left, self.drafter.offers(self.sequence + got, left - 1))
        if decision.k > 0:
            return False  # decided again, the same way, at the next iteration (a drafting decision changes nothing)
        self.end = len(got) + decision.plain_tokens
        self.shortest = self.policy.shortest_lookup_draft(left)  # the load, and so the shared cost, may have moved
        return True


def _relay(
    request: SpecRequest,
    stream: EngineStream,
    asked: int,
    sequence: list[int],
    generated: int,
    trace: Trace | None,
    extend: _Extension | None = None,
):
    """Yield a plain stretch's tokens as the streaming call returns them, cut by the stop rules; stop the call
    when a rule fires here first, or on any exit before its last response. When `extend` ends the stretch, the call
    is stopped and read on to its end; the step in flight when the stop arrives is lost (TensorRT-LLM clears a
    cancelled request's tokens), and any token that still comes is relayed.
    Returns (the stretch's tokens, finish reason or None, the seconds from that stop to the call's end when no
    token came after it: the wasted step, else None)."""
    got: list[int] = []
    reason, last, received, complete, ending = None, None, 0, False, False
    stopped_at, after_stop = 0.0, 0  # when stop_soon went, and the tokens that came after it
    try:
        for part in stream:
            last, received = part, received + len(part.new_tokens)
            after_stop += len(part.new_tokens) if ending else 0
            if reason or (ending and not part.new_tokens):
                continue  # the call's own end, after its last token, or the end of a call stopped here
            budget = request.max_tokens - generated - len(got)
            new, reason = _apply_stop_rules(
                request,
                sequence + got,
                part.new_tokens[:budget],
                generated + len(got) + len(part.new_tokens) >= request.max_tokens,
                False,
            )
            if trace is not None:
                _record(trace, part, len(new), kv=False)
            got += new
            if new:
                yield new
            if reason and received < asked:
                break
            if extend is not None and not (reason or ending) and extend.due(got) and not extend(got):
                ending, stopped_at = True, time.perf_counter()
                stream.stop_soon()
        else:
            complete = True
    except EngineUnavailable as exc:
        complete = True  # a call that failed has ended: nothing to stop
        if not reason:  # (after a stop rule fired, only the call's end was still to come)
            raise _Interrupted(got, exc) from exc
    finally:
        if not complete:
            stream.stop()
    if trace is not None and last is not None and last.kv_blocks is not None:
        trace.kv_blocks = [
            a + b for a, b in zip(trace.kv_blocks, last.kv_blocks)
        ]  # the perf outputs are running totals
    if reason is None and complete and len(got) < asked and not ending:
        # the engine ended the call early: on the end token, which it does not return (a call stopped here ended
        # early for that; had it also met the end token, the next call says so at once)
        reason = "end_id"
    wasted = time.perf_counter() - stopped_at if ending and complete and not after_stop else None
    return got, reason, wasted


def accepted_prefix(draft: list[int], new: list[int]) -> int:
    """Draft tokens the target accepted, read off the tokens it returned: its output starts with the accepted
    draft tokens, then its own token, which differs from the rejected draft token (under rejection sampling the
    residual distribution has no mass there). Engines report this too, but TensorRT-LLM only with
    return_perf_metrics, so the loop takes it from the tokens, which every engine returns."""
    n = 0
    for d, t in zip(draft, new):
        if d != t:
            break
        n += 1
    return n


def _verify_request(
    request: SpecRequest, sequence: list[int], draft, plain_tokens: int, generated: int, lookup: list[list[int]] = ()
) -> GenerationRequest:
    has_draft = draft is not None and bool(draft.tokens)
    holding = generated < request.min_tokens  # the other end ids are banned, not stop words (see `_span`)
    return GenerationRequest(
        input_ids=sequence,
        request_output_len=len(draft.tokens) + 1 if has_draft else plain_tokens,
        end_id=-1 if request.end_id is None else request.end_id,  # -1: none (an absent end_id is the engine's own)
        pad_id=request.pad_id,
        sampling=request.sampling,
        draft_input_ids=draft.tokens if has_draft else None,
        draft_logits=draft.logits if has_draft else None,
        # TensorRT-LLM's min-length rule masks the request's end id only (penaltyKernels.cu: outLogits[endIds[slot]]),
        # and with no end id (-1, or none given: createNewDecoderRequests takes mEndId.value_or(-1)) kernels without
        # the `endIds[slot] > -1` guard (3c44cb97) would mask logits[-1]: min_tokens goes only with an end id
        min_tokens=max(0, request.min_tokens - generated) if _has_end_id(request.end_id) else 0,
        penalties=request.penalties,
        bad_words=request.bad_words + ([[e] for e in request.other_end_ids] if holding else []),
        stop_words=request.stop_words + ([] if holding else [[e] for e in request.other_end_ids]) + list(lookup),
        return_log_probs=request.return_log_probs,
        return_generation_logits=request.return_generation_logits,
        return_context_logits=request.return_context_logits and generated == 0,
        return_perf_metrics=request.return_perf_metrics,
        # the loop holds the sequence: the engine answers with the new tokens alone, not the sequence again
        exclude_input_in_output=True,
    )


def _has_end_id(end_id: int | None) -> bool:
    return end_id is not None and end_id >= 0


def _record(trace: Trace, result: GenerationResult, kept: int, kv: bool = True) -> None:
    if result.log_probs is not None:
        trace.log_probs += result.log_probs[:kept]
    if result.generation_logits is not None:
        trace.generation_logits += list(result.generation_logits[:kept])
    if result.context_logits is not None and trace.context_logits is None:
        trace.context_logits = result.context_logits
    if kv and result.kv_blocks is not None:
        trace.kv_blocks = [a + b for a, b in zip(trace.kv_blocks, result.kv_blocks)]


def _apply_stop_rules(request: SpecRequest, sequence: list[int], new: list[int], at_budget: bool, ended: bool):
    """Cut `new` at the first completed stop word (or end token, from an engine that returns it); return (tokens
    to keep, finish reason or None). `ended`: the engine stopped on the end token."""
    stops = StopWords(request.stop_words)
    tail = list(sequence[-stops.longest :]) if stops else []
    before = len(sequence) - len(request.prompt)  # tokens generated before `new`
    for i, token in enumerate(new):
        if request.end_id is not None and token == request.end_id:
            return new[:i], "end_id"
        if token in request.other_end_ids and before + i >= request.min_tokens:
            return new[:i], "end_id"
        if stops:
            tail.append(token)
            if stops.completed_by(tail):
                return new[: i + 1], "stop_words"
    if ended:
        return new, "end_id"
    if at_budget:
        return new, "length"
    if not new:  # an engine that returns nothing would loop forever
        return new, "end_id"
    return new, None
