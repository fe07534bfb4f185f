"""The client and `validate outputs` without a Triton server: parsing, comparison, classification, and the HTTP
generate path against a small stand-in for Triton's generate extension (standard library server)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from click.testing import CliRunner

from trtspec.client import ClientError, SpecClient, _sse_events, parse_prometheus, split_url
from trtspec.generation import request_fields
from trtspec.validate import (
    DEFAULT_PROMPTS,
    MISMATCH,
    NEAR_TIE,
    Difference,
    KResult,
    Report,
    ValidationError,
    classify,
    compare_tokens,
    load_prompts,
    parse_ks,
)

# ---- compare_tokens ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([], [], None),
        ([1, 2, 3], [1, 9, 3], 1),
        ([5], [6], 0),
        ([1, 2, 3], [1, 2], 2),  # one output ended earlier: they differ where it ends
        ([1, 2], [1, 2, 3], 2),
        ([], [7], 0),
    ],
)
def test_compare_tokens(a, b, expected):
    assert compare_tokens(a, b) == expected


# ---- classify -----------------------------------------------------------------------------------------------------


def test_classify_near_tie_and_mismatch():
    logits = np.array([10.0, 9.95, 2.0, -30.0], dtype=np.float32)
    tie = classify(logits, expected=0, got=1, tolerance=1e-2)  # gap 0.05 <= 0.01 * 30
    assert tie.kind == NEAR_TIE and tie.consistent and tie.argmax == 0
    assert tie.allowed == pytest.approx(0.3)
    assert tie.gap == pytest.approx(0.05, abs=1e-5)
    real = classify(logits, expected=0, got=2, tolerance=1e-2)
    assert real.kind == MISMATCH and real.gap == pytest.approx(8.0)


def test_classify_scale_is_at_least_one():
    logits = np.array([0.01, 0.005, 0.0])
    assert classify(logits, 0, 1, tolerance=1e-2).allowed == pytest.approx(1e-2)
    assert classify(logits, 0, 1, tolerance=1e-2).kind == NEAR_TIE


def test_classify_flags_logits_that_disagree_with_the_target_output():
    # The target-only run chose token 2, but the logits (wrong prompt ids?) favour 0 by far.
    verdict = classify(np.array([5.0, 4.99, 1.0]), expected=2, got=1)
    assert verdict.kind == MISMATCH and not verdict.consistent and "tokenization" in verdict.note


def test_classify_missing_token():
    verdict = classify(np.array([1.0, 0.0]), expected=0, got=None)
    assert verdict.kind == MISMATCH and verdict.gap == float("inf")


def test_report_passes_only_without_differences_or_errors():
    def report(*kinds, errors=()):
        result = KResult(4, runs=3, matches=3 - len(kinds), errors=list(errors))
        for kind in kinds:
            d = Difference(0, 4, 1, 1, 2)
            if kind == NEAR_TIE:
                d.verdict = classify(np.array([1.0, 1.0]), 0, 1)
            result.differences.append(d)
        return Report(["p"], 8, 1e-2, [result])

    assert report().passed()
    assert not report(NEAR_TIE).passed() and report(NEAR_TIE).passed(allow_near_ties=True)
    assert not report(MISMATCH).passed(allow_near_ties=True)  # no verdict counts as a mismatch
    assert not report(errors=["prompt 1: boom"]).passed(allow_near_ties=True)


# ---- prompts and options --------------------------------------------------------------------------------------------


def test_load_prompts_plain_text(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("first prompt\n\n  indented  stays\r\nlast")
    assert load_prompts(path) == ["first prompt", "  indented  stays", "last"]


def test_load_prompts_jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a\\nb"}\n\n{"prompt": "c", "id": 2}\n')
    assert load_prompts(path) == ["a\nb", "c"]


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"prompt": "a"}\nnot json\n', ":2: not a JSON object"),
        ('{"prompt": "a"}\n{"text": "b"}\n', ':2: expected an object with a non-empty string "prompt"'),
        ("\n  \n", "has no prompts"),
    ],
)
def test_load_prompts_errors(tmp_path, text, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValidationError, match=message):
        load_prompts(path)


def test_load_prompts_missing_file(tmp_path):
    with pytest.raises(ValidationError, match="cannot read"):
        load_prompts(tmp_path / "nope.txt")


def test_default_prompts():
    assert len(DEFAULT_PROMPTS) == 8 and len(set(DEFAULT_PROMPTS)) == 8


def test_parse_ks():
    assert parse_ks("1,4,8") == [1, 4, 8]
    assert parse_ks(" 4, 1 ,4,") == [4, 1]
    for bad in ("0", "a", "", "1,-2"):
        with pytest.raises(ValidationError):
            parse_ks(bad)


# ---- Prometheus -----------------------------------------------------------------------------------------------------

METRICS = """\
# HELP trtspec_draft_tokens_total Draft tokens proposed to the target
# TYPE trtspec_draft_tokens_total counter
trtspec_draft_tokens_total{model="tensorrt_llm_bls"} 60
trtspec_accepted_tokens_by_position_total{position="0",model="tensorrt_llm_bls"} 10
trtspec_accepted_tokens_by_position_total{model="tensorrt_llm_bls",position="1"} 4.5
trtspec_requests_total{mode="plain",model="b"} 2 1712345678000
trtspec_requests_total{model="b",mode="speculative"} 3
trtspec_weird{note="a \\"quoted\\", value"} 1
trtspec_bare 7
nv_inference_count{model="tensorrt_llm_bls",version="1"} 9
trtspec_nan NaN
"""


def test_parse_prometheus_sums_and_keeps_label_sets():
    m = parse_prometheus(METRICS)
    assert m["trtspec_draft_tokens_total"] == 60
    assert m['trtspec_draft_tokens_total{model="tensorrt_llm_bls"}'] == 60
    assert m["trtspec_accepted_tokens_by_position_total"] == 14.5
    # labels are keyed in name order, whatever order the server wrote them in
    assert m['trtspec_accepted_tokens_by_position_total{model="tensorrt_llm_bls",position="0"}'] == 10
    assert m['trtspec_accepted_tokens_by_position_total{model="tensorrt_llm_bls",position="1"}'] == 4.5
    assert m["trtspec_requests_total"] == 5
    assert m['trtspec_requests_total{mode="plain",model="b"}'] == 2  # the timestamp is not the value
    assert m['trtspec_weird{note="a \\"quoted\\", value"}'] == 1
    assert m["trtspec_bare"] == 7
    assert "nv_inference_count" not in m
    assert np.isnan(m["trtspec_nan"])
    assert parse_prometheus(METRICS, prefix="nv_")["nv_inference_count"] == 9


# ---- request fields, URLs, SSE -------------------------------------------------------------------------------------


def test_request_fields_leave_out_defaults():
    fields = request_fields("hi", max_tokens=5, num_draft_tokens=0, stop_words=["x"])
    assert fields == {
        "text_input": "hi",
        "max_tokens": 5,
        "num_draft_tokens": 0,
        "stop_words": ["x"],
        "return_perf_metrics": True,
        "stream": False,
        "exclude_input_in_output": True,
    }


@pytest.mark.parametrize(
    "url, expected",
    [
        ("127.0.0.1:9000", ("http", "127.0.0.1", 9000)),
        ("http://localhost:9000/", ("http", "localhost", 9000)),
        ("localhost", ("http", "localhost", 8000)),
        ("[::1]:9000", ("http", "::1", 9000)),
        ("grpc://h:1", ("grpc", "h", 1)),
    ],
)
def test_split_url(url, expected):
    assert split_url(url, 8000) == expected


def test_bad_protocol():
    with pytest.raises(ClientError, match="protocol"):
        SpecClient("127.0.0.1:1", protocol="ftp")


class _Lines:
    def __init__(self, text: str):
        self.lines = [line.encode() for line in text.splitlines(keepends=True)]

    def readline(self):
        return self.lines.pop(0) if self.lines else b""


def test_sse_events():
    text = 'data: {"a": 1}\n\n: comment\ndata: {"b":\ndata: 2}\r\n\r\ndata: {"c": 3}'
    assert list(_sse_events(_Lines(text))) == ['{"a": 1}', '{"b":\n2}', '{"c": 3}']


# ---- the HTTP generate path against a stand-in for Triton's generate extension -------------------------------------


class _FakeTriton(BaseHTTPRequestHandler):
    requests: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, body))
        if body.get("max_tokens", 0) > 100:
            return self._send(400, {"error": "max_tokens: must be between 1 and 100"})
        perf = {
            "acceptance_rate": 0.5,
            "total_accepted_draft_tokens": 2,
            "total_draft_tokens": 4,
            "num_iterations": 3,
            "draft_time_ms": 1.5,
            "verify_time_ms": 2.5,
            "accepted_per_position": [2, 0],
            "drafted_per_position": [2, 2],
            "finish_reason": "length",
        }
        if self.path.endswith("/generate"):
            return self._send(200, {"model_name": "m", "text_output": "abc", "output_ids": [1, 2, 3], **perf})
        if body["text_input"] == "bad":  # Triton answers a first-response error with 400 and the error as an event
            raw = b'data: {"error":"m: temperature: must be >= 0"}\n\n'
            self.send_response(400)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            return self.wfile.write(raw)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        events = [
            {"text_output": "a", "output_ids": [1]},
            {"text_output": "bc", "output_ids": [2, 3]},
            {"text_output": "", "output_ids": [], **perf},
        ]
        if body["text_input"] == "fail":
            events[1] = {"error": "engine exploded"}
        for i, event in enumerate(events):
            if body["text_input"] == "slow" and i == 1:
                self.release.wait(60)  # held until the test ends: only stop_after_s can end the request
            try:
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
            except OSError:  # the client went away
                return

    def _send(self, status, obj):
        raw = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeTriton)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _FakeTriton.requests = []
    _FakeTriton.release = threading.Event()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        _FakeTriton.release.set()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("stream", [False, True])
def test_http_generate(fake_server, stream):
    chunks = []
    with SpecClient(fake_server, protocol="http", model="m") as client:
        result = client.generate("hi", max_tokens=3, num_draft_tokens=2, seed=7, stream=stream, on_chunk=chunks.append)
    path, body = _FakeTriton.requests[-1]
    assert path == "/v2/models/m/generate" + ("_stream" if stream else "")
    assert body["seed"] == 7 and body["num_draft_tokens"] == 2 and body["stream"] is stream
    assert result.text == "abc" and result.token_ids == [1, 2, 3]
    assert [c.token_ids for c in chunks] == ([[1], [2, 3]] if stream else [[1, 2, 3]])
    assert result.chunks == chunks
    assert (result.acceptance_rate, result.accepted_draft_tokens, result.draft_tokens, result.iterations) == (
        0.5,
        2,
        4,
        3,
    )
    assert (result.draft_ms, result.verify_ms, result.finish_reason) == (1.5, 2.5, "length")
    assert result.accepted_per_position == [2, 0] and result.position_acceptance() == [1.0, 0.0]
    assert 0 <= result.time_to_first_token <= result.seconds
    assert result.tokens_per_second > 0


def test_http_generate_errors_carry_the_server_message(fake_server):
    with SpecClient(fake_server, protocol="http", model="m") as client:
        with pytest.raises(ClientError, match="max_tokens: must be between 1 and 100"):
            client.generate("hi", max_tokens=1000)
        with pytest.raises(ClientError, match="engine exploded"):
            client.generate("fail", max_tokens=3, stream=True)
        with pytest.raises(ClientError, match=r"^m \(http [^)]*\): temperature: must be >= 0$"):
            client.generate("bad", max_tokens=3, stream=True)


def test_http_stop_after_s_returns_what_arrived(fake_server):
    with SpecClient(fake_server, protocol="http", model="m") as client:
        # generous for a loaded machine: the first event must arrive before it
        result = client.generate("slow", max_tokens=3, stream=True, stop_after_s=5.0)
    assert result.finish_reason == "cancelled" and result.token_ids == [1] and result.text == "a"


def test_unreachable_server():
    with SpecClient("127.0.0.1:1", protocol="http", timeout=5) as client:
        with pytest.raises(ClientError, match="refused"):
            client.generate("hi", max_tokens=3)


# ---- CLI wiring -----------------------------------------------------------------------------------------------------


def test_cli_commands_exist():
    from trtspec.cli import cli

    runner = CliRunner()
    assert runner.invoke(cli, ["generate", "--help"]).exit_code == 0
    out = runner.invoke(cli, ["validate", "--help"])
    assert out.exit_code == 0 and "outputs" in out.output
    assert runner.invoke(cli, ["validate", "outputs", "--help"]).exit_code == 0


def test_cli_generate_against_fake_server(fake_server):
    from trtspec.cli import cli

    out = CliRunner().invoke(cli, ["generate", "hi", "--url", fake_server, "--stream", "--max-tokens", "3"])
    assert out.exit_code == 0, out.output
    assert out.output.startswith("abc\n")


# ---- run_validation with a stand-in client ---------------------------------------------------------------------------


class _FakeSpecClient:
    """Target-only output 10, 11, 12, 13; K=2 agrees; K=3 swaps position 2 for a near-tie; K=4 for a far token."""

    model = "tensorrt_llm_bls"

    def __init__(self):
        self.logit_requests = []

    def generate(self, prompt, *, max_tokens, num_draft_tokens, adaptive_draft_length=None, **_):
        assert num_draft_tokens == 0 or adaptive_draft_length is False  # K drafted every iteration (fixed_k)
        from trtspec.generation import Completion

        ids = [10, 11, 12, 13][:max_tokens]
        if num_draft_tokens == 3:
            ids[2] = 20
        elif num_draft_tokens == 4:
            ids[2] = 30
        return Completion(
            text="",
            token_ids=ids,
            seconds=0.5,
            accepted_draft_tokens=num_draft_tokens,
            draft_tokens=2 * num_draft_tokens,
        )

    def tokenize(self, text):
        return [1, 2], 0

    def detokenize(self, ids):
        return f"<{ids[0]}>"

    def engine_logits(self, sequence_ids, model="tensorrt_llm"):
        self.logit_requests.append(list(sequence_ids))
        z = np.zeros(40, dtype=np.float32)
        z[12], z[20], z[30] = 20.0, 19.9, 5.0
        return z


def test_run_validation_classifies_differences():
    from rich.console import Console

    from trtspec.validate import Tokens, render_report, run_validation

    client = _FakeSpecClient()
    report = run_validation(client, ["p"], [2, 3, 4], max_tokens=4, tokens=Tokens(client))
    by_k = {r.k: r for r in report.results}
    assert by_k[2].matches == 1 and not by_k[2].differences
    assert by_k[2].acceptance == 0.5 and by_k[2].tokens_per_second == 8.0
    (tie,) = by_k[3].differences
    assert (tie.position, tie.expected, tie.got, tie.kind) == (2, 12, 20, NEAR_TIE)
    assert tie.expected_text == "'<12>' (12)"
    (far,) = by_k[4].differences
    assert far.kind == MISMATCH and far.verdict.gap == pytest.approx(15.0)
    assert client.logit_requests == [[1, 2, 10, 11], [1, 2, 10, 11]]  # prompt ids + the common prefix
    assert not report.passed(allow_near_ties=True)
    console = Console(record=True, width=160)
    render_report(report, console)
    text = console.export_text()
    assert "near-tie" in text and "mismatch" in text and "FAIL" in text
