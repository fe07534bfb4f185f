"""Streaming without a queue of messages (trtspec.stream_sender), without a server: a reader that keeps up gets one
message per token, a reader held back by the test gets everything produced meanwhile in its next message, in order
and exactly once; stream_interval holds tokens to that many, the first and the final going at once; coalesced engine
responses run through the real loop and engine give the unstreamed tokens, stop words cut across them; multi-byte
characters split across tokens come out whole however the tokens are grouped; the front's SSE framing."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from trtspec.contract import GenerationRequest, GenerationResult
from trtspec.errors import RequestError
from trtspec.orchestrator.loop import SpecRequest, speculate
from trtspec.stream_sender import Coalescer, Held, HopCounts, check_interval, due, merge_results

PROMPT = [5, 17, 42, 99, 7]


def test_the_rule_sends_the_first_and_the_final_at_once_and_holds_only_for_an_interval():
    assert due(0, 0, 1, False) and due(0, 5, 1, False)  # every token, with no interval
    assert not due(0, 0, 0, False)  # nothing to send
    assert due(4, 0, 1, False)  # the first token at once
    assert not due(4, 1, 3, False) and due(4, 1, 4, False)
    assert due(4, 3, 0, True)  # the final message always
    assert check_interval(0) == 0 and check_interval(8) == 8
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(RequestError, match="stream_interval"):
            check_interval(bad)


class Recorder:
    """A send that records each message's tokens (the state is the stream's whole output so far) and can be held
    inside a send by the test: the slow reader."""

    def __init__(self):
        self.messages: list[tuple[list[int], bool]] = []
        self.sent = 0
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Semaphore(0)

    def __call__(self, state: list[int], final: bool) -> int:
        self.entered.release()
        assert self.gate.wait(60)
        new = state[self.sent :]
        self.sent = len(state)
        self.messages.append((new, final))
        return len(new)


def test_a_reader_that_keeps_up_gets_one_message_per_token():
    send, counts = Recorder(), HopCounts()
    with ThreadPoolExecutor(2) as senders:
        out = Coalescer(send, senders, counts=counts)
        tokens = []
        for t in range(20):
            tokens.append(t)
            out.offer(list(tokens), 1)
            assert out.wait(60)  # the message was taken before the next token
        out.offer(list(tokens), 0, final=True)
        assert out.wait(60)
    assert send.messages == [([t], False) for t in range(20)] + [([], True)]
    assert (counts.messages, counts.tokens) == (21, 20)


def test_a_slow_reader_gets_every_token_produced_meanwhile_in_one_message():
    send, counts = Recorder(), HopCounts()
    with ThreadPoolExecutor(2) as senders:
        out = Coalescer(send, senders, counts=counts)
        send.gate.clear()  # the reader is behind: the first send does not return until the test says so
        tokens = [0]
        out.offer(list(tokens), 1)
        assert send.entered.acquire(timeout=60)  # the first token went at once, and its send is held
        for t in range(1, 12):
            tokens.append(t)
            out.offer(list(tokens), 1)
        out.offer(list(tokens), 0, final=True)  # the call ends while the reader is still behind
        send.gate.set()
        assert out.wait(60)
    # one message for the first token, one for the eleven produced while it was being taken, final included
    assert send.messages == [([0], False), (list(range(1, 12)), True)]
    assert (counts.messages, counts.tokens) == (2, 12)
    out.offer([99], 1)  # nothing follows the final message
    assert len(send.messages) == 2


def test_stream_interval_holds_tokens_to_that_many_the_first_and_the_final_at_once():
    send = Recorder()
    out = Coalescer(send, None, interval=4)  # on the producer's thread: deterministic
    tokens = []
    for t in range(10):
        tokens.append(t)
        out.offer(list(tokens), 1)
    out.offer(list(tokens), 0, final=True)
    assert send.messages == [([0], False), ([1, 2, 3, 4], False), ([5, 6, 7, 8], False), ([9], True)]


def test_without_sender_threads_every_token_is_its_own_message():
    """TensorRT-LLM's backend (and the stand-in): a response per step, however slow the reader."""
    send = Recorder()
    out = Coalescer(send, None)
    for t in range(5):
        out.offer(list(range(t + 1)), 1)
    out.offer(list(range(5)), 0, final=True)
    assert send.messages == [([t], False) for t in range(5)] + [([], True)]


def test_a_failed_send_is_reported_and_the_final_message_still_goes():
    failures, sent = [], []

    def send(state, final):
        if not final:
            raise RuntimeError("the client left")
        sent.append(state)
        return 0

    out = Coalescer(send, None, on_error=failures.append)
    out.offer([1], 1)
    out.offer([1], 0, final=True)
    assert [str(f) for f in failures] == ["the client left"] and sent == [[1]]


def test_held_gives_text_and_ids_together_at_the_interval():
    counts = HopCounts()
    held = Held(3, counts)
    got = [held.push([t], f"<{t}>") for t in range(7)]
    assert got[0] == ([0], "<0>")  # the first token at once
    assert got[1] is None and got[2] is None and got[3] == ([1, 2, 3], "<1><2><3>")
    assert got[4] is None and got[5] is None and got[6] == ([4, 5, 6], "<4><5><6>")
    held.push([7], "<7>")
    assert held.take() == ([7], "<7>")  # the final message carries what is held
    assert (counts.messages, counts.tokens) == (4, 8)
    assert [Held(0).push([t], "x") for t in range(3)] == [([t], "x") for t in range(3)]  # no interval: nothing held


def test_merged_responses_keep_tokens_logits_and_log_probs_in_order():
    parts = [
        GenerationResult([1, 2], [1, 2], np.ones((2, 3), np.float32), log_probs=[-0.1, -0.2], kv_blocks=(1, 0, 1)),
        GenerationResult([3], [3], np.full((1, 3), 2, np.float32), log_probs=[-0.3], kv_blocks=(1, 0, 2)),
        GenerationResult([], [], None, log_probs=[], kv_blocks=(1, 0, 2)),  # a stopped call's empty last response
    ]
    merged = merge_results(parts)
    assert merged.new_tokens == [1, 2, 3] and merged.output_ids == [1, 2, 3]
    assert merged.log_probs == [-0.1, -0.2, -0.3]
    assert merged.generation_logits.tolist() == [[1, 1, 1], [1, 1, 1], [2, 2, 2]]
    assert merged.kv_blocks == (1, 0, 2)  # running totals: the last response's
    assert merge_results(parts[:1]) is parts[0]


# ---- coalesced engine responses through the real loop and engine -------------------------------------------


@pytest.fixture(scope="module")
def engine(built_none):
    from trtspec.engine.runtime import Engine

    return Engine.load(built_none.target)


class GroupedClient:
    """The embedded engine behind the streaming contract, its per-step parts handed to the loop `group` at a time
    as the BLS's engine client hands over every response that came while it was sending (merge_results): the slow
    reader, forced."""

    streams = True

    def __init__(self, engine, group: int):
        self.engine, self.group = engine, group

    def generate(self, request: GenerationRequest) -> GenerationResult:
        return self.engine.generate(request)

    def stream(self, request: GenerationRequest):
        return _GroupedParts(self, request)


class _GroupedParts:
    def __init__(self, client, request):
        self.client, self.request = client, request
        self.job_id = f"grouped-{id(self)}"

    def __iter__(self):
        parts, sent, outcome = [], [0], []

        def part(result):
            parts.append(GenerationResult(result.new_tokens[sent[0] :], result.new_tokens[sent[0] :]))
            sent[0] = len(result.new_tokens)

        engine = self.client.engine
        engine.submit(self.request, outcome.append, on_token=part, request_id=self.job_id)
        while not outcome:
            engine.scheduler.step()
            if len(parts) >= self.client.group:
                batch, parts[:] = parts[: self.client.group], parts[self.client.group :]
                yield merge_results(batch)
        part(outcome[0])
        while parts:
            batch, parts[:] = parts[: self.client.group], parts[self.client.group :]
            yield merge_results(batch)

    def stop(self):
        self.client.engine.cancel(self.job_id)

    stop_soon = stop


def _generate(client, **kw):
    chunks = list(speculate(SpecRequest(PROMPT, 30, end_id=-1, **kw), client, None))
    return [t for c in chunks for t in c], chunks


@pytest.mark.parametrize("group", [2, 3, 7])
def test_coalesced_responses_give_the_unstreamed_tokens(engine, group):
    whole, _ = _generate(GroupedClient(engine, 1))
    streamed, chunks = _generate(GroupedClient(engine, group), stream=True)
    assert streamed == whole and len(whole) == 30
    assert max(len(c) for c in chunks) > 1  # coalesced indeed


@pytest.mark.parametrize("group", [3, 5])
def test_a_stop_word_across_a_coalesced_message_cuts_the_answer_at_the_word(engine, group):
    whole, _ = _generate(GroupedClient(engine, 1))
    # a two-token word whose tokens fall in two different coalesced messages, first at its end
    start = next(
        i for i in range(4, len(whole) - 1) if (i + 1) % group == 0 and whole[i : i + 2] not in _pairs(whole, i)
    )
    word = whole[start : start + 2]
    streamed, _ = _generate(GroupedClient(engine, group), stream=True, stop_words=[word])
    unstreamed, _ = _generate(GroupedClient(engine, 1), stop_words=[word])
    assert streamed == unstreamed == whole[: start + 2]


def _pairs(tokens: list[int], before: int) -> list[list[int]]:
    return [tokens[j : j + 2] for j in range(before)]


def test_multi_byte_characters_split_across_tokens_come_out_whole_however_grouped(tmp_path):
    from support.tiny import make_tokenizer

    from trtspec.orchestrator.detok import IncrementalDetokenizer

    text = "naïve café — 中文字符 and 🙂🚀 emoji, ok"
    tok = make_tokenizer(tmp_path, corpus=["plain ascii words only"] * 4)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    split = [t for t in ids if "\ufffd" in tok.decode([t])]
    assert split, "the test needs characters that span tokens"
    for group in (1, 2, 3, 5, len(ids)):
        detok = IncrementalDetokenizer(tok)
        pieces = [detok.push(ids[i : i + group]) for i in range(0, len(ids), group)] + [detok.flush()]
        assert "".join(pieces) == text, group
        assert not any("\ufffd" in p for p in pieces), group


def test_the_front_frames_a_text_chunk_as_the_chunk_object_would_be():
    from trtspec.generation import Chunk
    from trtspec.openai_api.app import _sse, text_events
    from trtspec.openai_api.protocol import CHAT, COMPLETION, Request
    from trtspec.openai_api.responses import Chunks
    from trtspec.openai_api.upstream import merged

    for kind in (CHAT, COMPLETION):
        for usage in (False, True):
            req = Request(kind=kind, model="m", include_usage=usage)
            chunks = Chunks(req, "served/model")
            event = text_events(chunks)
            for text in ("a", 'quote " and \\ back', "中文 🙂", "\x00", "line\nbreak"):
                assert event(text) == _sse(chunks.text(text))
                assert json.loads(event(text)[6:])["choices"][0]
    parts = [Chunk(0.1, "ab", [1, 2]), Chunk(0.2, "", []), Chunk(0.3, "c", [3])]
    assert merged(parts) == Chunk(0.3, "abc", [1, 2, 3])
