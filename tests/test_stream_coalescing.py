"""Streaming coalescing through the real tritonserver and the OpenAI front, on the embedded engine model paced by the
test's reader (tests/support/paced_engine.py): a reader that takes each message before the next token exists gets one
message per token at every hop; streams side by side give the unstreamed answers however their messages were gathered;
stream_interval holds tokens to that many; a client that leaves the front frees the engine's slot within a step."""

from __future__ import annotations

import http.client
import json
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

BLS = "tensorrt_llm_bls"
PACED_ENGINE = Path(__file__).parent / "support" / "paced_engine.py"
PROMPTS = ["The quick brown fox", "def add(a, b):", "Once upon a time", "1, 2, 3,"]
SERVED = "tiny"


def _write(config, engines, repo, overrides):
    from trtspec.config import load_config
    from trtspec.deploy.writer import write_repository

    repo = write_repository(load_config(config), engines, repo, overrides=overrides)
    shutil.copy(PACED_ENGINE, repo / "tensorrt_llm" / "1" / "model.py")
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from support.tiny import served_pair

    server = served_pair(tmp_path_factory.mktemp("coalescing"), write=_write)
    server.start(timeout=300)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def front(server):
    from trtspec.openai_api.app import Deployment, Front
    from trtspec.server import free_port

    with Front(Deployment(server.http_url, served_model_name=SERVED).connect(), port=free_port()) as running:
        yield running


def _seen_file(server) -> Path:
    return server.repo / "tensorrt_llm" / "1" / "SEEN"  # paced_engine.SEEN


def _ids(value) -> list[int]:
    return [int(t) for t in np.asarray(value if value is not None else []).reshape(-1)]


def _events(base: str, fields: dict, on_event=None) -> list[dict]:
    """generate_stream's events, read one at a time as they come; `on_event(event)` after each."""
    req = urllib.request.Request(
        f"{base}/v2/models/{BLS}/generate_stream",
        data=json.dumps(fields).encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            assert "error" not in event, event["error"]
            events.append(event)
            if on_event is not None:
                on_event(event)
    return events


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else value


def _unary(base: str, fields: dict) -> dict:
    req = urllib.request.Request(
        f"{base}/v2/models/{BLS}/generate",
        data=json.dumps(fields).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _metric(server, name: str, **labels) -> float:
    """The sum of a metric's series whose labels include `labels`."""
    time.sleep(0.6)  # the engine model reports every 0.25 s (engine_model.REPORT_SECONDS)
    with urllib.request.urlopen(server.metrics_url, timeout=30) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{"):
            head, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


def test_a_reader_that_keeps_up_gets_one_message_per_token_from_the_engine_and_the_bls(server):
    fields = {"text_input": PROMPTS[0], "max_tokens": 30, "end_id": -1, "num_draft_tokens": 0}
    whole = _ids(_unary(server.http_base_url, fields)["output_ids"])
    bls = _metric(server, "trtspec_stream_messages_total", hop="bls")
    seen, path = [0], _seen_file(server)

    def took(event):  # the reader has the tokens: the engine may choose the next one
        seen[0] += len(_ids(event.get("output_ids")))
        path.write_text(str(seen[0]))

    path.write_text("0")
    try:
        events = _events(server.http_base_url, fields | {"stream": True}, took)
    finally:
        path.unlink(missing_ok=True)
    carrying = [_ids(e.get("output_ids")) for e in events if _ids(e.get("output_ids"))]
    assert [t for ids in carrying for t in ids] == whole and len(whole) == 30
    assert all(len(ids) == 1 for ids in carrying), [len(ids) for ids in carrying]
    # the BLS's responses: one per token and its final one (the engine model sends one per step, as TensorRT-LLM's
    # backend does, and counts none)
    assert _metric(server, "trtspec_stream_messages_total", hop="bls") - bls == 31


def test_streams_side_by_side_give_the_unstreamed_answers(server, front):
    """Eight streams at once through the BLS and eight through the front, however each hop gathered their tokens."""
    fields = [
        {"text_input": p, "max_tokens": 48, "end_id": -1, "num_draft_tokens": 0} for p in PROMPTS for _ in range(2)
    ]
    answers = [_unary(server.http_base_url, f | {"exclude_input_in_output": True}) for f in fields]
    whole = [_ids(a["output_ids"]) for a in answers]
    texts = [_text(a["text_output"]) for a in answers]

    def bls(f):
        events = _events(server.http_base_url, f | {"stream": True})
        return [t for e in events for t in _ids(e.get("output_ids"))], len(events)

    def openai(f):
        return _front_stream(front.url, f["text_input"], f["max_tokens"])

    with ThreadPoolExecutor(8) as pool:
        streamed = list(pool.map(bls, fields))
        fronted = list(pool.map(openai, fields))
    assert [ids for ids, _ in streamed] == whole
    assert all(n <= 49 for _, n in streamed)  # never more messages than tokens (and the final one)
    assert [text for text, _ in fronted] == texts
    assert all(n <= 48 for _, n in fronted)


def test_streams_that_end_together_are_all_counted_and_the_server_lives(server):
    """Every stream adds to the same two counters as it ends, each add a message to the server whose Metric memory
    Triton 2.51's Python backend rewrites with the GIL released: without one lock over the process's metric calls
    (trtspec.triton.common.METRIC_CALLS), streams ending together killed tritonserver (SIGSEGV in
    PbString::LoadFromSharedMemory). Forty-eight short streams, sixteen at a time."""
    messages = _metric(server, "trtspec_stream_messages_total", hop="bls")
    tokens = _metric(server, "trtspec_stream_tokens_total", hop="bls")
    fields = [
        {"text_input": PROMPTS[i % len(PROMPTS)], "max_tokens": 2, "end_id": -1, "num_draft_tokens": 0, "stream": True}
        for i in range(48)
    ]
    with ThreadPoolExecutor(16) as pool:
        streams = list(pool.map(lambda f: _events(server.http_base_url, f), fields))
    assert server.is_running()
    assert [len([t for e in events for t in _ids(e.get("output_ids"))]) for events in streams] == [2] * 48
    assert _metric(server, "trtspec_stream_messages_total", hop="bls") - messages == sum(map(len, streams))
    assert _metric(server, "trtspec_stream_tokens_total", hop="bls") - tokens == 96


def _front_stream(url: str, prompt: str, max_tokens: int, stream_interval: int | None = None) -> tuple[str, int]:
    """(text, content events) of one streamed completion from the front."""
    body = {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body |= {"ignore_eos": True, "num_draft_tokens": 0}
    if stream_interval is not None:
        body["stream_interval"] = stream_interval
    conn = http.client.HTTPConnection(url.split("//")[1].split(":")[0], int(url.rsplit(":", 1)[1]), timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        text, events = [], 0
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event.get("choices", []):
                if choice.get("text"):
                    text.append(choice["text"])
                    events += 1
        return "".join(text), events
    finally:
        conn.close()


def test_a_client_that_leaves_the_front_frees_the_engine_slot_within_a_step(server, front):
    """The engine may choose three tokens and is held at its fourth until the call is stopped; the client leaves as
    soon as the stream has begun: the stop frees the slot with those four tokens and not one step more."""
    tokens = _metric(server, "trtspec_engine_tokens_total", model="tensorrt_llm")
    path = _seen_file(server)
    body = {"model": SERVED, "prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0, "stream": True}
    body |= {"ignore_eos": True, "num_draft_tokens": 0}
    path.write_text("3")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", int(front.url.rsplit(":", 1)[1]), timeout=300)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        assert conn.getresponse().status == 200  # the front answers once the first token has come
        conn.sock.shutdown(2)  # the client leaves
        conn.close()
        deadline = time.monotonic() + 120
        while _metric(server, "trtspec_engine_running_calls", model="tensorrt_llm") > 0:
            assert time.monotonic() < deadline, "the engine call went on after the client left"
    finally:
        path.unlink(missing_ok=True)
    spent = _metric(server, "trtspec_engine_tokens_total", model="tensorrt_llm") - tokens
    assert spent == 4, f"the stopped call generated {spent} tokens; it was held at its fourth"


def test_stream_interval_sends_that_many_tokens_a_message_the_first_at_once(server, front):
    fields = {"text_input": PROMPTS[2], "max_tokens": 30, "end_id": -1, "num_draft_tokens": 0}
    whole = _ids(_unary(server.http_base_url, fields)["output_ids"])
    # the engine chooses its second token only once the reader has the first (then runs free): however the hops after
    # it gather what they read, the first message can carry the first token alone
    path = _seen_file(server)
    path.write_text("1")
    try:
        events = _events(
            server.http_base_url,
            fields | {"stream": True, "stream_interval": 4},
            on_event=lambda _: path.write_text("1000"),
        )
    finally:
        path.unlink(missing_ok=True)
    sizes = [len(_ids(e.get("output_ids"))) for e in events]
    assert [t for e in events for t in _ids(e.get("output_ids"))] == whole
    assert sizes[0] == 1  # the first token at once
    assert all(n >= 4 for n in sizes[1:-1]), sizes  # then at least four a message (more where the reader was behind)
    # through the front, which passes it on
    text, content_events = _front_stream(front.url, PROMPTS[2], 30, stream_interval=4)
    plain, _ = _front_stream(front.url, PROMPTS[2], 30)
    assert text == plain and content_events <= 1 + -(-29 // 4)


def test_a_stream_interval_that_is_not_a_count_is_refused_naming_it(server, front):
    req = urllib.request.Request(
        f"{server.http_base_url}/v2/models/{BLS}/generate",
        data=json.dumps({"text_input": PROMPTS[0], "max_tokens": 4, "stream_interval": -1}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=120)
    assert "stream_interval" in refused.value.read().decode()
    body = {"model": SERVED, "prompt": PROMPTS[0], "max_tokens": 4, "stream": True, "stream_interval": -2}
    conn = http.client.HTTPConnection("127.0.0.1", int(front.url.rsplit(":", 1)[1]), timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        error = json.loads(resp.read())["error"]
        assert resp.status == 400 and error["param"] == "stream_interval", error
    finally:
        conn.close()
    assert _ids(_unary(server.http_base_url, {"text_input": PROMPTS[0], "max_tokens": 4})["output_ids"])  # serving
