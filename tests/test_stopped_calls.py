"""A stopped engine call as TensorRT-LLM ends it: the step in flight when the stop arrives is lost (forwardSync's
clearGeneratedTokens), a streaming call's log probs come whole with every response, and the loop neither counts on
the lost token nor hides its cost. In process, on the embedded engine with the backend's rule switched on
(`clear_cancelled`, as the stand-in sets it); the stand-in through the real tritonserver is in
tests/test_tensorrtllm_standin.py."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import torch
from test_streaming import Scripted

from trtspec.contract import GenerationRequest, GenerationResult, StreamedResults
from trtspec.errors import EngineError
from trtspec.orchestrator.loop import SpecRequest, speculate
from trtspec.orchestrator.stats import RequestStats

PROMPT = [5, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def engine(built_none):
    from trtspec.engine.runtime import Engine

    engine = Engine.load(built_none.target)
    engine.scheduler.clear_cancelled = True
    return engine


class _Forward:
    """The scheduler's model, with a stop that arrives while a forward pass is in flight (on a GPU the executor
    always has one), and every pass taking `seconds` longer (a step of that length)."""

    def __init__(self, model, stop, seconds=0.0):
        self.model, self.stop, self.seconds, self.armed = model, stop, seconds, False

    def forward(self, segments):
        if self.armed:
            self.armed = False
            self.stop()
        time.sleep(self.seconds)
        return self.model.forward(segments)


def _step(engine) -> None:
    with torch.inference_mode():  # as the engine's own thread runs its steps
        engine.scheduler.step()


def _streamed(engine, request, stop_at: int):
    """A streaming call stopped during the forward pass after its `stop_at`-th token: (what it streamed, its last
    result)."""
    streamed, outcome = [], []
    forward = _Forward(engine.scheduler.model, lambda: engine.cancel("stopped"))

    def token(result):
        streamed.append(result.new_tokens[len(streamed) :])
        forward.armed = len(result.new_tokens) == stop_at

    engine.scheduler.model = forward
    try:
        engine.submit(request, outcome.append, on_token=token, request_id="stopped")
        while not outcome:
            _step(engine)
    finally:
        engine.scheduler.model = forward.model
    return [t for part in streamed for t in part], outcome[0]


def test_a_stopped_call_loses_the_step_in_flight_as_in_tensorrt_llm(engine):
    request = GenerationRequest(PROMPT, 20, end_id=-1, return_log_probs=True)
    whole = engine.generate(request)
    streamed, last = _streamed(engine, request, stop_at=5)
    assert streamed == whole.new_tokens[:5]  # sent before the stop: the client has them
    assert last.new_tokens == [] and last.output_ids == PROMPT  # the sixth step ran, and its token is gone
    np.testing.assert_allclose(last.log_probs, whole.log_probs[:6], atol=1e-5)  # clearGeneratedTokens keeps these
    engine.scheduler.clear_cancelled = False  # the embedded engine's own way: the step's token comes last
    try:
        streamed, last = _streamed(engine, request, stop_at=5)
    finally:
        engine.scheduler.clear_cancelled = True
    assert streamed == whole.new_tokens[:5] and last.new_tokens == whole.new_tokens[:6]


def test_each_streamed_response_gets_its_own_tokens_log_probs():
    """TensorRT-LLM's responses carry the log probs of every token so far (llmRequest.cpp createResult); a stopped
    call's last one lists the lost step's too, with no token."""
    values = [-0.5, -1.25, -2.0, -0.125]
    responses = [([7], values[:1]), ([8, 9], values[:3]), ([], values)]
    read = StreamedResults()
    got = [
        read(
            {
                "output_ids": np.asarray([[ids]], np.int32).reshape(1, 1, len(ids)),
                "sequence_length": np.asarray([[len(ids)]], np.int32),
                "output_log_probs": np.asarray([[lp]], np.float32),
                "cum_log_probs": np.asarray([[sum(lp)]], np.float32),
            }
        )
        for ids, lp in responses
    ]
    assert [r.new_tokens for r in got] == [[7], [8, 9], []]
    assert [r.log_probs for r in got] == [[-0.5], [-1.25, -2.0], []]


class _StoppingClient:
    """The embedded engine behind the streaming contract, whose streamed calls' steps take `step_seconds`, and where
    `stop_soon` reaches the engine during the next forward pass."""

    def __init__(self, engine, step_seconds: float):
        self.engine, self.step_seconds, self.streams, self.stops = engine, step_seconds, True, 0

    def generate(self, request: GenerationRequest) -> GenerationResult:
        return self.engine.generate(request)

    def stream(self, request: GenerationRequest):
        return _Call(self, request)


class _Call:
    def __init__(self, client, request):
        self.client, self.request, self.id = client, request, f"call-{uuid.uuid4().hex}"
        self.forward = _Forward(
            client.engine.scheduler.model, lambda: client.engine.cancel(self.id), client.step_seconds
        )

    def __iter__(self):
        engine, parts, sent, outcome = self.client.engine, [], [0], []

        def part(result):
            parts.append(GenerationResult(result.new_tokens[sent[0] :], result.new_tokens[sent[0] :]))
            sent[0] = len(result.new_tokens)

        engine.scheduler.model = self.forward
        try:
            engine.submit(self.request, outcome.append, on_token=part, request_id=self.id)
            while not outcome:
                _step(engine)
                while parts:
                    yield parts.pop(0)
        finally:
            engine.scheduler.model = self.forward.model
        part(outcome[0])
        yield from parts

    def stop(self):
        self.client.engine.cancel(self.id)

    def stop_soon(self):
        self.client.stops += 1
        self.forward.armed = True


class _Scripted(Scripted):
    """test_streaming's policy (plain stretches of 5, then drafts of 2), recording the time each iteration costs too."""

    def observe(self, *, num_draft_tokens, tokens, verify_seconds, **_):
        self.observed.append((num_draft_tokens, tokens, verify_seconds))


def _draft_model(client):
    from trtspec.orchestrator.drafters import make_drafter

    return make_drafter("draft_model", client=client, sampling=SpecRequest(PROMPT, 1).sampling, end_id=-1, pad_id=None)


def test_a_stretch_stopped_for_a_draft_loses_a_step_and_the_draft_pays_for_it(engine):
    """The stretch's call is stopped where drafting comes back; its step in flight brings nothing (the loop waits
    for no token), the output is the target's own, and the lost step, one step of the stretch's, is counted and
    charged to the draft."""
    step = 0.2
    whole = engine.generate(GenerationRequest(PROMPT, 40, end_id=-1)).new_tokens
    client = _StoppingClient(engine, step)
    policy, stats = _Scripted(plain=3), RequestStats()
    request = SpecRequest(PROMPT, 40, num_draft_tokens=2, end_id=-1, stream=True)
    tokens = [
        t for chunk in speculate(request, client, _draft_model(client), policy=policy, stats=stats) for t in chunk
    ]
    assert tokens == whole and client.stops == 1
    assert stats.wasted_steps == 1 and stats.finish_reason == "length"
    drafts = [seconds for drafted, _, seconds in policy.observed if drafted]
    assert drafts[0] >= 0.8 * step  # the first draft after the stop carries the lost step (verifying is quick)
    assert all(seconds < step for seconds in drafts[1:])
    plain = [(n, seconds) for drafted, n, seconds in policy.observed if not drafted]
    assert all(seconds < (n + 0.5) * step for n, seconds in plain if n)  # no plain token is charged with it


class _StoppedDrafts:
    """The embedded engine as a draft model whose second call is given up on while in flight: stopped at the
    engine (which then clears its tokens), and the BLS's error for it, as engine_client._bounded raises."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0

    def generate(self, request: GenerationRequest) -> GenerationResult:
        self.calls += 1
        if self.calls != 2:
            return self.engine.generate(request)
        outcome, forward = [], _Forward(self.engine.scheduler.model, lambda: self.engine.cancel("draft"))
        forward.armed = True
        self.engine.scheduler.model = forward
        try:
            self.engine.submit(request, outcome.append, request_id="draft")
            while not outcome:
                _step(self.engine)
        finally:
            self.engine.scheduler.model = forward.model
        assert outcome[0].new_tokens == []  # what the engine answers a stopped unary call: the prompt alone
        raise EngineError("tensorrt_llm_draft: no answer within 50 ms (draft_timeout_ms); stopped it")


def test_a_stopped_draft_call_leaves_the_output_the_targets(engine):
    whole = engine.generate(GenerationRequest(PROMPT, 24, end_id=-1)).new_tokens
    drafts = _StoppedDrafts(engine)
    stats = RequestStats()
    request = SpecRequest(PROMPT, 24, num_draft_tokens=3, end_id=-1)
    failed = []
    chunks = speculate(request, engine, _draft_model(drafts), stats=stats, on_draft_failed=failed.append)
    assert [t for chunk in chunks for t in chunk] == whole
    assert drafts.calls == 2 and len(failed) == 1 and stats.fallbacks.get("draft_error") == 1
