"""OpenAI's Predicted Outputs as a draft source: the drafter, its usage counts, the front's fields, and the loop with
in-process engines (real tiny models, no Triton)."""

from __future__ import annotations

import pytest
from support.tiny import make_checkpoint, write_config

from trtspec.openai_api.errors import APIError
from trtspec.openai_api.protocol import CHAT, COMPLETION, parse_request
from trtspec.orchestrator.adaptive import LOOKUP, PREDICTION, AdaptiveDraftLength, Decision, FixedDraftLength
from trtspec.orchestrator.drafters import make_drafter
from trtspec.orchestrator.drafters.prediction import PredictionDrafter, prediction_usage
from trtspec.orchestrator.loop import SpecRequest, speculate
from trtspec.orchestrator.stats import RequestStats

PROMPT = [7, 8, 9]


def test_the_prediction_drafts_while_the_output_follows_it():
    d = PredictionDrafter(list(range(10, 30)), prompt_len=len(PROMPT))
    assert d.continuation(PROMPT, 4) == [10, 11, 12, 13]  # nothing generated yet: the prediction's start
    assert d.continuation(PROMPT + [10, 11, 12], 3) == [13, 14, 15]
    assert d.propose(PROMPT + list(range(10, 28)), 8).tokens == [28, 29]  # the prediction's end
    assert d.propose(PROMPT + list(range(10, 30)), 8).tokens == []  # used up
    assert d.propose(PROMPT, 2).source == PREDICTION


@pytest.mark.parametrize(
    "output, expected",
    [
        ([10, 11, 99], []),  # left it: the last two tokens occur nowhere in it
        ([10, 11, 99, 13, 14], [15, 16, 17]),  # a substitution: found again by the two tokens after it
        ([10, 11, 99, 98, 12, 13], [14, 15, 16]),  # an insertion
        ([10, 11, 15, 16], [17, 18, 19]),  # a deletion
    ],
)
def test_an_edit_is_followed_by_n_gram_match_on_the_prediction(output, expected):
    d = PredictionDrafter(list(range(10, 30)), prompt_len=len(PROMPT))
    for end in range(len(output) + 1):  # token by token, as the loop asks
        got = d.continuation(PROMPT + output[:end], 3)
    assert got == expected


def test_re_alignment_takes_the_occurrence_nearest_ahead():
    # the n-gram (1, 2) occurs three times: after following the prediction to its second half, an edit there
    # re-aligns on the occurrence ahead, not on the file's first one
    prediction = [1, 2, 3, 40, 41, 42, 1, 2, 5, 43, 44, 1, 2, 6]
    d = PredictionDrafter(prediction, prompt_len=0)
    assert d.continuation(prediction[:9], 2) == [43, 44]
    assert d.continuation(prediction[:9] + [77, 1, 2], 2) == [6]  # the occurrence after position 9


def test_an_empty_prediction_drafts_nothing():
    d = PredictionDrafter([], prompt_len=1)
    assert d.continuation([5], 4) == [] and d.continuation([5, 6, 7], 4) == [] and d.lookup_words([5]) == []
    assert prediction_usage([], [1, 2, 3]) == (0, 0)


@pytest.mark.parametrize(
    "prediction, output, counts",
    [
        ([1, 2, 3, 4], [1, 2, 3, 4], (4, 0)),  # right
        ([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4], (4, 3)),  # longer than the answer
        ([1, 2, 3, 4, 5], [1, 2, 9, 4, 5], (4, 1)),  # one token replaced
        ([1, 2, 3], [7, 8, 9, 10], (0, 3)),  # wrong
        ([1, 2, 3, 4], [], (0, 4)),  # nothing generated
    ],
)
def test_usage_counts_the_predictions_tokens_that_appear_in_the_completion(prediction, output, counts):
    assert prediction_usage(prediction, output) == counts


def test_auto_offers_the_prediction_as_a_source_of_its_own():
    lookup = make_drafter("prompt_lookup")
    auto = make_drafter("auto", model=None, lookup=lookup, lookup_k=8, prediction=PredictionDrafter([4, 5, 6], 3))
    assert auto.offers([1, 2, 3], 8) == {PREDICTION: 3, "prompt_lookup": 0}
    assert list(auto.offers([1, 2, 3], 8)) == [PREDICTION, "prompt_lookup"]  # ties go to the prediction
    assert auto.propose([1, 2, 3], 2).tokens == [4, 5]  # no choice made by the policy: the prediction first
    assert auto.propose([1, 2, 3], 2, source="prompt_lookup").tokens == []
    assert [4, 5] in auto.lookup_words([1, 2, 3])  # a plain call may end where the prediction drafts again
    assert auto.without_model().prediction is not None  # a failed draft model leaves the prediction


@pytest.mark.parametrize(
    "body",
    [
        {"prediction": {"type": "content", "content": "x = 1\n"}},
        {"prediction": {"type": "content", "content": [{"type": "text", "text": t} for t in ("x = ", "1\n")]}},
    ],
)
@pytest.mark.parametrize("kind", [CHAT, COMPLETION])
def test_the_front_takes_openais_prediction(body, kind):
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    base = chat if kind == CHAT else {"model": "m", "prompt": "x"}
    req = parse_request(base | body, kind)
    assert req.prediction == "x = 1\n" and req.generate_kwargs()["prediction"] == "x = 1\n"
    assert parse_request(base | {"prediction": {"type": "content", "content": ""}}, kind).prediction == ""


@pytest.mark.parametrize(
    "prediction, param",
    [
        ({"type": "audio", "content": "x"}, "prediction"),
        ("x = 1", "prediction"),
        ({"type": "content", "content": 3}, "prediction.content"),
        ({"type": "content", "content": [{"type": "image_url"}]}, "prediction.content[0]"),
    ],
)
def test_a_bad_prediction_is_named(prediction, param):
    with pytest.raises(APIError) as err:
        parse_request({"model": "m", "prompt": "x", "prediction": prediction}, COMPLETION)
    assert err.value.status == 400 and err.value.param == param


def test_logprobs_and_the_penalties_at_the_front():
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_request(chat | {"logprobs": True}, CHAT).generate_kwargs()["return_log_probs"] is True
    assert parse_request(chat, CHAT).generate_kwargs()["return_log_probs"] is None
    assert parse_request({"model": "m", "prompt": "x", "logprobs": 0}, COMPLETION).logprobs
    for body, kind, param in [
        (chat | {"logprobs": True, "top_logprobs": 2}, CHAT, "top_logprobs"),
        ({"model": "m", "prompt": "x", "logprobs": 3}, COMPLETION, "logprobs"),
        (chat | {"presence_penalty": 2.5}, CHAT, "presence_penalty"),
        ({"model": "m", "prompt": "x", "frequency_penalty": "1"}, COMPLETION, "frequency_penalty"),
    ]:
        with pytest.raises(APIError) as err:
            parse_request(body, kind)
        assert err.value.status == 400 and err.value.param == param
    # OpenAI's penalties count the answer's tokens alone: the BLS is told to skip the whole prompt
    kw = parse_request(chat | {"presence_penalty": 0.5, "frequency_penalty": -0.25}, CHAT).generate_kwargs()
    assert (kw["presence_penalty"], kw["frequency_penalty"], kw["prompt_ignore_length"]) == (0.5, -0.25, 2**31 - 1)
    kw = parse_request(chat | {"presence_penalty": 0, "frequency_penalty": 0}, CHAT).generate_kwargs()
    assert kw["presence_penalty"] is kw["frequency_penalty"] is kw["prompt_ignore_length"] is None


# ---- the loop, with in-process engines ------------------------------------------------------------------------


def _in_process(root, checkpoint):
    """`checkpoint` built as a target engine (max_draft_len 8) under `root`, as an in-process client."""
    from trtspec.compile import run_build
    from trtspec.engine.runtime import Engine, InProcessClient

    config = write_config(
        root / "build.yaml",
        checkpoint,
        None,
        speculation={"max_draft_len": 8},
        engine={"max_input_len": 64, "max_seq_len": 160},
    )
    return InProcessClient(Engine.load(run_build(config, root / "engines") / "target"))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("prediction")
    return _in_process(root, make_checkpoint(root / "target", layers=2, seed=0))


def _run(target, prediction, policy=None, max_tokens=60):
    request = SpecRequest(PROMPT, max_tokens, num_draft_tokens=8, end_id=-1)
    drafter = make_drafter(
        "auto",
        model=None,
        lookup=make_drafter("prompt_lookup"),
        lookup_k=8,
        prediction=None if prediction is None else PredictionDrafter(prediction, len(PROMPT)),
    )
    stats = RequestStats()
    policy = policy or AdaptiveDraftLength(8)
    tokens = [t for chunk in speculate(request, target, drafter, policy=policy, stats=stats) for t in chunk]
    return tokens, stats


def test_greedy_output_is_the_targets_whatever_the_prediction(target):
    reference = [t for chunk in speculate(SpecRequest(PROMPT, 60, end_id=-1), target, None) for t in chunk]
    edited = list(reference)
    edited[20:23] = [3, 4, 5, 6]  # an edit in the middle: the rest of the prediction is right again
    unrelated = [(t * 7 + 3) % 300 for t in range(60)]
    for prediction, drafted_well in [(reference, True), (edited, True), (unrelated, False), ([], False)]:
        for policy in (None, FixedDraftLength(8)):
            tokens, stats = _run(target, prediction, policy)
            assert tokens == reference
            from_prediction = stats.source_tokens.get(PREDICTION, 0)
            # a right prediction is drafted from, and its drafts accepted (at a fixed length: the adaptive one also
            # weighs the machine's timings, which other work on it moves)
            if drafted_well and policy is not None:
                assert from_prediction > 30 and stats.num_accepted_tokens > 30
                assert stats.iterations < 30
    # a right prediction, by what the usage reports: every token of it appears, none rejected
    assert prediction_usage(reference, _run(target, reference)[0]) == (60, 0)
    # longer than the answer: its extra tokens are the rejected ones
    assert prediction_usage(reference + [1, 2, 3], _run(target, reference + [1, 2, 3])[0]) == (60, 3)


def test_the_bench_predicts_each_code_edit_from_the_code_it_quotes():
    from trtspec.bench.prompts import load_prompt_set, predictions
    from trtspec.errors import BenchError

    texts = load_prompt_set("builtin:code-edit")
    original, unrelated = predictions(texts, "original"), predictions(texts, "unrelated")
    assert len(original) == len(texts) and all(code in text for code, text in zip(original, texts))
    assert unrelated == original[1:] + original[:1]
    with pytest.raises(BenchError, match="fenced code block"):
        predictions(["no code here"], "original")


class _LookupFirst(AdaptiveDraftLength):
    """The adaptive policy made to verify prompt lookup wherever it offers a draft, recording what it is told of the
    other free sources' drafts, which are then never verified."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.offers_seen: list[tuple[str, int, bool]] = []

    def decide(self, remaining, offers=None):
        if offers and offers.get(LOOKUP):
            return Decision(offers[LOOKUP], source=LOOKUP)
        return super().decide(remaining, offers)

    def observe_offer(self, source, *, num_accepted_tokens, rejected):
        self.offers_seen.append((source, num_accepted_tokens, rejected))
        super().observe_offer(source, num_accepted_tokens=num_accepted_tokens, rejected=rejected)


@pytest.fixture(scope="module")
def copier(tmp_path_factory):
    """A target that repeats its last token (its layers add nothing, and its embeddings are tied): prompt lookup
    finds a draft of one token there, the prediction of eight."""
    from support.tiny import make_bigram_copy

    root = tmp_path_factory.mktemp("copier")
    return _in_process(root, make_bigram_copy(make_checkpoint(root / "base", layers=2, seed=0), root / "target"))


def test_the_drafts_a_free_source_offered_and_another_verified_are_scored_against_the_targets_tokens(copier):
    reference = [t for chunk in speculate(SpecRequest(PROMPT, 40, end_id=-1), copier, None) for t in chunk]
    edited = reference[:20] + [3] + reference[21:]  # one token the target does not write
    for prediction in (reference, edited):
        policy = _LookupFirst(8)
        tokens, stats = _run(copier, prediction, policy, max_tokens=40)
        assert tokens == reference and stats.sources[LOOKUP] > 0
        scored = [(accepted, rejected) for source, accepted, rejected in policy.offers_seen if source == PREDICTION]
        # lookup's one token and the target's own: where the prediction holds both, both accepted and nothing known
        # beyond; where it holds the edit in their place, rejected there
        assert (2, False) in scored
        rejected = [accepted for accepted, was_rejected in scored if was_rejected]
        assert not rejected if prediction is reference else rejected and max(rejected) <= 1


def test_a_free_source_is_chosen_once_its_unverified_drafts_show_it_drafts_better():
    policy = AdaptiveDraftLength(8, lookup_successes=4.0, lookup_failures=1.0, prediction_failures=3.0)
    offers = {PREDICTION: 8, LOOKUP: 8}
    assert policy.decide(20, offers).source == LOOKUP
    for _ in range(4):
        policy.observe_offer(PREDICTION, num_accepted_tokens=8, rejected=False)
    assert policy.alpha_of(PREDICTION) > policy.alpha_of(LOOKUP)
    assert policy.decide(20, offers).source == PREDICTION
