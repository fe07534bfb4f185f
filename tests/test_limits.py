"""What one request may ask of the BLS, and what the Triton edge tells a client when something fails.

First the rules on their own (trtspec.request_limits, the engine's bad-words index), then each refusal against the
real tritonserver serving a deployment written by `trtspec deploy`: an INVALID_ARG (HTTP 400) naming the field and
the limit, after which the server serves a normal request. The deployment keeps deploy's defaults but for the
deadline and the logits bound, lowered so that a tiny model reaches them.
"""

from __future__ import annotations

import json
import math
import queue
import random
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from test_serving import BLS, BLS_TYPES, grpc_generate, ids_of
from tritonclient.utils import InferenceServerException

from trtspec.contract import Penalties, SamplingParams
from trtspec.engine.sampling import Rules, prepare
from trtspec.errors import RequestError
from trtspec.request_limits import check_prompt_chars, check_returned_logits, check_words, deadline_ms, finite, utf8
from trtspec.serving_settings import ServingSettings

SETTINGS = ServingSettings.from_parameters({"tokenizer_dir": "/t", "max_input_len": "128", "max_seq_len": "256"})
VOCAB = 320  # the tiny tokenizer's (tests/support/tiny.py)
REQUEST_TIMEOUT_MS = 1000  # the served deployment's request_timeout_ms
# The deadline test's own deployment: a plain answer of LONG_ANSWER tokens takes the tiny model 0.6-2.1 s on the
# 2-core test machines (quiet to busy), so it outlasts DEADLINE_MS (and SHORT_MS) however fast the machine is, and a
# busy machine only makes it longer; no other request goes to that deployment.
DEADLINE_MS, SHORT_MS = 250, 50
LONG_ANSWER = 2000
MAX_INPUT_LEN = 1024  # the served deployment's: max_seq_len 2048, room for LONG_ANSWER
LOGITS_ROWS = 8  # the served deployment returns the logits of at most this many tokens
PROMPT = "The quick brown fox"

# ---- the rules ---------------------------------------------------------------------------------------------------


def test_a_client_can_shorten_the_deadline_but_not_lift_it():
    assert deadline_ms(0, 600_000) == (600_000, True)  # none named: the deployment's
    assert deadline_ms(0, 0) == (0, True)  # a deployment without a limit
    assert deadline_ms(10**9, 600_000) == (600_000, True)  # more than the deployment's is the deployment's
    assert deadline_ms(250, 600_000) == (250, False)
    assert deadline_ms(250, 0) == (250, False)
    with pytest.raises(RequestError, match=r"^timeout_ms: must be >= 0"):
        deadline_ms(-1, 600_000)


def test_words_are_bounded_in_number_and_length_before_tokenizing():
    check_words("stop_words", ["x"] * SETTINGS.max_stop_words, SETTINGS)
    check_words("bad_words", ["y" * SETTINGS.max_word_chars], SETTINGS)
    with pytest.raises(RequestError, match=r"^stop_words: 65 words; this deployment takes at most 64 \(max_stop_words"):
        check_words("stop_words", ["x"] * 65, SETTINGS)
    with pytest.raises(RequestError, match=r"^bad_words: 65 words; .* at most 64 \(max_bad_words\)"):
        check_words("bad_words", ["x"] * 65, SETTINGS)
    with pytest.raises(RequestError, match=r"^bad_words: a word of 257 characters; .* 256 \(max_word_chars\)"):
        check_words("bad_words", ["ok", "z" * 257], SETTINGS)


def test_a_prompt_is_bounded_in_characters():
    assert SETTINGS.max_input_chars == 16 * 128
    check_prompt_chars("a" * 2048, SETTINGS)
    with pytest.raises(RequestError, match=r"^text_input: the prompt is 2049 characters; .* 2048 \(max_input_chars"):
        check_prompt_chars("a" * 2049, SETTINGS)


def test_returned_logits_are_bounded_by_tokens_times_vocabulary():
    settings = ServingSettings(tokenizer_dir="/t", max_input_len=8, max_seq_len=16, max_returned_logits=1000)
    check_returned_logits({}, 10**6, settings)  # none asked for
    check_returned_logits({"generation": 10}, 100, settings)
    with pytest.raises(RequestError, match=r"^return_generation_logits: .* 1010 logits \(101 tokens x 10 vocab"):
        check_returned_logits({"generation": 101}, 10, settings)
    with pytest.raises(RequestError, match=r"^return_generation_logits: return_context_logits and return_gen.*"):
        check_returned_logits({"context": 60, "generation": 50}, 10, settings)
    with pytest.raises(RequestError, match=r"1100 logits \(110 tokens x 10 vocabulary: 60 context, 50 generation\)"):
        check_returned_logits({"context": 60, "generation": 50}, 10, settings)
    off = ServingSettings(tokenizer_dir="/t", max_input_len=8, max_seq_len=16, max_returned_logits=0)
    with pytest.raises(RequestError, match=r"^return_context_logits: .* at most 0 \(max_returned_logits\)"):
        check_returned_logits({"context": 1}, 10, off)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_refused(value):
    assert finite("top_p", 0.5) == 0.5
    with pytest.raises(RequestError, match=r"^temperature: must be a finite number"):
        finite("temperature", value)


def test_text_must_be_utf8():
    assert utf8("text_input", "héllo".encode()) == "héllo"
    for bad in (b"\xff\xfe", "\ud800".encode("utf-8", "surrogatepass"), b"ok \xc3"):
        with pytest.raises(RequestError, match=r"^stop_words: is not valid UTF-8"):
            utf8("stop_words", bad)


def _banned_by_scan(words: list[list[int]], history: list[int], vocab: int) -> set[int]:
    """The rule stated plainly: a word's last token is banned where the history ends with the rest of it."""
    return {w[-1] for w in words if len(w) == 1 or (len(history) >= len(w) - 1 and history[-(len(w) - 1) :] == w[:-1])}


def test_the_bad_words_index_bans_what_a_scan_of_every_word_bans():
    rng = random.Random(0)
    vocab = 12
    for _ in range(300):
        words = [[rng.randrange(vocab) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 10))]
        history = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        out, _ = prepare(torch.zeros(vocab), SamplingParams(), Rules(Penalties(), words), history)
        assert set(torch.nonzero(torch.isinf(out)).flatten().tolist()) == _banned_by_scan(words, history, vocab)


def test_a_step_costs_the_same_with_ten_thousand_bad_words():
    """The index answers per distinct word length: 10,000 two-token words cost a step what one does."""
    vocab, history = 32_000, list(range(100))
    few = Rules(Penalties(), [[5, 6]])
    many = Rules(Penalties(), [[i, i + 1] for i in range(1000, 11_000)])
    logits = torch.zeros(vocab)

    def step_seconds(rules: Rules) -> float:
        best = math.inf
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(50):
                prepare(logits, SamplingParams(), rules, history)
            best = min(best, time.perf_counter() - start)
        return best / 50

    assert step_seconds(many) < 3 * step_seconds(few) + 50e-6


# ---- against the real server -------------------------------------------------------------------------------------

EDGE_MODEL = "edge_probe"
EDGE_CONFIG = f"""name: "{EDGE_MODEL}"
backend: "python"
max_batch_size: 0
input [ {{ name: "what" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "ok" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""
# a model whose handler fails as asked, through the Triton edge every trtspec model answers with
EDGE_MODEL_PY = """
import numpy as np

from trtspec.errors import RequestError
from trtspec.triton.common import input_arrays, respond_each


class TritonPythonModel:
    def execute(self, requests):
        return respond_each(requests, self._handle, "edge_probe")

    def _handle(self, request):
        what = input_arrays(request)["what"].reshape(-1)[0].decode()
        if what == "internal":
            raise KeyError("/srv/secrets/db.json holds password hunter2")
        if what == "request":
            raise RequestError("what", "is the client's own fault: send ok")
        return {"ok": np.asarray([1], dtype=np.int32)}
"""


@pytest.fixture(scope="module")
def limits_server(tmp_path_factory):
    from support.tiny import served_pair

    server = served_pair(
        tmp_path_factory.mktemp("limits"),
        max_input_len=MAX_INPUT_LEN,
        overrides={
            "request_timeout_ms": REQUEST_TIMEOUT_MS,
            "max_returned_logits": LOGITS_ROWS * VOCAB,
            # as deploy writes it for a TensorRT-LLM release without promptIgnoreLength
            "engine_prompt_ignore_length": False,
        },
    )
    edge = server.repo / EDGE_MODEL
    (edge / "1").mkdir(parents=True)
    (edge / "config.pbtxt").write_text(EDGE_CONFIG)
    (edge / "1" / "model.py").write_text(EDGE_MODEL_PY)
    server.start(timeout=300)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def deadline_server(tmp_path_factory):
    from support.tiny import served_pair

    server = served_pair(
        tmp_path_factory.mktemp("deadline"), max_input_len=MAX_INPUT_LEN, overrides={"request_timeout_ms": DEADLINE_MS}
    )
    server.start(timeout=300)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(limits_server) -> list[int]:
    return ids_of(grpc_generate(limits_server.grpc_url, {"text_input": PROMPT, "max_tokens": 8}))


def refusal(server, fields: dict) -> str:
    """The error a request gets over a gRPC stream (whose errors carry a message, not a status code) and over the
    generate extension, which must be a 400 (INVALID_ARG) saying the same."""
    with pytest.raises(InferenceServerException) as err:
        grpc_generate(server.grpc_url, fields)
    message = err.value.message()
    status, body = http_status(server, fields)  # Triton's JSON parser takes NaN and Infinity too
    assert (status, json.loads(body)) == (400, {"error": message})
    return message


def still_serves(server, reference: list[int]) -> None:
    assert ids_of(grpc_generate(server.grpc_url, {"text_input": PROMPT, "max_tokens": 8})) == reference


def http_status(server, fields: dict | bytes) -> tuple[int, str]:
    """A request to the generate extension (`fields` as JSON, or a body as it is): the status and the body."""
    req = urllib.request.Request(
        f"{server.http_base_url}/v2/models/{BLS}/generate",
        data=fields if isinstance(fields, bytes) else json.dumps(fields).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.server
@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"stop_words": ["w"] * 65}, r"stop_words: 65 words; this deployment takes at most 64 \(max_stop_words\)"),
        ({"bad_words": ["w"] * 65}, r"bad_words: 65 words; this deployment takes at most 64 \(max_bad_words\)"),
        ({"stop_words": ["w" * 257]}, r"stop_words: a word of 257 characters; .* 256 \(max_word_chars\)"),
        ({"bad_words": ["ok", "w" * 257]}, r"bad_words: a word of 257 characters; .* 256 \(max_word_chars\)"),
        # refused on its characters, not after tokenizing (which would say tokens and max_input_len)
        (
            {"text_input": "fox " * 10**5},
            rf"text_input: the prompt is 400000 characters; .* {16 * MAX_INPUT_LEN} \(max_input_chars",
        ),
        ({"temperature": math.nan}, r"temperature: must be a finite number, got nan"),
        ({"temperature": math.inf, "top_k": 5}, r"temperature: must be a finite number, got inf"),
        ({"top_p": math.nan}, r"top_p: must be a finite number"),
        ({"repetition_penalty": math.inf}, r"repetition_penalty: must be a finite number, got inf"),
        ({"presence_penalty": math.nan}, r"presence_penalty: must be a finite number, got nan"),
        ({"frequency_penalty": -math.inf}, r"frequency_penalty: must be a finite number, got -inf"),
        ({"timeout_ms": -1}, r"timeout_ms: must be >= 0"),
        (
            {"frequency_penalty": 0.5, "prompt_ignore_length": 3},
            r"frequency_penalty: cannot skip the prompt's tokens \(prompt_ignore_length 3\): .* takes no "
            r"promptIgnoreLength .* send prompt_ignore_length 0",
        ),
        (
            {"return_generation_logits": True, "max_tokens": LOGITS_ROWS + 1},
            rf"return_generation_logits: .* {(LOGITS_ROWS + 1) * VOCAB} logits .* at most {LOGITS_ROWS * VOCAB} "
            r"\(max_returned_logits\)",
        ),
        (
            {"return_context_logits": True, "return_generation_logits": True},
            r"return_generation_logits: return_context_logits and return_generation_logits would return .* "
            r"\(max_returned_logits\)",
        ),
    ],
)
def test_each_limit_is_a_clear_refusal_and_the_server_keeps_serving(limits_server, reference, fields, expected):
    message = refusal(limits_server, {"text_input": PROMPT, "max_tokens": 8, **fields})
    assert re.search(expected, message), message
    assert "Traceback" not in message
    still_serves(limits_server, reference)


@pytest.mark.server
def test_words_and_logits_within_the_limits_are_served(limits_server, reference):
    words = grpc_generate(
        limits_server.grpc_url,
        {"text_input": PROMPT, "max_tokens": 8, "stop_words": ["zzz"] * 64, "bad_words": ["q" * 256]},
    )
    assert len(ids_of(words)) == 8
    logits = grpc_generate(
        limits_server.grpc_url,
        {"text_input": PROMPT, "max_tokens": LOGITS_ROWS, "return_generation_logits": True},
    )
    assert ids_of(logits) == reference[:LOGITS_ROWS]
    assert np.asarray(logits[-1]["generation_logits"]).shape[-2:] == (LOGITS_ROWS, VOCAB)
    # prompt_ignore_length is neutral where no presence or frequency penalty counts, or at 0
    for fields in ({"prompt_ignore_length": 3}, {"prompt_ignore_length": 0, "presence_penalty": 0.5}):
        assert len(ids_of(grpc_generate(limits_server.grpc_url, {"text_input": PROMPT, "max_tokens": 8} | fields)))


def _grpc_bytes(server, values: dict[str, bytes]) -> InferenceServerException:
    """One request whose string inputs are the given raw bytes (max_tokens 8); the error it gets."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    errors: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: errors.put(error))
        inputs = []
        for name, value in {**values, "max_tokens": None}.items():
            if name == "max_tokens":
                arr = np.asarray([[8]], dtype=np.int32)
            else:
                arr = np.asarray([[value]], dtype=np.object_)
            spec = BLS_TYPES[name]
            tensor = grpcclient.InferInput(name, list(arr.shape), "BYTES" if spec.dtype == "STRING" else spec.dtype)
            tensor.set_data_from_numpy(arr)
            inputs.append(tensor)
        client.async_stream_infer(BLS, inputs)
        return errors.get(timeout=60)
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.server
@pytest.mark.parametrize("field", ["text_input", "stop_words", "bad_words"])
@pytest.mark.parametrize("raw", [b"fox \xff\xfe", "fox \ud800".encode("utf-8", "surrogatepass")], ids=["bad", "lone"])
def test_invalid_utf8_is_the_clients_fault_naming_the_field(limits_server, reference, field, raw):
    values = {"text_input": PROMPT.encode(), field: raw}
    error = _grpc_bytes(limits_server, values)
    assert error is not None and error.message().startswith(f"{BLS}: {field}: is not valid UTF-8"), error
    # the same bytes inside the JSON of the generate extension: Triton's parser passes them on, the BLS refuses them
    value = b'"' + raw + b'"' if field == "text_input" else b'["' + raw + b'"]'
    body = b'{"text_input": "' + PROMPT.encode() + b'", "max_tokens": 8, "' + field.encode() + b'": ' + value + b"}"
    if field == "text_input":
        body = b'{"text_input": ' + value + b', "max_tokens": 8}'
    status, text = http_status(limits_server, body)
    assert status == 400 and json.loads(text)["error"].startswith(f"{BLS}: {field}: is not valid UTF-8"), text
    still_serves(limits_server, reference)


@pytest.mark.server
def test_over_http_a_refusal_is_a_400_and_a_lone_surrogate_too(limits_server, reference):
    status, body = http_status(limits_server, {"text_input": PROMPT, "max_tokens": 8, "stop_words": ["w"] * 65})
    assert status == 400 and "max_stop_words" in body, (status, body)
    # JSON may spell a lone surrogate (\ud800): tritonserver 2.51's own JSON parser refuses it before any model,
    # with a 500 of its own ("The surrogate pair in string is invalid"), no traceback and nothing of the model's
    status, body = http_status(limits_server, {"text_input": "fox \ud800", "max_tokens": 8})
    assert status == 400 or (status == 500 and "failed to parse the request JSON buffer" in body), (status, body)
    assert "Traceback" not in body and BLS not in body, body
    still_serves(limits_server, reference)


@pytest.mark.server
def test_a_client_can_shorten_the_deployments_deadline_not_lift_it(deadline_server):
    """request_timeout_ms bounds every request: timeout_ms 0 or beyond it is the deployment's limit, a shorter one
    is the request's own. A whole plain answer of LONG_ANSWER tokens outlasts both (DEADLINE_MS)."""
    long = {"text_input": PROMPT, "max_tokens": LONG_ANSWER, "end_id": -1, "num_draft_tokens": 0}
    for fields in (long, long | {"timeout_ms": 0}, long | {"timeout_ms": 10**9}):
        message = refusal(deadline_server, fields)
        assert f"timeout_ms: the request ran past {DEADLINE_MS} ms, the deployment's request_timeout_ms" in (message), (
            message
        )
    message = refusal(deadline_server, long | {"timeout_ms": SHORT_MS})
    assert f"timeout_ms: the request ran past its {SHORT_MS} ms; give it a longer timeout_ms" in message, message


@pytest.mark.server
def test_internal_errors_reach_the_client_as_an_id_and_the_log_holds_the_rest(limits_server):
    """The Triton edge every trtspec model answers through: an exception of no trtspec kind goes to the client as
    a generic message with an id, and to the server log with its traceback under that id; a client's own error
    keeps its message."""
    client = grpcclient.InferenceServerClient(limits_server.grpc_url)

    def ask(what: str):
        tensor = grpcclient.InferInput("what", [1], "BYTES")
        tensor.set_data_from_numpy(np.asarray([what.encode()], dtype=np.object_))
        return client.infer(EDGE_MODEL, [tensor])

    try:
        with pytest.raises(InferenceServerException) as err:
            ask("internal")
        message = err.value.message()
        assert err.value.status() == "StatusCode.INTERNAL", err.value
        found = re.fullmatch(rf"{EDGE_MODEL}: internal error ([0-9a-f]{{12}}); the server log has .*", message)
        assert found, message
        assert "hunter2" not in message and "/srv" not in message and "KeyError" not in message
        log = Path(limits_server.log_path).read_text(errors="replace")
        at = log.index(f"request failed (error {found.group(1)})")
        assert "KeyError" in log[at:] and "hunter2" in log[at:] and "Traceback" in log[at:]
        with pytest.raises(InferenceServerException) as err:
            ask("request")
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert err.value.message() == f"{EDGE_MODEL}: what: is the client's own fault: send ok"
        assert ask("ok").as_numpy("ok").tolist() == [1]
    finally:
        client.close()
