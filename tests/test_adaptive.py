"""Prompt lookup's n-gram matcher and the adaptive draft-length controller, as pure functions."""

from __future__ import annotations

import pytest

from trtspec.orchestrator.adaptive import AdaptiveDraftLength, CostModel, FixedDraftLength, expected_tokens
from trtspec.orchestrator.drafters.prompt_lookup import NgramIndex, PromptLookupDrafter

# ---- n-gram matcher ------------------------------------------------------------------------------------------


def find_continuation(tokens, k, max_ngram=3):
    """A sequence looked up once, matches of one token and more."""
    return NgramIndex(max_ngram, 1).continuation(tokens, k)


def test_match_continues_the_most_recent_occurrence():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert find_continuation(tokens, 2, max_ngram=3) == [7, 8]  # the later "1 2 3" wins over the first


def test_longer_ngrams_are_tried_first():
    tokens = [4, 3, 10, 11, 5, 3, 20, 21, 4, 3]
    assert find_continuation(tokens, 2, max_ngram=2) == [10, 11]  # "4 3" matches; "3" alone would give 20 21
    assert find_continuation(tokens, 2, max_ngram=1) == [20, 21]


def test_no_match():
    assert find_continuation([1, 2, 3, 4], 3) == []
    assert find_continuation([7], 3) == []
    assert find_continuation([1, 2, 1], 0) == []


def test_overlapping_match_drafts_a_repetition():
    assert find_continuation([5, 6, 5, 6, 5, 6], 4, max_ngram=2) == [5, 6]  # all that follows the latest "5 6"
    assert find_continuation([5, 6, 5, 6, 5, 6], 4, max_ngram=1) == [5, 6]


def test_continuation_is_cut_at_k_and_at_the_end():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert find_continuation(tokens, 3) == [3, 4, 5]
    assert find_continuation(tokens, 10) == [3, 4, 5, 6, 1, 2]
    assert PromptLookupDrafter(max_matching_ngram_size=2).propose(tokens, 2).tokens == [3, 4]
    with pytest.raises(ValueError):
        PromptLookupDrafter(max_matching_ngram_size=0)


def _scan(tokens, k, max_ngram, min_ngram):
    """The definition, as a scan: the latest earlier start of the last n tokens, n from max_ngram down."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                return tokens[start + n : start + n + k]
    return []


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (2, 2), (4, 2), (1, 1)])
def test_the_index_of_a_growing_sequence_answers_as_the_scan(max_ngram, min_ngram):
    """Grown a token or several at a time, or replaced by another sequence, the index answers as a scan of the
    whole sequence would (small vocabulary: many matches, overlapping ones among them)."""
    import random

    rng = random.Random(max_ngram * 10 + min_ngram)
    index = NgramIndex(max_ngram, min_ngram)
    tokens: list[int] = []
    for step in range(400):
        if step % 97 == 96:
            tokens = tokens[: rng.randrange(len(tokens))]  # not a growth: indexed anew
        tokens = tokens + [rng.randrange(6) for _ in range(rng.choice([1, 1, 1, 3]))]
        k = rng.randrange(1, 9)
        assert index.continuation(tokens, k) == _scan(tokens, k, max_ngram, min_ngram), tokens


# ---- cost model ----------------------------------------------------------------------------------------------


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_best_k_grows_with_acceptance_and_shrinks_with_cost():
    cheap, costly = CostModel(0.05, 0.02), CostModel(0.5, 0.1)
    assert cheap.best(0.9, 8)[0] > cheap.best(0.5, 8)[0]
    assert cheap.best(0.8, 8)[0] >= costly.best(0.8, 8)[0]
    assert costly.best(0.1, 8)[1] < 1.0  # nothing gains: the controller must fall back


def test_a_fixed_verification_cost_favours_longer_drafts():
    # a CPU-like engine: any pass with draft tokens costs 0.8 steps more, each token 0.05
    cpu = CostModel(0.0, 0.05, 0.8)
    assert cpu.cost(0) == 1.0 and cpu.cost(4) == pytest.approx(2.0)
    k, gain = cpu.best(0.7, 8)
    assert k >= 4 and gain > 1.0  # prompt lookup (no draft cost) with good acceptance pays
    assert CostModel(0.2, 0.05, 0.8).best(0.6, 8)[1] < 1.0  # a draft model at 0.6 does not


def controller(**kw) -> AdaptiveDraftLength:
    return AdaptiveDraftLength(k_max=8, costs=CostModel(0.1, 0.05), **kw)


def feed(ctl, accepted_fraction: float, iterations: int):
    for _ in range(iterations):
        d = ctl.decide(1000)
        if d.k:
            ctl.observe(
                num_draft_tokens=d.k,
                num_accepted_tokens=round(d.k * accepted_fraction),
                draft_seconds=0.001 * d.k,
                verify_seconds=0.012,
                tokens=round(d.k * accepted_fraction) + 1,
            )
        else:
            ctl.observe(
                num_draft_tokens=0,
                num_accepted_tokens=0,
                draft_seconds=0.0,
                verify_seconds=0.01 * d.plain_tokens,
                tokens=d.plain_tokens,
            )
        yield d


def test_all_accepted_grows_k():
    ctl = controller()
    ks = [d.k for d in feed(ctl, 1.0, 12)]
    assert ks[-1] == 8 and ks[-1] > ks[0] and not ctl.fallbacks


def test_nothing_accepted_falls_back_to_plain():
    ctl = controller()
    decisions = list(feed(ctl, 0.0, 20))
    fallback = [d for d in decisions if d.k == 0]
    assert fallback and all(d.reason == "low_acceptance" for d in fallback)
    assert ctl.fallbacks["low_acceptance"] >= 1
    assert fallback[0].plain_tokens == 8  # a plain stretch goes to the target in one call
    plain = sum(d.plain_tokens for d in fallback)
    assert plain > 4 * sum(d.k for d in decisions if d.k)  # far more tokens decoded plainly than drafted


def test_probing_recovers_when_acceptance_returns():
    ctl = controller(plain_stretch=4)
    list(feed(ctl, 0.0, 16))
    assert ctl.fallbacks["low_acceptance"] >= 2
    recovered = [d.k for d in feed(ctl, 1.0, 30)]
    assert recovered[-1] >= 4  # a probe found acceptance again and speculation came back


def test_prompt_lookup_drafts_within_the_draft_model_s_fallback_stretch():
    """A stretch is the draft model's fallback; prompt lookup, which costs no draft call, drafts inside it where it
    offers a continuation and its own acceptance gains, and the stretch goes on after it."""
    from trtspec.orchestrator.adaptive import LOOKUP

    # a draft model that pays at the prior acceptance, so that its fallback stretch ends in a probe
    ctl = AdaptiveDraftLength(k_max=8, costs=CostModel(0.1, 0.05, 0.3), plain_stretch=16)
    for _ in range(30):  # the draft model's drafts are rejected until a stretch starts
        stretch = ctl.decide(1000, {"draft_model": 4, LOOKUP: 0})
        if not stretch.k:
            break
        ctl.observe(
            num_draft_tokens=stretch.k, num_accepted_tokens=0, draft_seconds=0.004, verify_seconds=0.012, tokens=1
        )
    assert stretch.k == 0 and stretch.reason == "low_acceptance"
    ctl.observe(num_draft_tokens=0, num_accepted_tokens=0, draft_seconds=0.0, verify_seconds=0.03, tokens=3)
    found = ctl.decide(1000, {"draft_model": 4, LOOKUP: 6})
    assert found.k >= 1 and found.source == LOOKUP
    ctl.observe(
        num_draft_tokens=6, num_accepted_tokens=6, draft_seconds=0.0, verify_seconds=0.012, tokens=7, source=LOOKUP
    )
    assert ctl.decide(1000, {"draft_model": 4, LOOKUP: 0}).reason == "low_acceptance"  # the stretch goes on
    for _ in range(10):  # lookup's own drafts rejected, at 1.5 steps a pass: it no longer gains, and stops drafting
        ctl.observe(
            num_draft_tokens=6, num_accepted_tokens=0, draft_seconds=0.0, verify_seconds=0.015, tokens=1, source=LOOKUP
        )
    assert ctl.decide(1000, {"draft_model": 4, LOOKUP: 6}).k == 0


def test_where_no_draft_call_pays_at_the_prior_a_request_without_a_lookup_match_decodes_on_as_lookup_alone():
    """A CPU's costs, where the draft model would not gain even at the acceptance a probe starts from: with nothing
    for prompt lookup to draft, the request decodes on, to its end or until lookup finds a match (the call's lookup
    words end it), and says why; no fallback stretch whose end is one more call for a probe that could not choose
    the model; lookup drafts when it finds something."""
    from trtspec.orchestrator.adaptive import LOOKUP

    ctl = AdaptiveDraftLength(k_max=8, costs=CostModel(0.3, 0.05, 0.3))
    assert ctl._best("draft_model", 4, 8)[1] < 1.0 + ctl.margin  # (the premise: the model does not pay here)
    for _ in range(3):
        d = ctl.decide(1000, {"draft_model": 4, LOOKUP: 0})
        assert (d.k, d.plain_tokens, d.reason) == (0, ctl.max_plain_stretch, "low_acceptance")
    assert ctl.fallbacks == {"low_acceptance": 3} and not ctl._plain_left  # said, and no stretch to end
    assert ctl.decide(1000, {"draft_model": 4, LOOKUP: 6}).source == LOOKUP
    # where the model would pay at the prior, a stretch and its probe stay
    cheap = AdaptiveDraftLength(k_max=8, costs=CostModel(0.1, 0.05), failures=20.0)
    assert cheap.decide(1000, {"draft_model": 4, LOOKUP: 0}).reason == "low_acceptance"


def test_budget_bounds_k():
    assert controller().decide(3).k <= 2
    assert controller().decide(1).k == 0
    assert FixedDraftLength(5).decide(3).k == 2


def test_failed_probes_back_off():
    ctl = controller(plain_stretch=4, max_plain_stretch=16)
    stretches = [d.plain_tokens for d in feed(ctl, 0.0, 60) if d.reason == "low_acceptance" and d.plain_tokens > 1]
    starts = [n for n in stretches if n in (4, 8, 16)]
    assert starts[:3] == [4, 8, 16] and set(starts[3:]) == {16}  # doubles after each failed probe, up to the cap


def test_where_nothing_could_pay_the_fallback_stretch_is_the_longest_at_once():
    """At costs where not even every draft token accepted would gain (a loaded batch: what a verification costs the
    others in the pass), a probe could learn nothing, and each stretch's end is one more engine call."""
    loaded = AdaptiveDraftLength(k_max=8, costs=CostModel(0.1, 0.05), shared=lambda: (4.0, 0.6))
    first = loaded.decide(1000)
    assert first.k == 0 and first.reason == "low_acceptance" and first.plain_tokens == loaded.max_plain_stretch
    # the same request alone: a draft could pay, so the prior's stretch and its probe stay
    alone = AdaptiveDraftLength(k_max=8, costs=CostModel(0.1, 0.05), prior_alpha=0.05)
    assert alone.decide(1000).plain_tokens == alone.plain_stretch


def test_request_timings_refine_the_verification_cost():
    ctl = controller()
    # plain step: 10 ms
    ctl.observe(num_draft_tokens=0, num_accepted_tokens=0, draft_seconds=0.0, verify_seconds=0.010, tokens=1)
    for _ in range(20):  # verifying 2 draft tokens takes 19 ms: 0.9 steps more, far above b·k = 0.1
        ctl.observe(num_draft_tokens=2, num_accepted_tokens=2, draft_seconds=0.0, verify_seconds=0.019, tokens=3)
    assert ctl.costs.verify_cost_fixed == pytest.approx(0.8, abs=0.01)
    assert ctl.costs.verify_cost_per_token == pytest.approx(0.05)
    assert ctl.costs.draft_cost_ratio < 0.01


def test_deployment_costs_learn_from_finished_requests():
    from trtspec.orchestrator.adaptive import DeploymentCosts

    shared = DeploymentCosts(CostModel(0.3, 0.1, 0.0), weight=0.5)
    lookup = shared.policy(4, model_drafts=False)
    assert lookup.costs.draft_cost_ratio == 0.0 and lookup.step_seconds is None
    shared.learn(lookup, model_drafts=False)  # measured nothing: teaches nothing
    assert shared.costs == CostModel(0.3, 0.1, 0.0)

    request = shared.policy(4, model_drafts=True)
    request.observe(num_draft_tokens=0, num_accepted_tokens=0, draft_seconds=0.0, verify_seconds=0.010, tokens=1)
    for _ in range(20):  # a CPU: verifying 2 tokens costs 1.9 steps; a draft step 0.15
        request.observe(num_draft_tokens=2, num_accepted_tokens=0, draft_seconds=0.003, verify_seconds=0.019, tokens=1)
    shared.learn(request, model_drafts=True)
    learned = shared.costs
    assert learned.verify_cost_fixed == pytest.approx(0.35, abs=0.01)  # halfway to the request's 0.9 - b·k = 0.7
    assert learned.draft_cost_ratio == pytest.approx(0.225, abs=0.01)  # halfway from 0.3 to 0.15
    nxt = shared.policy(4, model_drafts=True)
    assert nxt.step_seconds == pytest.approx(0.010) and nxt.costs == learned
    assert nxt.costs is not shared.costs  # each request refines its own copy
    lookup = shared.policy(4, model_drafts=False)
    lookup.observe(num_draft_tokens=2, num_accepted_tokens=2, draft_seconds=0.0, verify_seconds=0.019, tokens=3)
    shared.learn(lookup, model_drafts=False)
    assert shared.costs.draft_cost_ratio == pytest.approx(learned.draft_cost_ratio)  # prompt lookup: no draft cost


def test_a_long_sequence_starts_from_dearer_costs_and_teaches_them_as_a_short_one_s():
    from dataclasses import astuple

    from trtspec.orchestrator.adaptive import ContextCost, DeploymentCosts

    shared = DeploymentCosts(CostModel(0.3, 0.1, 0.2), weight=1.0)
    shared.seed({0: (CostModel(0.3, 0.1, 0.2), 0.010)})
    longer = ContextCost(draft_cost_ratio=0.05, verify_cost_fixed=0.1, verify_cost_per_token=0.2, step_ratio=1.5)
    policy = shared.policy(4, model_drafts=True, context=longer)
    assert astuple(policy.costs) == pytest.approx((0.35, 0.3, 0.3, 0.0)) and policy.step_seconds == pytest.approx(0.015)
    # at these costs a long request drafts less than a short one at the same acceptance (prompt lookup: 2 against 4)
    long, short = shared.policy(4, model_drafts=False, context=longer), shared.policy(4, model_drafts=False)
    long.prior_alpha = short.prior_alpha = 0.7
    assert (long.decide(100).k, short.decide(100).k) == (2, 4)
    # what it measured is learned as a short sequence's: costs exactly the context's leave the deployment's as they were
    shared.learn(policy, model_drafts=True)
    assert astuple(shared.costs) == pytest.approx((0.3, 0.1, 0.2, 0.0))
    assert shared.policy(4, model_drafts=True).step_seconds == pytest.approx(0.010)
    # and a context never takes a cost below 0
    assert ContextCost(verify_cost_fixed=-1.0).add(CostModel(0.3, 0.1, 0.2)).verify_cost_fixed == 0.0


def test_deployment_costs_are_kept_per_load():
    """Costs learned while 8 requests share each pass must not judge a lone request, nor the other way round."""
    from trtspec.orchestrator.adaptive import DeploymentCosts, load_bucket, load_range

    assert [load_bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 0, 1, 2, 2, 3, 3, 4, 4, 5]
    assert [load_range(b) for b in range(5)] == ["1", "2", "3-4", "5-8", "9-16"]
    shared = DeploymentCosts(CostModel(0.0, 0.05, 0.0), weight=1.0)
    busy = shared.policy(4, model_drafts=False, load=8)
    busy.observe(num_draft_tokens=0, num_accepted_tokens=0, draft_seconds=0.0, verify_seconds=0.010, tokens=1)
    for _ in range(10):  # under load a verification of 4 costs 2.6 plain steps
        busy.observe(num_draft_tokens=4, num_accepted_tokens=3, draft_seconds=0.0, verify_seconds=0.026, tokens=4)
    shared.learn(busy, model_drafts=False, load=8)
    assert shared.costs_at(6).verify_cost_fixed > 0.5
    alone = shared.policy(4, model_drafts=False, load=1)
    assert alone.costs == CostModel(0.0, 0.05, 0.0) and alone.step_seconds is None
    # prompt lookup on text to copy (prior acceptance 0.6): drafts alone, falls back under the learned load
    assert alone.decide(64).k > 0
    assert shared.policy(4, model_drafts=False, load=7).decide(64).k == 0


def test_an_unseen_load_starts_from_the_nearest_lighter_one():
    from trtspec.orchestrator.adaptive import DeploymentCosts

    shared = DeploymentCosts(CostModel(0.3, 0.1, 0.0), weight=1.0)
    assert shared.costs_at(4) == CostModel(0.3, 0.1, 0.0)  # nothing learned: the configured costs
    for load, v0 in ((1, 0.2), (8, 1.5)):
        request = shared.policy(2, model_drafts=True, load=load)
        request.observe(num_draft_tokens=0, num_accepted_tokens=0, draft_seconds=0.0, verify_seconds=0.010, tokens=1)
        for _ in range(10):
            request.observe(
                num_draft_tokens=1,
                num_accepted_tokens=1,
                draft_seconds=0.003,
                verify_seconds=0.010 * (1.1 + v0),
                tokens=2,
            )
        shared.learn(request, model_drafts=True, load=load)
    assert shared.costs_at(4).verify_cost_fixed == pytest.approx(shared.costs_at(1).verify_cost_fixed)
    assert shared.costs_at(16).verify_cost_fixed == pytest.approx(shared.costs_at(8).verify_cost_fixed)
    assert shared.costs_at(16).verify_cost_fixed > 1.0 > shared.costs_at(2).verify_cost_fixed
    assert shared.policy(2, model_drafts=True, load=4).step_seconds is None  # its own step, not a lighter load's


def test_the_break_even_follows_the_sources_that_drafted():
    """Prompt lookup costs no draft call: where it drafts most tokens, acceptance that pays for it must not be judged
    against the draft model's break-even (a code-editing load at 1.4x was rolled back to plain decoding that way)."""
    from trtspec.orchestrator.adaptive import DeploymentCosts

    costs = CostModel(0.3, 0.15, 0.2)
    model_even = costs.break_even(4)
    lookup_even = CostModel(0.0, 0.15, 0.2).break_even(4)
    assert lookup_even < model_even - 0.1
    shared = DeploymentCosts(costs, weight=0.5)
    assert shared.break_even_at(1, 4) == ("1", pytest.approx(model_even))  # nothing drafted yet: the draft model's
    shared.drafted(load=1, lookup_tokens=0, draft_tokens=0)  # a plain request changes nothing
    assert shared.break_even_at(1, 4)[1] == pytest.approx(model_even)
    for _ in range(12):
        shared.drafted(load=1, lookup_tokens=95, draft_tokens=100)
    assert shared.break_even_at(1, 4)[1] == pytest.approx(0.95 * lookup_even + 0.05 * model_even, abs=1e-3)
    # a heavier load not seen yet drafts as the nearest lighter one did; one that drafted from the model keeps its own
    assert shared.break_even_at(6, 4)[1] == pytest.approx(shared.break_even_at(1, 4)[1])
    for _ in range(12):
        shared.drafted(load=2, lookup_tokens=0, draft_tokens=40)
    assert shared.break_even_at(2, 4)[1] == pytest.approx(model_even, abs=1e-3)
    assert shared.break_even_at(1, 4)[1] < 0.5 * (model_even + lookup_even)
    # a deployment without a draft model starts from prompt lookup's break-even
    assert DeploymentCosts(costs, lookup_share=1.0).break_even_at(1, 4)[1] == pytest.approx(lookup_even)


def test_a_draft_call_is_learned_as_its_fixed_part_and_a_cost_a_token():
    """A served draft call costs its round trip whatever k is: a request learns c from what its calls cost beyond that
    part, so a one-token call does not price every token of a long draft at its own cost."""
    policy = AdaptiveDraftLength(8, costs=CostModel(draft_cost_ratio=0.1, draft_cost_fixed=0.3), step_seconds=0.010)
    policy.observe(num_draft_tokens=1, num_accepted_tokens=1, draft_seconds=0.005, verify_seconds=0.012, tokens=2)
    assert policy.costs.draft_cost_ratio == pytest.approx(0.7 * 0.1 + 0.3 * (0.5 - 0.3))
    assert policy.costs.draft_cost_fixed == 0.3
    # a call that cost less than its fixed part teaches c = 0, never below
    policy.observe(num_draft_tokens=4, num_accepted_tokens=4, draft_seconds=0.002, verify_seconds=0.012, tokens=5)
    assert policy.costs.draft_cost_ratio == pytest.approx(0.7 * (0.7 * 0.1 + 0.3 * 0.2))
    # the price of a draft: both parts for the draft model, neither for a source that makes no call
    assert policy.costs.cost(2) - policy.costs.without_draft().cost(2) == pytest.approx(
        0.3 + 2 * policy.costs.draft_cost_ratio
    )
