"""The draft-then-verify loop with in-process engines (real tiny models, no Triton)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from support.tiny import make_checkpoint, make_perturbed_copy, write_config

from trtspec.contract import SamplingParams
from trtspec.orchestrator.drafters import make_drafter
from trtspec.orchestrator.loop import Cancelled, SpecRequest, speculate
from trtspec.orchestrator.stats import RequestStats

PROMPTS = [[305, 70, 294, 280, 76, 272], [5, 6, 7], [100, 200, 300, 12, 44]]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """A 3-layer target and a draft that is the target with slightly perturbed weights (about half its
    draft tokens are accepted), built with max_draft_len 8."""
    from trtspec.compile import run_build
    from trtspec.engine.runtime import Engine, InProcessClient

    root = tmp_path_factory.mktemp("orch")
    target = make_checkpoint(root / "target", layers=3, seed=0)
    draft = make_perturbed_copy(target, root / "draft", noise=0.01)
    config = write_config(
        root / "build.yaml",
        target,
        draft,
        speculation={"max_draft_len": 8},
        engine={"max_input_len": 64, "max_seq_len": 128},
    )
    out = run_build(config, root / "engines")
    return InProcessClient(Engine.load(out / "target")), InProcessClient(Engine.load(out / "draft"))


def run(request, target, drafter=None, **kw):
    stats = RequestStats()
    tokens = [t for chunk in speculate(request, target, drafter, stats=stats, **kw) for t in chunk]
    return tokens, stats


def drafter_for(client, sampling=None, end_id=None, use_logits=False):
    return make_drafter(
        "draft_model",
        client=client,
        sampling=sampling or SamplingParams(),
        end_id=end_id,
        pad_id=None,
        use_logits=use_logits,
    )


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculation_equals_target_only(engines, k):
    target, draft = engines
    for prompt in PROMPTS:
        reference, _ = run(SpecRequest(prompt, 30, end_id=-1), target)  # -1: no end token, 30 tokens
        tokens, stats = run(SpecRequest(prompt, 30, num_draft_tokens=k, end_id=-1), target, drafter_for(draft))
        assert tokens == reference
        assert stats.generated_tokens == len(tokens) == 30
        assert stats.finish_reason == "length"
        assert 0 <= stats.num_accepted_tokens <= stats.num_draft_tokens
        assert len(stats.drafted_per_position) <= k
        # a draft is accepted as a prefix, so acceptance can only fall with position
        counts = stats.accepted_per_position
        assert all(a >= b for a, b in zip(counts, counts[1:]))


def test_partial_acceptance_is_reported(engines):
    target, draft = engines
    _, stats = run(SpecRequest(PROMPTS[0], 40, num_draft_tokens=4), target, drafter_for(draft))
    assert 0 < stats.acceptance_rate < 1
    assert stats.iterations < 40  # fewer target calls than tokens: speculation saved some


def test_self_draft_accepts_everything(engines):
    target, _ = engines
    tokens, stats = run(SpecRequest(PROMPTS[1], 20, num_draft_tokens=4), target, drafter_for(target))
    assert stats.acceptance_rate == 1.0
    assert stats.iterations == 5  # the first token alone, then 5 tokens an iteration (the last one 4)
    assert stats.position_acceptance() == [1.0] * 4


class RecordingDrafter:
    """Wraps a real drafter and records the draft lengths it was asked for."""

    def __init__(self, inner):
        self.inner, self.asked = inner, []

    def propose(self, context, k):
        self.asked.append(k)
        return self.inner.propose(context, k)

    def observe(self, *, num_draft_tokens, num_accepted_tokens):
        self.inner.observe(num_draft_tokens=num_draft_tokens, num_accepted_tokens=num_accepted_tokens)


def test_draft_length_never_exceeds_budget_minus_one(engines):
    target, _ = engines
    recorder = RecordingDrafter(drafter_for(target))  # self-draft: every iteration emits k+1 tokens
    tokens, _ = run(SpecRequest(PROMPTS[0], 8, num_draft_tokens=4), target, recorder)
    assert len(tokens) == 8
    assert recorder.asked == [4, 1]  # the first token, then 5 tokens, then 2 left: k = 2 - 1


def _reference_and_an_end(target):
    """30 tokens of target-only output, a token of it to end on, and where that token first comes."""
    reference, _ = run(SpecRequest(PROMPTS[0], 30, end_id=-1), target)
    return reference, reference[12], reference.index(reference[12])


def test_stops_on_end_id_and_stop_words(engines):
    target, draft = engines
    reference, end_id, first = _reference_and_an_end(target)
    for k in (0, 3):
        tokens, stats = run(
            SpecRequest(PROMPTS[0], 30, num_draft_tokens=k, end_id=end_id), target, drafter_for(draft, end_id=end_id)
        )
        # the end token ends the output and is not in it, as TensorRT-LLM returns it
        assert tokens == reference[:first] and stats.finish_reason == "end_id"
    stop = reference[8:10]
    at = next(i for i in range(len(reference) - 1) if reference[i : i + 2] == stop)
    tokens, stats = run(
        SpecRequest(PROMPTS[0], 30, num_draft_tokens=3, stop_words=[stop], end_id=-1), target, drafter_for(draft)
    )
    assert tokens == reference[: at + 2] and stats.finish_reason == "stop_words"


def test_stops_on_every_end_id_the_model_declares(engines):
    target, draft = engines
    reference, other, first = _reference_and_an_end(target)
    for k in (0, 3):
        for stream in (False, True):
            request = SpecRequest(PROMPTS[0], 30, num_draft_tokens=k, end_id=None, other_end_ids=[other], stream=stream)
            tokens, stats = run(request, target, drafter_for(draft))
            assert tokens == reference[:first] and stats.finish_reason == "end_id"


def _held_reference(target, prompt, other, min_tokens, max_tokens):
    """Target-only greedy output under min_tokens as vLLM and Hugging Face define it for several end tokens: none of
    them before min_tokens, the first of them after it ends the output. Two engine calls: `other` banned for the
    first min_tokens tokens, then stopped on."""
    from trtspec.contract import GenerationRequest

    held = target.generate(GenerationRequest(prompt, min_tokens, end_id=-1, bad_words=[[other]])).new_tokens
    rest = target.generate(GenerationRequest(prompt + held, max_tokens - min_tokens, end_id=-1)).new_tokens
    return held + (rest[: rest.index(other)] if other in rest else rest)


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_back_every_end_id_not_only_the_engines(engines, k, stream):
    """The engine's min-length rule masks its one end_id (TensorRT-LLM's penalty kernel: endIds only), so the
    loop bans the other end ids while fewer than min_tokens are out, in calls that end at min_tokens: an other end id
    where the model would put one is replaced by the model's next choice, and after min_tokens it ends the output."""
    target, draft = engines
    reference, other, first = _reference_and_an_end(target)
    expected = _held_reference(target, PROMPTS[0], other, first + 1, 30)
    assert other not in expected[: first + 1] and expected[:first] == reference[:first]
    request = SpecRequest(
        PROMPTS[0], 30, num_draft_tokens=k, end_id=None, other_end_ids=[other], min_tokens=first + 1, stream=stream
    )
    tokens, stats = run(request, target, drafter_for(draft))
    assert tokens == expected
    assert stats.finish_reason == ("end_id" if len(expected) < 30 else "length")


def test_ignore_eos_with_min_tokens_sends_no_min_tokens_to_either_engine(engines):
    """end_id -1 (ignore_eos) with min_tokens: neither the target's calls nor the draft model's carry min_tokens
    (the engines refuse it with no end id), so the draft model drafts, and the output is the target's own."""
    target, draft = engines
    reference, _, _ = _reference_and_an_end(target)
    for end_id in (-1, None):
        tokens, stats = run(
            SpecRequest(PROMPTS[0], 30, num_draft_tokens=3, end_id=end_id, min_tokens=20),
            target,
            drafter_for(draft, end_id=end_id),
        )
        assert tokens == reference and not stats.fallbacks.get("draft_error") and stats.num_drafts


def test_a_call_never_crosses_min_tokens_while_end_ids_are_held_back(engines):
    """A call bans the other end ids for all its tokens: each call before min_tokens ends at it, and none sends
    min_tokens with no end id (the engine refuses that: see test_runtime)."""
    target, draft = engines
    reference, other, first = _reference_and_an_end(target)
    calls = []

    class Recording:
        streams = False

        def generate(self, request):
            calls.append((len(request.input_ids) - len(PROMPTS[0]), request))  # the loop's sequence grows in place
            return target.generate(request)

    min_tokens = first + 1
    run(
        SpecRequest(PROMPTS[0], 30, num_draft_tokens=3, end_id=-1, other_end_ids=[other], min_tokens=min_tokens),
        Recording(),
        drafter_for(draft),
    )
    for before, call in calls:
        if before < min_tokens:
            assert [other] in call.bad_words and [other] not in call.stop_words
            assert before + call.request_output_len <= min_tokens
        else:
            assert [other] in call.stop_words and [other] not in call.bad_words
        assert call.min_tokens == 0  # end_id -1: nothing for min_tokens to hold back at the engine
    assert any(before >= min_tokens for before, _ in calls)


def test_cancellation_stops_at_the_next_iteration(engines):
    target, draft = engines
    calls = {"n": 0}

    def cancelled():
        calls["n"] += 1
        return calls["n"] > 2

    with pytest.raises(Cancelled):
        run(SpecRequest(PROMPTS[0], 30, num_draft_tokens=2), target, drafter_for(draft), cancelled=cancelled)
    assert calls["n"] == 3


@pytest.mark.parametrize("use_logits", [False, True])
def test_sampling_is_reproducible_with_a_seed(engines, use_logits):
    target, draft = engines
    sampling = SamplingParams(temperature=0.8, top_k=50, seed=1234)
    make = lambda: drafter_for(draft, sampling=sampling, use_logits=use_logits)  # noqa: E731
    first, _ = run(SpecRequest(PROMPTS[2], 25, num_draft_tokens=3, sampling=sampling), target, make())
    second, _ = run(SpecRequest(PROMPTS[2], 25, num_draft_tokens=3, sampling=sampling), target, make())
    other, _ = run(
        SpecRequest(PROMPTS[2], 25, num_draft_tokens=3, sampling=SamplingParams(0.8, 50, 0.0, 99)), target, make()
    )
    assert first == second
    assert first != other


def test_a_cap_that_falls_while_the_request_runs_shortens_then_ends_its_drafts(engines):
    """The deployment's cap as it goes (the governor of the load the request runs at): none, then 1 draft token,
    then plain in stretches of GOVERNED_STRETCH tokens, the output still the target's own; a cap of 0 before the
    first token leaves plain stretches from the start (no first token alone)."""
    from trtspec.orchestrator.loop import GOVERNED_STRETCH

    target, draft = engines
    reference, _ = run(SpecRequest(PROMPTS[0], 80, end_id=-1), target)
    caps = iter([None, None, 1, 1, 0])
    drafted = []
    client = drafter_for(draft)
    propose = client.propose

    def counted(sequence, k):
        drafted.append(k)
        return propose(sequence, k)

    client.propose = counted
    tokens, stats = run(
        SpecRequest(PROMPTS[0], 80, num_draft_tokens=4, end_id=-1), target, client, cap=lambda: next(caps, 0)
    )
    assert tokens == reference
    assert drafted == [4, 1, 1]  # asked before each iteration (the first token's too); at 0 nothing more is drafted
    stretches = stats.fallback_iterations["governor"]
    assert stats.fallbacks == {"governor": 1} and stats.iterations == 1 + len(drafted) + stretches
    assert stretches == 3  # 70 to 76 tokens after at most 10 before it, 32 at a time
    tokens, stats = run(SpecRequest(PROMPTS[0], 80, num_draft_tokens=4, end_id=-1), target, client, cap=lambda: 0)
    assert tokens == reference and stats.fallbacks == {"governor": 1}
    assert stats.iterations == stats.fallback_iterations["governor"] == -(-80 // GOVERNED_STRETCH)


def test_drafting_resumes_when_the_cap_does_and_the_draft_sees_the_plain_stretch(engines):
    """A cap of 0 for a while (the governor rolled back, or an operator forced plain) and then none: the request
    decodes a plain stretch, then drafts again from the whole sequence, the stretch's tokens included: each draft
    after it is what the draft model proposes for that sequence (the draft engine's cache holds no row it did not
    write), and the output is the target's own."""
    target, draft = engines
    reference, _ = run(SpecRequest(PROMPTS[0], 80, end_id=-1), target)
    caps = iter([None, None, None, 0])
    proposals = []
    client = drafter_for(draft)
    propose = client.propose

    def recorded(sequence, k):
        got = propose(sequence, k)
        proposals.append((list(sequence), k, got.tokens))
        return got

    client.propose = recorded
    tokens, stats = run(
        SpecRequest(PROMPTS[0], 80, num_draft_tokens=4, end_id=-1), target, client, cap=lambda: next(caps, None)
    )
    assert tokens == reference
    assert stats.fallback_iterations == {"governor": 1}
    before = [p for p in proposals if len(p[0]) < len(PROMPTS[0]) + 12]
    after = [p for p in proposals if p not in before]
    assert len(before) == 2 and after  # two drafts, the stretch, then drafting again
    # the stretch's tokens are in the sequence the first draft after it is made from
    stretch_end = len(after[0][0])
    assert after[0][0] == PROMPTS[0] + reference[: stretch_end - len(PROMPTS[0])]
    for sequence, k, got in after:  # the same draft as a call for that sequence with nothing cached
        draft.engine.cache.clear()
        assert drafter_for(draft).propose(sequence, k).tokens == got


def test_first_token_comes_from_the_target_alone(engines):
    target, draft = engines
    recorder = RecordingDrafter(drafter_for(draft))
    chunks = list(speculate(SpecRequest(PROMPTS[0], 12, num_draft_tokens=3, stream=True), target, recorder))
    assert len(chunks[0]) == 1
    assert len(recorder.asked) == len(chunks) - 1  # no draft before the first token


def test_a_request_whose_policy_would_draft_nothing_starts_with_a_plain_stretch(engines):
    """No first token alone where nothing would be drafted after it: the first call is the stretch, as target-only's
    one call, and the output is the target's own."""
    from trtspec.orchestrator.adaptive import AdaptiveDraftLength, CostModel

    target, draft = engines
    recorder = RecordingDrafter(drafter_for(draft))
    hopeless = AdaptiveDraftLength(3, costs=CostModel(2.0, 1.0, 3.0), prior_alpha=0.05)
    assert not hopeless.drafts_soon(12)
    stats = RequestStats()
    chunks = list(
        speculate(
            SpecRequest(PROMPTS[0], 12, num_draft_tokens=3, end_id=-1), target, recorder, policy=hopeless, stats=stats
        )
    )
    plain = list(speculate(SpecRequest(PROMPTS[0], 12, end_id=-1), target, None))
    assert [t for c in chunks for t in c] == [t for c in plain for t in c]
    assert len(chunks[0]) > 1 and recorder.asked == [] and stats.iterations < 12
    # a policy that would draft keeps the first token alone
    assert AdaptiveDraftLength(3).drafts_soon(12)


def test_streaming_plain_decoding_yields_one_token_per_iteration(engines):
    target, _ = engines
    chunks = list(speculate(SpecRequest(PROMPTS[1], 6, stream=True), target, None))
    assert [len(c) for c in chunks] == [1] * 6


def test_orchestrator_imports_neither_triton_nor_the_engine():
    code = (
        "import sys, trtspec.orchestrator.loop, trtspec.orchestrator.drafters, trtspec.orchestrator.detok;"
        "bad = [m for m in ('triton_python_backend_utils', 'trtspec.engine.runtime', 'torch') if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_incremental_detokenizer_streams_valid_utf8(tmp_path):
    from support.tiny import make_tokenizer

    from trtspec.orchestrator.detok import IncrementalDetokenizer

    tokenizer = make_tokenizer(tmp_path, 320)
    text = "héllo wörld 😀 — déjà vu ✓ done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for step in (1, 2, 3):
        detok = IncrementalDetokenizer(tokenizer)
        pieces = [detok.push(ids[i : i + step]) for i in range(0, len(ids), step)]
        pieces.append(detok.flush())
        assert "".join(pieces) == tokenizer.decode(ids)
        assert all("\ufffd" not in p for p in pieces)


def test_acceptance_is_read_off_the_tokens_not_the_optional_perf_outputs():
    """TensorRT-LLM returns acceptance counts only under return_perf_metrics: an engine that accepts every draft
    token but reports nothing must still count as accepting them, or the adaptive draft length gives up."""
    from trtspec.contract import GenerationResult
    from trtspec.orchestrator.adaptive import AdaptiveDraftLength
    from trtspec.orchestrator.loop import accepted_prefix

    class Agreeable:  # output_ids and sequence_length only: the draft accepted whole, then token 7
        def generate(self, request):
            new = (
                list(request.draft_input_ids or []) + [7]
                if request.draft_input_ids
                else [7] * request.request_output_len
            )
            return GenerationResult(request.input_ids + new, new)

    class Repeating:  # drafts 7s: always right
        def propose(self, context, k):
            from trtspec.orchestrator.drafters import Draft

            return Draft([7] * k)

        def observe(self, *, num_draft_tokens, num_accepted_tokens):
            pass

    policy = AdaptiveDraftLength(4)
    tokens, stats = run(SpecRequest([1, 2, 3], 200, num_draft_tokens=4), Agreeable(), Repeating(), policy=policy)
    assert len(tokens) == 200 and stats.num_accepted_tokens == stats.num_draft_tokens > 150
    assert not policy.fallbacks
    assert (
        accepted_prefix([4, 5, 6], [4, 5, 9, 1]) == 2
        and accepted_prefix([4], [5]) == 0
        and accepted_prefix([], [5]) == 0
    )


def test_a_failing_drafter_ends_speculation_not_the_request(engines):
    """The draft model fails mid-request: the rest is decoded by the target alone, no token lost or repeated."""
    from trtspec.orchestrator.drafters import DraftFailed

    target, draft = engines

    class Failing:
        def __init__(self, inner, after):
            self.inner, self.left, self.calls = inner, after, 0

        def propose(self, context, k):
            self.calls += 1
            if self.left == 0:
                raise DraftFailed("tensorrt_llm_draft: Stub process 'tensorrt_llm_draft_0_0' is not healthy.")
            self.left -= 1
            return self.inner.propose(context, k)

        def observe(self, *, num_draft_tokens, num_accepted_tokens):
            pass

    heard = []
    for after in (0, 2):
        reference, _ = run(SpecRequest(PROMPTS[0], 30, end_id=-1), target)
        drafter = Failing(drafter_for(draft), after)
        tokens, stats = run(
            SpecRequest(PROMPTS[0], 30, num_draft_tokens=4, end_id=-1), target, drafter, on_draft_failed=heard.append
        )
        assert tokens == reference and stats.generated_tokens == 30
        assert stats.fallbacks == {"draft_error": 1} and drafter.calls == after + 1  # tried once, then never again
        assert (stats.num_draft_tokens > 0) == (after > 0)
    assert len(heard) == 2


def test_the_draft_breaker_skips_a_failing_model_and_probes_it_again():
    from trtspec.orchestrator.breaker import DraftBreaker, GuardedDrafter
    from trtspec.orchestrator.drafters import Draft, DraftFailed

    now = [0.0]
    events = []
    breaker = DraftBreaker(
        cooldown=2.0,
        max_cooldown=5.0,
        clock=lambda: now[0],
        on_down=lambda cause: events.append(("down", str(cause))),
        on_up=lambda: events.append(("up",)),
    )

    class Model:
        healthy, calls = True, 0

        def propose(self, context, k):
            Model.calls += 1
            if not Model.healthy:
                raise DraftFailed("stub died")
            return Draft([1] * k)

        def observe(self, *, num_draft_tokens, num_accepted_tokens):
            pass

    guarded = GuardedDrafter(Model(), breaker)
    assert guarded.propose([0], 2).tokens == [1, 1]
    Model.healthy = False
    for _ in range(2):
        with pytest.raises(DraftFailed):
            guarded.propose([0], 2)
    assert Model.calls == 2  # the second request did not call the broken model
    now[0] = 2.5  # the cool-down is over: one probe, which fails; the next waits 4 s
    with pytest.raises(DraftFailed):
        guarded.propose([0], 2)
    assert Model.calls == 3
    now[0] = 6.0
    with pytest.raises(DraftFailed):
        guarded.propose([0], 2)
    assert Model.calls == 3
    now[0] = 7.0
    Model.healthy = True
    assert guarded.propose([0], 2).tokens == [1, 1] and not breaker.down
    assert events == [("down", "stub died"), ("up",)]  # once per outage, not once per request


def test_calls_from_before_an_outage_do_not_stretch_its_cool_down():
    """Requests that were drafting when the model died fail one after another (some only at their deadline): the
    outage is counted once, only the probe doubles the cool-down, and only the probe's success ends it."""
    from trtspec.orchestrator.breaker import CALL, PROBE, DraftBreaker

    now = [0.0]
    failures = []
    breaker = DraftBreaker(cooldown=2.0, max_cooldown=60.0, clock=lambda: now[0], on_failure=failures.append)
    admitted = [breaker.admit() for _ in range(8)]  # eight requests drafting at once
    assert admitted == [CALL] * 8
    for a in admitted:
        breaker.failed(RuntimeError("not healthy"), a)
    assert breaker.failures == 1 and len(failures) == 1
    now[0] = 2.1
    probe = breaker.admit()
    assert probe == PROBE and breaker.admit() is None  # one probe at a time
    breaker.succeeded(CALL)  # a late answer from before the outage
    assert breaker.down
    breaker.failed(RuntimeError("still loading"), probe)
    assert breaker.failures == 2 and len(failures) == 2
    now[0] = 2.1 + 3.9
    assert breaker.admit() is None  # the second cool-down is 4 s, not 2 ** 8
    now[0] = 6.2
    probe = breaker.admit()
    breaker.succeeded(probe)
    assert not breaker.down and breaker.admit() == CALL


# ---- speculation: auto ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def copier(tmp_path_factory):
    """A target that copies (a bigram model: see tiny.make_bigram_copy) and a draft of its vocabulary."""
    from support.tiny import make_bigram_copy

    from trtspec.compile import run_build
    from trtspec.engine.runtime import Engine, InProcessClient

    root = tmp_path_factory.mktemp("copier")
    base = make_checkpoint(root / "base", layers=1, seed=3)
    target = make_bigram_copy(base, root / "target")
    draft = make_perturbed_copy(base, root / "draft", noise=0.01)
    config = write_config(
        root / "build.yaml",
        target,
        draft,
        speculation={"max_draft_len": 8},
        engine={"max_input_len": 96, "max_seq_len": 160},
    )
    out = run_build(config, root / "engines")
    return InProcessClient(Engine.load(out / "target")), InProcessClient(Engine.load(out / "draft"))


def auto_drafter(model_client):
    model = RecordingDrafter(drafter_for(model_client))
    return make_drafter("auto", model=model, lookup=make_drafter("prompt_lookup")), model


def test_auto_copies_a_passage_with_prompt_lookup(copier):
    """The prompt holds the passage the target is about to write: auto drafts it from the prompt, and the
    draft model is not called."""
    from trtspec.orchestrator.adaptive import AdaptiveDraftLength

    target, draft = copier
    start = [17, 90, 211, 45, 8]
    passage, _ = run(SpecRequest(start, 24, end_id=-1), target)
    prompt = start + passage + start
    reference, _ = run(SpecRequest(prompt, 24, end_id=-1), target)
    assert reference == passage  # the copier copies
    auto, model = auto_drafter(draft)
    tokens, stats = run(
        SpecRequest(prompt, 24, num_draft_tokens=4, end_id=-1), target, auto, policy=AdaptiveDraftLength(4)
    )
    assert tokens == reference
    assert stats.sources.get("prompt_lookup", 0) >= 4 and model.asked == []
    assert stats.acceptance_rate == 1.0


def test_auto_drafts_free_text_with_the_model(engines):
    """On text that repeats nothing, auto calls the draft model, and only where prompt lookup has nothing."""
    from trtspec.orchestrator.adaptive import AdaptiveDraftLength

    target, draft = engines
    for prompt in PROMPTS:
        reference, _ = run(SpecRequest(prompt, 30, end_id=-1), target)
        auto, model = auto_drafter(draft)
        tokens, stats = run(
            SpecRequest(prompt, 30, num_draft_tokens=4, end_id=-1),
            target,
            auto,
            policy=AdaptiveDraftLength(4, margin=-1.0),
        )  # never falls back: every iteration drafts
        assert tokens == reference
        assert len(model.asked) == stats.sources["draft_model"] > stats.sources.get("prompt_lookup", 0)
        assert sum(stats.source_tokens.values()) == stats.num_draft_tokens


def test_auto_with_a_fixed_length_takes_a_found_continuation_first(copier):
    target, draft = copier
    start = [17, 90, 211, 45, 8]
    passage, _ = run(SpecRequest(start, 16, end_id=-1), target)
    auto, model = auto_drafter(draft)
    tokens, stats = run(SpecRequest(start + passage + start, 16, num_draft_tokens=4, end_id=-1), target, auto)
    assert tokens == passage and model.asked == [] and stats.sources == {"prompt_lookup": stats.num_drafts}
    assert stats.source_tokens == {"prompt_lookup": stats.num_draft_tokens}


def test_auto_keeps_prompt_lookup_when_the_draft_model_fails(engines):
    """A draft model that fails ends drafting from the model for the request, not speculation: prompt lookup goes on."""
    from trtspec.orchestrator.drafters import DraftFailed

    class Failing:
        calls = 0

        def propose(self, context, k):
            Failing.calls += 1
            raise DraftFailed("the draft model is down")

        def observe(self, *, num_draft_tokens, num_accepted_tokens):
            pass

    target, _ = engines
    prompt = PROMPTS[1] * 6  # repeats itself: prompt lookup finds continuations
    reference, _ = run(SpecRequest(prompt, 40, end_id=-1), target)
    # single-token matches too: the tiny model repeats few longer n-grams of its prompt
    auto = make_drafter("auto", model=Failing(), lookup=make_drafter("prompt_lookup", max_matching_ngram_size=1))
    failures = []
    tokens, stats = run(
        SpecRequest(prompt, 40, num_draft_tokens=4, end_id=-1), target, auto, on_draft_failed=failures.append
    )
    assert tokens == reference
    assert Failing.calls == len(failures) == stats.fallbacks["draft_error"] == 1
    assert stats.sources.get("prompt_lookup", 0) > 0 and "draft_model" not in stats.sources
