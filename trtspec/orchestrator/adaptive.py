"""How many tokens to draft next: a fixed K, or K chosen from the request's measured acceptance and costs.

Cost model, in units of one plain target step (the time the target takes to produce one token alone):

    cost(k)  = 1 + v0 + d0 + (c + b) * k     for k > 0 (cost(0) = 1)
               c: one draft step / one target step; d0: a draft-model call's cost before its first token (its round
               trip); v0: what a pass that verifies draft tokens costs beyond a plain step whatever k is (large on
               CPUs, where any multi-token pass is slower); b: the extra verification cost per draft token. A source
               that makes no draft call (prompt lookup, a prediction) pays neither c nor d0
    E(k)     = (1 - a^(k+1)) / (1 - a)   expected tokens per iteration (Leviathan et al. 2023), a: acceptance
    gain(k)  = E(k) / cost(k)        tokens per unit time relative to plain decoding (gain(0) = 1)

The adaptive policy drafts the k in 1..k_max with the largest gain. When no k gains (gain < 1 + margin), the
request falls back to plain decoding for a stretch of tokens and then decides again from the prior (a probe),
so a request whose text turns predictable again gets speculation back; a fallback after probes that got
nothing accepted doubles the stretch (up to max_plain_stretch), so a request that never pays stops paying for
probes; where no k could gain even with every draft token accepted (the costs of a loaded batch), the stretch is
max_plain_stretch at once. The acceptance `a` is the geometric model's estimate (accepted / (accepted +
rejections)) over recent iterations with exponential forgetting, starting from a prior; c, v0 and b start from the
deployment's costs and follow what this request measures.

With `speculation: auto` a request has two draft sources, and each iteration is offered what each can draft now
(prompt lookup: the continuation it found, if any; the draft model: up to k_max). Each source has its own
acceptance; prompt lookup's draft cost is c = 0 (no model call). The policy drafts from the source and k with the
largest gain, and falls back to plain decoding only when neither gains.

The deployment's costs (`DeploymentCosts`) start from what `trtspec bench --apply` measured and learn from
every finished request at its load, so a deployment that was never benchmarked stops over-estimating speculation
after its first requests, and each request can refine its costs from its first speculative iteration on.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


def expected_tokens(alpha: float, k: int) -> float:
    """E(k) = (1 - a^(k+1)) / (1 - a): accepted draft tokens plus the target's own, per iteration."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class CostModel:
    draft_cost_ratio: float = 0.3  # c: a draft-model token
    verify_cost_per_token: float = 0.1  # b
    verify_cost_fixed: float = 0.0  # v0
    # d0: a draft-model call's cost beyond its tokens' (its round trip above all), once per iteration: without it a
    # one-token draft is priced at c alone, about a third of what a served call costs
    draft_cost_fixed: float = 0.0

    def cost(self, k: int) -> float:
        if k <= 0:
            return 1.0
        fixed = self.verify_cost_fixed + self.draft_cost_fixed
        return 1.0 + fixed + (self.draft_cost_ratio + self.verify_cost_per_token) * k

    def without_draft(self) -> CostModel:
        """These costs for a draft source that makes no draft call (prompt lookup, a prediction)."""
        return dataclasses.replace(self, draft_cost_ratio=0.0, draft_cost_fixed=0.0)

    def gain(self, alpha: float, k: int) -> float:
        return expected_tokens(alpha, k) / self.cost(k)

    def best(self, alpha: float, k_max: int) -> tuple[int, float]:
        """(k, gain) with the highest gain over 1..k_max."""
        return max(((k, self.gain(alpha, k)) for k in range(1, k_max + 1)), key=lambda kg: kg[1], default=(0, 1.0))

    def break_even(self, k_max: int) -> float:
        """The acceptance below which no draft length up to k_max gains over plain decoding (1.0: none ever
        does). The best gain grows with acceptance, so it is found by bisection."""
        if k_max < 1 or self.best(1.0, k_max)[1] <= 1.0:
            return 1.0
        low, high = 0.0, 1.0
        for _ in range(30):
            mid = (low + high) / 2
            low, high = (low, mid) if self.best(mid, k_max)[1] >= 1.0 else (mid, high)
        return high


@dataclass(frozen=True)
class ContextCost:
    """What a request's sequence adds to the costs a short one starts from (trtspec.calibration measures it): each
    term in plain steps, and how many short plain steps its own plain step takes. Attention reads every cached token,
    so on a long prompt a verification's extra rows cost more plain steps than on a short one."""

    draft_cost_ratio: float = 0.0
    verify_cost_fixed: float = 0.0
    verify_cost_per_token: float = 0.0
    step_ratio: float = 1.0

    def add(self, costs: CostModel, sign: float = 1.0) -> CostModel:
        """`costs` with this added (sign -1: taken away, never below 0)."""
        return CostModel(
            draft_cost_ratio=max(costs.draft_cost_ratio + sign * self.draft_cost_ratio, 0.0),
            verify_cost_per_token=max(costs.verify_cost_per_token + sign * self.verify_cost_per_token, 0.0),
            verify_cost_fixed=max(costs.verify_cost_fixed + sign * self.verify_cost_fixed, 0.0),
            draft_cost_fixed=costs.draft_cost_fixed,  # a call's round trip does not grow with the sequence
        )


@dataclass
class Decision:
    k: int  # tokens to draft; 0 = plain decoding this iteration
    plain_tokens: int = 1  # when k == 0: how many tokens to ask the target for in one call
    reason: str | None = None  # why this iteration decodes plainly, when it is a fallback
    source: str | None = None  # which of the offered draft sources drafts (None: the drafter's own choice)


LOOKUP = "prompt_lookup"  # the draft source that costs no model call
PREDICTION = "prediction"  # the client's predicted output (OpenAI's Predicted Outputs): no model call either
FREE = (LOOKUP, PREDICTION)  # the sources whose drafts cost no draft call


class DraftLengthPolicy(Protocol):
    """What the loop asks before each iteration and tells after it (FixedDraftLength, AdaptiveDraftLength)."""

    fallbacks: dict[str, int]  # reason -> times it chose plain decoding for that reason

    def decide(self, remaining: int, offers: dict[str, int] | None = None) -> Decision:
        """The next iteration's draft length (and source, where `offers` names several), or a plain stretch."""

    def shortest_lookup_draft(self, remaining: int) -> int:
        """The shortest prompt-lookup continuation it would draft now (0: none), without changing its state."""

    def drafts_soon(self, remaining: int) -> bool:
        """Whether it would draft now from any source offering its longest, without changing its state."""

    def observe(
        self,
        *,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        draft_seconds: float,
        verify_seconds: float,
        tokens: int,
        source: str | None = None,
    ) -> None:
        """What an iteration (or a part of a plain stretch: num_draft_tokens 0) did and cost."""

    def observe_offer(self, source: str, *, num_accepted_tokens: int, rejected: bool) -> None:
        """What the target made of a free source's draft that was offered and not verified: the tokens of it that
        the target's own matched, and whether one did not (it ran out of known tokens first)."""


class FixedDraftLength:
    """Always K (the stock BLS's behaviour), within the budget."""

    def __init__(self, k: int):
        self.k_max = k
        self.fallbacks: dict[str, int] = {}  # a fixed length never falls back

    def decide(self, remaining: int, offers: dict[str, int] | None = None) -> Decision:
        return Decision(min(self.k_max, remaining - 1), plain_tokens=remaining)

    def shortest_lookup_draft(self, remaining: int) -> int:
        return 1 if self.k_max > 0 and remaining > 1 else 0

    def drafts_soon(self, remaining: int) -> bool:
        return self.k_max > 0 and remaining > 1

    def observe(
        self,
        *,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        draft_seconds: float,
        verify_seconds: float,
        tokens: int,
        source: str | None = None,
    ) -> None:
        pass

    def observe_offer(self, source: str, *, num_accepted_tokens: int, rejected: bool) -> None:
        pass


@dataclass
class AdaptiveDraftLength:
    k_max: int
    costs: CostModel = field(default_factory=CostModel)
    prior_alpha: float = 0.6
    prior_weight: float = 2.0  # the prior counts as this many observations
    decay: float = 0.8  # weight kept by older iterations at each new one
    margin: float = 0.05  # speculate only when the best gain exceeds 1 + margin
    plain_stretch: int = 8  # tokens decoded plainly after a fallback before probing again
    max_plain_stretch: int = 256  # the longest stretch that doubling reaches
    successes: float = 0.0  # of the sole draft source (or the draft model, with several)
    failures: float = 0.0
    lookup_successes: float = 0.0  # prompt lookup's, when it is offered beside the draft model (auto)
    lookup_failures: float = 0.0
    prediction_successes: float = 0.0  # the client's prediction's, where the request has one
    prediction_failures: float = 0.0
    step_seconds: float | None = None  # measured time of one plain target step
    # what the other requests in the same pass lose when this one verifies, in its plain steps, now: (fixed, per draft
    # token); added to the costs each decision weighs and never learned from this request's own timings (they do not
    # show it). None: a request alone, or no calibrated table to tell
    shared: Callable[[], tuple[float, float]] | None = None
    context: ContextCost | None = None  # what the request's sequence added to the costs it started from
    fallbacks: dict = field(default_factory=dict)
    _plain_left: int = 0
    _stretch: int = 0  # the length of the last stretch (0: none yet)
    _in_stretch: bool = False
    _accepted_since_stretch: int = 0

    @property
    def alpha(self) -> float:
        return self.alpha_of(None)

    def alpha_of(self, source: str | None) -> float:
        """The acceptance estimate of a draft source (None or anything but prompt lookup and the prediction: the main
        one)."""
        hits, misses = {
            LOOKUP: (self.lookup_successes, self.lookup_failures),
            PREDICTION: (self.prediction_successes, self.prediction_failures),
        }.get(source, (self.successes, self.failures))
        return (hits + self.prior_alpha * self.prior_weight) / (hits + misses + self.prior_weight)

    def decide(self, remaining: int, offers: dict[str, int] | None = None) -> Decision:
        """`offers`: source -> the longest draft it can give now, when the drafter has several sources (auto); the
        decision then names the source. Prompt lookup costs no draft step."""
        bound = min(self.k_max, remaining - 1)
        if bound <= 0:
            return Decision(0, plain_tokens=remaining)
        if self._plain_left > 0:
            # a stretch is the draft model's fallback: prompt lookup and the prediction, which cost no draft call,
            # still draft where they found a continuation that gains on its own acceptance
            (k, gain), free = max(((self._best(s, (offers or {}).get(s, 0), bound), s) for s in FREE), key=_gain)
            if k and gain >= 1.0 + self.margin:
                return Decision(k, source=free)
            return Decision(0, plain_tokens=min(self._plain_left, remaining), reason="low_acceptance")
        if offers is not None and not any(offers.values()):
            return Decision(0, plain_tokens=1)  # nothing to draft from right now: one token, then look again
        source, k, gain = None, 0, 1.0
        for name, longest in offers.items() if offers is not None else [(None, bound)]:
            k_here, gain_here = self._best(name, longest, bound)
            if k_here and (not k or gain_here > gain):
                source, k, gain = name, k_here, gain_here
        if gain < 1.0 + self.margin:
            self.fallbacks["low_acceptance"] = self.fallbacks.get("low_acceptance", 0) + 1
            if (
                offers is not None
                and not any(offers.get(s, 0) for s in FREE)
                and not self._probe_could_pay(offers, bound)
            ):
                # nothing free to draft, and no draft call would pay even at the acceptance a probe starts from: a
                # stretch's end would only be one more call, so decode on as far as the longest stretch, until prompt
                # lookup finds a continuation (the call's lookup words end it), as prompt lookup alone does
                return Decision(0, plain_tokens=min(remaining, self.max_plain_stretch), reason="low_acceptance")
            failed_probe = self._stretch and self._accepted_since_stretch == 0
            self._stretch = min(2 * self._stretch, self.max_plain_stretch) if failed_probe else self.plain_stretch
            if not self._could_pay(bound):
                # not even every draft token accepted would pay at these costs (the load now, say): a probe could not
                # learn otherwise, and each stretch's end is one more engine call
                self._stretch = self.max_plain_stretch
            self._plain_left = self._stretch
            self._in_stretch = True
            self._accepted_since_stretch = 0
            return Decision(0, plain_tokens=min(self._plain_left, remaining), reason="low_acceptance")
        return Decision(k, source=source)

    def shortest_lookup_draft(self, remaining: int) -> int:
        """The shortest continuation found by prompt lookup that `decide` would draft now (0: none would be), without
        changing any state: a plain call need not end where lookup finds less."""
        bound = min(self.k_max, remaining - 1)
        for longest in range(1, bound + 1):
            k, gain = self._best(LOOKUP, longest, bound)
            if k and gain >= 1.0 + self.margin:
                return longest
        return 0

    def drafts_soon(self, remaining: int) -> bool:
        """Whether `decide` would draft now were every source to offer its longest draft (the draft model at its
        cost, prompt lookup and the prediction at none, each at its own acceptance), without changing any state."""
        bound = min(self.k_max, remaining - 1)
        if bound <= 0:
            return False
        sources = FREE if self._plain_left > 0 else (None, *FREE)  # within a fallback stretch only the free ones draft
        return any(self._best(s, bound, bound)[1] >= 1.0 + self.margin for s in sources)

    def _could_pay(self, bound: int) -> bool:
        """Whether a draft of at most `bound` tokens could gain were every token accepted, at the costs now (what a
        verification costs the others in the pass included), drafted by the model or, at no draft cost, by lookup."""
        costs = self.costs if self.shared is None else with_shared(self.costs, self.shared())
        free = costs.without_draft()
        return max(costs.best(1.0, bound)[1], free.best(1.0, bound)[1]) >= 1.0 + self.margin

    def _probe_could_pay(self, offers: dict[str, int], bound: int) -> bool:
        """Whether a source that costs a draft call would gain at the prior acceptance (where a probe starts)."""
        return any(
            self._best(s, n, bound, alpha=self.prior_alpha)[1] >= 1.0 + self.margin
            for s, n in offers.items()
            if s not in FREE
        )

    def _best(self, source: str | None, longest: int, bound: int, alpha: float | None = None) -> tuple[int, float]:
        """(k, gain) of the best draft from `source` of at most `longest` tokens (prompt lookup costs no draft), at
        the source's acceptance estimate or at `alpha`."""
        if longest <= 0:
            return 0, 1.0
        costs = self.costs.without_draft() if source in FREE else self.costs
        if self.shared is not None:
            costs = with_shared(costs, self.shared())
        return costs.best(self.alpha_of(source) if alpha is None else alpha, min(bound, longest))

    def observe(
        self,
        *,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        draft_seconds: float,
        verify_seconds: float,
        tokens: int,
        source: str | None = None,
    ) -> None:
        if num_draft_tokens == 0:
            self._plain_left = max(0, self._plain_left - tokens)
            if self._plain_left == 0 and self._in_stretch:
                # the stretch is over: the probe judges the text as it is now, from the prior, not by the
                # failures that led to the stretch (acceptance comes in runs: a copied passage, a predictable phrase)
                self._in_stretch = False
                self.successes = self.failures = self.lookup_successes = self.lookup_failures = 0.0
                self.prediction_successes = self.prediction_failures = 0.0
            if tokens > 0:
                self.step_seconds = _ewma(self.step_seconds, verify_seconds / tokens)
            return
        rejected = num_accepted_tokens < num_draft_tokens  # the geometric model's one failure per iteration
        if source in FREE:
            self._learn(source, num_accepted_tokens, rejected)
        else:
            self.successes = self.successes * self.decay + num_accepted_tokens
            self.failures = self.failures * self.decay + rejected
        self._accepted_since_stretch += num_accepted_tokens
        if self.step_seconds:
            # refine the costs from this request's own timings (relative to its plain step): c directly; the
            # verification's extra cost goes to v0 beyond what b predicts, and lowers b when below it
            costs = self.costs
            if source not in FREE:  # a lookup or predicted draft says nothing of the draft model's step
                call = draft_seconds / self.step_seconds  # in plain steps: its fixed part, then c a token
                per_token = max(call - costs.draft_cost_fixed, 0.0) / num_draft_tokens
                costs.draft_cost_ratio = _ewma(costs.draft_cost_ratio, per_token)
            extra = max(verify_seconds / self.step_seconds - 1.0, 0.0)
            predicted = costs.verify_cost_per_token * num_draft_tokens
            if extra < predicted:
                costs.verify_cost_per_token = _ewma(costs.verify_cost_per_token, extra / num_draft_tokens)
                costs.verify_cost_fixed = _ewma(costs.verify_cost_fixed, 0.0)
            else:
                costs.verify_cost_fixed = _ewma(costs.verify_cost_fixed, extra - predicted)

    def observe_offer(self, source: str, *, num_accepted_tokens: int, rejected: bool) -> None:
        # a free source learns from every verification, its own or another's: a source that is never chosen (its
        # estimate below another's after one unlucky draft) would otherwise never show that it drafts better
        self._learn(source, num_accepted_tokens, rejected)

    def _learn(self, source: str, num_accepted_tokens: int, rejected: bool) -> None:
        if source == LOOKUP:
            self.lookup_successes = self.lookup_successes * self.decay + num_accepted_tokens
            self.lookup_failures = self.lookup_failures * self.decay + rejected
        elif source == PREDICTION:
            self.prediction_successes = self.prediction_successes * self.decay + num_accepted_tokens
            self.prediction_failures = self.prediction_failures * self.decay + rejected


def with_shared(costs: CostModel, shared: tuple[float, float]) -> CostModel:
    """The costs of an iteration for the batch: the request's own, plus what its extra rows cost the other requests in
    the same pass (`shared`: fixed, per draft token), so that gain > 1 means the batch's tokens per second rise."""
    fixed, per_token = shared
    if not fixed and not per_token:
        return costs
    return dataclasses.replace(
        costs,
        verify_cost_fixed=costs.verify_cost_fixed + fixed,
        verify_cost_per_token=costs.verify_cost_per_token + per_token,
    )


def _gain(best: tuple[tuple[int, float], str]) -> float:
    return best[0][1]


def _ewma(old: float | None, new: float, weight: float = 0.3) -> float:
    return new if old is None else (1 - weight) * old + weight * new


def load_bucket(load: int) -> int:
    """A load (requests in flight, itself included) in powers of two: 0 for 1, 1 for 2, 2 for 3-4, 3 for 5-8, ..."""
    return (max(load, 1) - 1).bit_length()


def load_range(bucket: int) -> str:
    """A bucket's loads as the metrics label them: "1", "2", "3-4", "5-8", ..."""
    return f"{2 ** (bucket - 1) + 1}-{2**bucket}" if bucket > 1 else str(bucket + 1)


def nearest_lighter(table: dict, bucket: int):
    """The value of the heaviest bucket in `table` lighter than `bucket`, or None: where an unseen load starts
    (what speculation costs and earns changes one way with load)."""
    lighter = [b for b in table if b < bucket]
    return table[max(lighter)] if lighter else None


class DeploymentCosts:
    """The cost models that new requests start from, shared by a deployment's requests (thread-safe): the
    configured one, moved a little toward what each finished adaptive request measured. The draft cost is the
    draft model's: prompt lookup starts at c = 0 and teaches only the verification costs and the step time.

    Costs are kept per load, the requests in flight when a request starts, in powers of two (1, 2, 3-4, 5-8,
    ...): a verification costs more plain steps the more requests share each pass (their rows add up to a
    compute-bound pass where a lone request's is bound by its weights' bytes), so costs learned under load would
    stop a lone request from speculating where it pays, and the other way round. A load not seen yet starts from
    the nearest lighter load that was (costs grow with load), not from the configured costs.

    The break-even acceptance at a load is that of the drafts made there lately: prompt lookup's draft costs no
    model call, so its break-even is lower than the draft model's, and the two are weighted by the share of the
    draft tokens prompt lookup drafted (`drafted`; `lookup_share` before any: 1.0 where no draft model is deployed)."""

    def __init__(self, costs: CostModel, weight: float = 0.2, lookup_share: float = 0.0):
        self._initial = dataclasses.replace(costs)
        self._loads: dict[int, tuple[CostModel, float | None]] = {}  # bucket -> (costs, plain step seconds)
        self._initial_share = lookup_share
        self._shares: dict[int, float] = {}  # bucket -> share of the draft tokens prompt lookup drafted, lately
        self._weight = weight
        self._lock = threading.Lock()

    def _entry(self, load: int) -> tuple[CostModel, float | None]:
        bucket = load_bucket(load)
        if bucket in self._loads:
            return self._loads[bucket]
        lighter = nearest_lighter(self._loads, bucket)
        # a lighter load's step time is not this one's: the request measures its own before refining costs
        return (self._initial if lighter is None else lighter[0]), None

    def seed(self, by_bucket: dict[int, tuple[CostModel, float | None]]) -> None:
        """Costs measured for the machine (trtspec.calibration), load bucket -> (costs, plain step seconds): where
        requests start from at each load; what finished requests measure refines them from there."""
        with self._lock:
            self._loads.update({b: (dataclasses.replace(c), step) for b, (c, step) in by_bucket.items()})

    def policy(
        self,
        k_max: int,
        *,
        model_drafts: bool,
        load: int = 1,
        shared: Callable[[], tuple[float, float]] | None = None,
        context: ContextCost | None = None,
    ) -> AdaptiveDraftLength:
        """A request's adaptive policy at `load`; `shared`: what its verifications cost the others in their passes
        (AdaptiveDraftLength.shared); `context`: what its sequence's length adds to the costs learned here."""
        with self._lock:
            costs, step = self._entry(load)
        if context is not None:
            costs = context.add(costs)
            step = step * context.step_ratio if step is not None else None
        costs = dataclasses.replace(costs) if model_drafts else costs.without_draft()  # the request's own copy
        return AdaptiveDraftLength(k_max, costs=costs, step_seconds=step, shared=shared, context=context)

    def learn(self, policy: AdaptiveDraftLength, *, model_drafts: bool, load: int = 1) -> None:
        if policy.step_seconds is None:  # the request measured nothing to compare with
            return
        w = self._weight
        theirs, their_step = policy.costs, policy.step_seconds
        if policy.context is not None:  # learned here as a short sequence's
            theirs, their_step = policy.context.add(theirs, -1.0), their_step / policy.context.step_ratio
        with self._lock:
            mine, step = self._entry(load)
            mine = dataclasses.replace(mine)
            mine.verify_cost_fixed = _ewma(mine.verify_cost_fixed, theirs.verify_cost_fixed, w)
            mine.verify_cost_per_token = _ewma(mine.verify_cost_per_token, theirs.verify_cost_per_token, w)
            if model_drafts:
                mine.draft_cost_ratio = _ewma(mine.draft_cost_ratio, theirs.draft_cost_ratio, w)
            self._loads[load_bucket(load)] = (mine, _ewma(step, their_step, w))

    def drafted(self, *, load: int, lookup_tokens: int, draft_tokens: int) -> None:
        """A finished request's draft tokens at its load, `lookup_tokens` of them from prompt lookup."""
        if draft_tokens <= 0:
            return
        with self._lock:
            share = _ewma(self._share(load), lookup_tokens / draft_tokens, self._weight)
            self._shares[load_bucket(load)] = share

    def _share(self, load: int) -> float:
        bucket = load_bucket(load)
        share = self._shares[bucket] if bucket in self._shares else nearest_lighter(self._shares, bucket)
        return self._initial_share if share is None else share

    def break_even_at(self, load: int, k_max: int, shared: tuple[float, float] = (0.0, 0.0)) -> tuple[str, float]:
        """The load's range ("1", "2", "3-4", "5-8", ...) and the break-even acceptance (CostModel.break_even) of
        the costs a request at that load starts from, for the mix of draft sources drafted there lately; `shared`: what
        its verifications cost the others in their passes (with_shared)."""
        with self._lock:
            costs, share = with_shared(dataclasses.replace(self._entry(load)[0]), shared), self._share(load)
        model = costs.break_even(k_max)
        lookup = costs.without_draft().break_even(k_max)
        return load_range(load_bucket(load)), share * lookup + (1.0 - share) * model

    def costs_at(self, load: int = 1) -> CostModel:
        with self._lock:
            return dataclasses.replace(self._entry(load)[0])

    @property
    def costs(self) -> CostModel:
        """The costs a lone request starts from."""
        return self.costs_at(1)
