"""Streamed plain decoding: one engine call per plain stretch, relayed token by token, and stopped at the engine
when the request no longer needs it. Here the scheduler's stop and the loop's relay, in process; the same through
the real tritonserver (both engine backends) is in tests/test_serving.py."""

from __future__ import annotations

import pytest
from conftest import MAX_SEQ_LEN

from trtspec.contract import GenerationRequest, GenerationResult
from trtspec.errors import EngineUnavailable
from trtspec.orchestrator.adaptive import AdaptiveDraftLength, CostModel
from trtspec.orchestrator.loop import SpecRequest, speculate
from trtspec.orchestrator.stats import RequestStats

PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def engine(built_none):
    from trtspec.engine.runtime import Engine

    return Engine.load(built_none.target)


class StreamingClient:
    """The embedded engine behind the streaming contract, counting calls: each `stream` is one engine call whose
    parts come as the scheduler chooses the tokens (one per step), and `stop` is the engine's stop request."""

    def __init__(self, engine):
        self.engine, self.calls, self.stops, self.streamed = engine, 0, 0, 0
        self.streams = True  # StreamingEngineClient.streams

    def generate(self, request: GenerationRequest) -> GenerationResult:
        self.calls += 1
        return self.engine.generate(request)

    def stream(self, request: GenerationRequest):
        self.calls += 1
        self.streamed += 1
        return _Parts(self, request)


class _Parts:
    def __init__(self, client, request):
        self.client, self.request, self.stopped = client, request, False

    def __iter__(self):
        parts, sent = [], [0]

        def part(result, final):
            parts.append(GenerationResult(result.new_tokens[sent[0] :], result.new_tokens[sent[0] :]))
            sent[0] = len(result.new_tokens)

        outcome = []
        job_id = f"call-{self.client.calls}"
        self.client.engine.submit(self.request, outcome.append, on_token=lambda r: part(r, False), request_id=job_id)
        self.job_id = job_id
        while not outcome:
            self.client.engine.scheduler.step()
            while parts:
                yield parts.pop(0)
                if self.stopped:
                    return
        part(outcome[0], True)
        yield from parts

    def stop(self):
        self.stopped = True
        self.client.stops += 1
        self.client.engine.cancel(self.job_id)

    def stop_soon(self):
        self.client.stops += 1
        self.client.engine.cancel(self.job_id)


def draft_model(client):
    from trtspec.orchestrator.drafters import make_drafter

    return make_drafter("draft_model", client=client, sampling=SpecRequest(PROMPT, 1).sampling, end_id=-1, pad_id=None)


def tokens_of(request, client, drafter=None, **kw):
    stats = RequestStats()
    chunks = list(speculate(request, client, drafter, stats=stats, **kw))
    return [t for c in chunks for t in c], chunks, stats


def test_a_streamed_plain_request_is_one_engine_call_and_equals_the_unstreamed(engine):
    client = StreamingClient(engine)
    whole, _, _ = tokens_of(SpecRequest(PROMPT, 40, end_id=-1), client)
    assert client.calls == 1
    client.calls = 0
    streamed, chunks, stats = tokens_of(SpecRequest(PROMPT, 40, end_id=-1, stream=True), client)
    assert streamed == whole and len(whole) == 40
    assert client.calls == 1 and client.stops == 0  # one call, read to its end
    assert len(chunks) == 40 and stats.finish_reason == "length"


def test_an_engine_that_cannot_stream_is_asked_one_token_per_call(engine):
    client = StreamingClient(engine)
    client.streams = False
    whole, _, _ = tokens_of(SpecRequest(PROMPT, 12, end_id=-1), StreamingClient(engine))
    streamed, _, _ = tokens_of(SpecRequest(PROMPT, 12, end_id=-1, stream=True), client)
    assert streamed == whole and client.calls == 12


def test_a_consumer_that_stops_reading_stops_the_engine_call(engine):
    client = StreamingClient(engine)
    whole, _, _ = tokens_of(SpecRequest(PROMPT, 30, end_id=-1), client)
    word = whole[9:11]
    cut = next(i + 2 for i in range(len(whole) - 1) if whole[i : i + 2] == word)
    generation = speculate(SpecRequest(PROMPT, 30, end_id=-1, stream=True), client, None)
    tokens = []
    for chunk in generation:
        tokens += chunk
        if tokens[-2:] == word:
            break
    generation.close()  # the consumer stops reading (the client left): the relay must stop the call
    assert tokens == whole[:cut] and client.stops == 1
    engine.scheduler.step()  # the next step ends it, before any forward pass
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_stop_words_cut_a_streamed_stretch_at_the_word(engine):
    client = StreamingClient(engine)
    whole, _, _ = tokens_of(SpecRequest(PROMPT, 30, end_id=-1), client)
    word = whole[6:8]
    cut = next(i + 2 for i in range(len(whole) - 1) if whole[i : i + 2] == word)
    tokens, _, stats = tokens_of(SpecRequest(PROMPT, 30, end_id=-1, stream=True, stop_words=[word]), client)
    assert tokens == whole[:cut] and stats.finish_reason == "stop_words"


@pytest.mark.parametrize("stream", [True, False])
def test_plain_stretches_go_on_in_one_call_while_the_policy_keeps_choosing_plain(engine, stream):
    """An adaptive policy whose costs make drafting lose: its first token, then, streamed to the client, ONE
    streaming call for the rest, whose stretches end in decisions, not in new calls (each new call waits for a
    forward pass to join). Not streamed, nothing is relayed token by token: each stretch is one call that returns
    its tokens at once. The target's own tokens either way."""
    client = StreamingClient(engine)
    whole, _, _ = tokens_of(SpecRequest(PROMPT, 60, end_id=-1), client)
    drafter = draft_model(client)
    policy = AdaptiveDraftLength(3, costs=CostModel(draft_cost_ratio=2.0), plain_stretch=4)
    client.calls = 0
    tokens, _, stats = tokens_of(
        SpecRequest(PROMPT, 60, num_draft_tokens=3, end_id=-1, stream=stream), client, drafter, policy=policy
    )
    assert tokens == whole and client.stops == 0
    assert policy.fallbacks["low_acceptance"] >= 4  # stretches of 4, 8, 16, 32: each ended in a decision
    assert stats.fallbacks["low_acceptance"] == policy.fallbacks["low_acceptance"]
    if stream:
        assert client.calls == client.streamed == 2 and stats.iterations == 2
    else:  # the first token, then the stretches of 4, 8, 16 and the last 31 tokens
        assert client.streamed == 0 and client.calls == stats.iterations == 5


class Scripted:
    """A policy that decodes plainly in stretches of 5 for its first `plain` decisions, then drafts 2 (counting
    what it observes)."""

    def __init__(self, plain: int):
        self.left, self.observed, self.fallbacks = plain, [], {}

    def decide(self, remaining, offers=None):
        from trtspec.orchestrator.adaptive import Decision

        if remaining <= 1:
            return Decision(0, plain_tokens=remaining)
        if self.left:
            self.left -= 1
            return Decision(0, plain_tokens=5, reason="low_acceptance")
        return Decision(2)

    def observe(self, *, num_draft_tokens, tokens, **_):
        self.observed.append((num_draft_tokens, tokens))

    def shortest_lookup_draft(self, remaining):
        return 0  # it drafts from the model alone

    def drafts_soon(self, remaining):
        return True  # it drafts after its stretches: the first token stays alone


@pytest.mark.parametrize("stream", [True, False])
def test_drafting_coming_back_stops_the_stretch_s_call(engine, stream):
    client = StreamingClient(engine)
    whole, _, _ = tokens_of(SpecRequest(PROMPT, 40, end_id=-1), client)
    drafter = draft_model(client)
    policy = Scripted(plain=3)
    client.calls = 0
    tokens, _, stats = tokens_of(
        SpecRequest(PROMPT, 40, num_draft_tokens=2, end_id=-1, stream=stream), client, drafter, policy=policy
    )
    assert tokens == whole
    plain = [n for drafted, n in policy.observed if not drafted]
    assert plain[:3] == [5, 5, 5]  # three stretches, each observed where it ended
    if stream:  # in one call, stopped where drafting came back
        assert client.stops == 1 and stats.num_drafts >= 1 and stats.iterations == 2 + stats.num_drafts
    else:  # a call each, which ends with its stretch: nothing to stop
        assert client.stops == 0 and stats.num_drafts >= 1 and stats.iterations == 4 + stats.num_drafts


def test_a_stop_frees_the_slot_within_one_step(engine):
    scheduler = engine.scheduler
    ended = []
    engine.submit(GenerationRequest(PROMPT, MAX_SEQ_LEN - len(PROMPT) - 1, end_id=-1), ended.append, request_id="long")
    engine.submit(GenerationRequest(PROMPT[:3], 50, end_id=-1), ended.append, request_id="waiting")
    scheduler.max_batch_size, saved = 1, scheduler.max_batch_size
    try:
        for _ in range(5):
            scheduler.step()
        assert [j.request_id for j in scheduler.running] == ["long"]
        assert engine.cancel("waiting") == 1  # a queued call ends at once, with nothing
        assert ended[-1].new_tokens == []
        assert engine.cancel("long") == 1 and engine.cancel("unknown") == 0
        steps = scheduler.stats.steps
        scheduler.step()
        assert not scheduler.running and scheduler.stats.steps == steps  # gone before the next forward pass
        assert len(ended[-1].new_tokens) == 5  # the tokens it had (TensorRT-LLM clears them: test_stopped_calls.py)
        assert engine.cache.running_bytes == 0
        # its KV stays for reuse: the same sequence again computes only the last token
        again = engine.generate(GenerationRequest(PROMPT + ended[-1].new_tokens, 1, end_id=-1))
        assert again.computed_tokens == 1
    finally:
        scheduler.max_batch_size = saved


@pytest.mark.parametrize("stream", [True, False])
def test_an_empty_prompt_lookup_draft_is_one_token_not_a_stopped_stream(engine, stream):
    """Prompt lookup alone says it has nothing only by proposing nothing: that costs one plain token and a new
    look, never a stretch's stream stopped after its first token."""
    from trtspec.orchestrator.drafters import make_drafter

    client = StreamingClient(engine)
    whole, _, _ = tokens_of(SpecRequest(PROMPT, 24, end_id=-1), client)
    client.calls = 0
    tokens, _, stats = tokens_of(
        SpecRequest(PROMPT, 24, num_draft_tokens=4, end_id=-1, stream=stream),
        client,
        make_drafter("prompt_lookup", max_matching_ngram_size=3),
    )
    assert tokens == whole
    assert client.stops == 0 and client.calls == stats.iterations


class Dying(StreamingClient):
    """A target whose process dies at the `at`-th token it hands out (mid-stream or mid-verification), once per
    entry of `deaths`; until `recover` runs every call fails, as calls to a dead model do."""

    def __init__(self, engine, deaths):
        super().__init__(engine)
        self.deaths, self.handed, self.dead = list(deaths), 0, False

    def _check(self):
        if self.dead:
            raise EngineUnavailable("tensorrt_llm: Stub process 'tensorrt_llm_0_0' is not healthy.")

    def _hand_out(self, tokens):
        """Count tokens handed out; die (and fail) where the next death falls among them."""
        if self.deaths and self.handed + len(tokens) > self.deaths[0]:
            self.deaths.pop(0)
            self.dead = True
            self._check()
        self.handed += len(tokens)

    def generate(self, request):
        self._check()
        result = super().generate(request)
        self._hand_out(result.new_tokens)
        return result

    def stream(self, request):
        self._check()
        parts = super().stream(request)
        client = self

        class _Stream:
            def __iter__(self):
                for part in parts:
                    client._hand_out(part.new_tokens)
                    yield part

            def stop(self):
                parts.stop()

            def stop_soon(self):
                parts.stop_soon()

        return _Stream()

    def recover(self, cause):
        assert self.dead, "recover was asked while the target was serving"
        self.dead = False


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("speculative", [False, True])
def test_a_target_that_dies_twice_costs_time_not_the_request(engine, stream, speculative):
    """The loop waits for the target (recover) and goes on from its tokens: the output equals the uninterrupted
    one, nothing is repeated, and without `recover` the failure is the request's end, as UNAVAILABLE."""
    drafter = (lambda c: draft_model(c)) if speculative else (lambda c: None)
    request = SpecRequest(PROMPT, 40, end_id=-1, stream=stream, num_draft_tokens=3 if speculative else 0)
    reference, _, _ = tokens_of(request, StreamingClient(engine), drafter(StreamingClient(engine)))
    client = Dying(engine, deaths=[7, 23])
    got, chunks, stats = tokens_of(request, client, drafter(StreamingClient(engine)), recover=client.recover)
    assert got == reference and len(got) == 40
    assert stats.recoveries == 2 and stats.generated_tokens == 40
    with pytest.raises(EngineUnavailable, match="not healthy"):
        client = Dying(engine, deaths=[7])
        tokens_of(request, client, drafter(StreamingClient(engine)))


@pytest.fixture(scope="module")
def cycling(tmp_path_factory):
    """A target whose next token depends on the last token alone (tiny.make_bigram_copy): its greedy text runs
    into a cycle, which prompt lookup then drafts whole, and until then matches nothing."""
    from support.tiny import make_bigram_copy, make_checkpoint, make_perturbed_copy, write_config

    from trtspec.compile import run_build
    from trtspec.engine.runtime import Engine

    root = tmp_path_factory.mktemp("cycling")
    base = make_checkpoint(root / "base", layers=1, seed=3)
    target = make_bigram_copy(base, root / "target")
    config = write_config(
        root / "build.yaml",
        target,
        make_perturbed_copy(base, root / "draft", noise=0.01),
        speculation={"max_draft_len": 8},
        engine={"max_input_len": 96, "max_seq_len": 200},
    )
    return Engine.load(run_build(config, root / "engines") / "target")


@pytest.mark.parametrize("stream", [True, False])
def test_prompt_lookup_ends_a_plain_stretch_where_it_finds_a_match(cycling, stream):
    """Prompt lookup as a deployment runs it (auto without a draft model, adaptive): while it finds nothing, the
    target decodes in one call. Streamed, that call is looked up at each token, and a match stops it, which is read
    on to its end (the embedded engine keeps the step in progress; TensorRT-LLM drops it: test_stopped_calls.py); not
    streamed, the engine ends it at the first match, an n-gram given as a stop word. Then the match is verified.
    Outputs equal target-only, and the calls are one per stretch and one per verification, not one per token."""
    from trtspec.orchestrator.drafters import make_drafter

    client = StreamingClient(cycling)
    prompt = [17, 90, 211, 45, 8]
    whole, _, _ = tokens_of(SpecRequest(prompt, 120, end_id=-1), client)
    first = next(i for i in range(2, len(whole)) if whole[i - 2 : i] in [whole[j : j + 2] for j in range(i - 2)])
    client.calls = 0
    drafter = make_drafter("auto", model=None, lookup=make_drafter("prompt_lookup"), lookup_k=8)
    tokens, _, stats = tokens_of(
        SpecRequest(prompt, 120, num_draft_tokens=8, end_id=-1, stream=stream),
        client,
        drafter,
        policy=AdaptiveDraftLength(8),
    )
    assert tokens == whole and first > 2  # a stretch of plain tokens first, then the cycle
    assert stats.num_drafts >= (3 if stream else 1) and stats.sources == {"prompt_lookup": stats.num_drafts}
    assert stats.num_accepted_tokens >= 0.8 * stats.num_draft_tokens  # the cycle's continuation: accepted
    # the policy learns the verifications' cost from their timings: on a busy machine one may look dear enough for a
    # fallback stretch, one more call (and, streamed, one more stop where drafting comes back)
    fallbacks = stats.fallbacks.get("low_acceptance", 0)
    if stream:  # the stretch before the cycle, stopped where the first match came
        assert 1 <= client.stops <= 1 + fallbacks
        # the first token, one stretch, the drafts
        assert client.calls == stats.iterations and stats.iterations - stats.num_drafts <= 2 + fallbacks
    else:
        # the engine ends a plain call where the text completes an n-gram the call's sequence held at its start;
        # the cycle begins inside the first one, so it is looked up when that call ends (LOOKUP_STRETCH tokens)
        assert client.stops == client.streamed == 0 and client.calls == stats.iterations
        # a call per draft and per plain stretch (the first token, the one before the cycle, the policy's fallbacks
        # of 8, 16, 32 tokens), not per token
        assert stats.iterations - stats.num_drafts <= 8


def test_a_plain_call_not_streamed_ends_where_prompt_lookup_finds_a_match(engine):
    """Not streamed, prompt lookup finding nothing costs one unary call, not a call per token: the engine gets the
    n-grams lookup would continue from as stop words and ends the call at the first one the text completes, which
    the loop then drafts from; a call ended there is not taken for one that met the end token."""
    from trtspec.orchestrator.drafters import make_drafter

    client = StreamingClient(engine)
    text, _, _ = tokens_of(SpecRequest(PROMPT, 60, end_id=-1), client)
    # a prompt holding the target's own text up to a point where it goes on with text it has not repeated yet,
    # and later completes an n-gram of the prompt (the tiny target repeats itself, as small models do)
    cut = next(i for i in range(8, 30) if _first_repeat(PROMPT + text[: i + 1], text[i + 1 :]) > 5)
    prompt, rest = PROMPT + text[: cut + 1], text[cut + 1 :]
    calls = []
    generate = client.generate

    def recording(request):
        result = generate(request)
        calls.append((request.request_output_len, len(request.stop_words), len(result.new_tokens)))
        return result

    client.generate = recording
    expected, _, _ = tokens_of(SpecRequest(prompt, 20, end_id=-1), client)
    assert expected == rest[:20]
    calls.clear()
    tokens, _, stats = tokens_of(
        SpecRequest(prompt, 20, num_draft_tokens=4, end_id=-1),
        client,
        make_drafter("auto", model=None, lookup=make_drafter("prompt_lookup"), lookup_k=4),
        policy=AdaptiveDraftLength(4),
    )
    assert tokens == expected and client.streamed == 0 and stats.finish_reason == "length"
    asked, words, got = calls[1]  # after the first token: plain until lookup finds something
    assert words > 0 and got == _first_repeat(prompt, rest) - 1 < asked
    assert stats.num_drafts >= 1 and stats.sources == {"prompt_lookup": stats.num_drafts}


def _first_repeat(before: list[int], after: list[int]) -> int:
    """How many tokens of `after` come until `before + after` first ends with a 2-gram of `before` (0: never): after
    its first token, where prompt lookup's stop words end a plain call on a prompt `before`."""
    grams = {tuple(before[i : i + 2]) for i in range(len(before) - 1)}
    seq = list(before)
    for n, token in enumerate(after, 1):
        seq.append(token)
        if tuple(seq[-2:]) in grams:
            return n
    return 0
