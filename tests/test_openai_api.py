"""The OpenAI-compatible front (trtspec.openai_api) on a real tritonserver, called with the official `openai`
package."""

from __future__ import annotations

import http.client
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")

from trtspec.client import SpecClient  # noqa: E402
from trtspec.keys import Key  # noqa: E402
from trtspec.openai_api.errors import APIError  # noqa: E402
from trtspec.openai_api.limits import Limits  # noqa: E402
from trtspec.openai_api.protocol import CHAT, COMPLETION, parse_request  # noqa: E402
from trtspec.openai_api.stops import StopText  # noqa: E402

MODEL = "tiny-target"
PROMPTS = ["The quick brown fox", "def add(a, b):"]
# A tiny chat template: the tiny tokenizer has none.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What does Triton serve?"}]


# ---- without a server ----------------------------------------------------------------------------------------


def test_stop_text_cuts_before_the_first_stop_string_across_chunks():
    stop = StopText(["END", "xyz"])
    pieces = [stop.push(p) for p in ["abc E", "N", "D and more"]]
    assert "".join(pieces) == "abc " and stop.stopped and stop.flush() == ""
    stop = StopText(["END"])
    assert stop.push("abc E") == "abc " and stop.flush() == "E" and not stop.stopped  # a held tail comes out at the end
    assert StopText([]).push("x") == "x"


def test_stop_text_cuts_where_the_first_stop_string_ends_however_the_text_is_chunked():
    """The automaton against the rule written plainly: cut before the stop string that ends first (the longest of
    those ending there), with the text pushed in random chunks."""

    def reference(stops, text):
        for end in range(1, len(text) + 1):
            if ends := [s for s in stops if text[:end].endswith(s)]:
                return text[: end - max(map(len, ends))], True
        return text, False

    rng = random.Random(0)
    for _ in range(3000):
        alphabet = "ab c"[: rng.randint(2, 4)]
        stops = list({"".join(rng.choices(alphabet, k=rng.randint(1, 5))) for _ in range(rng.randint(1, 5))})
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 30)))
        stop, out, i = StopText(stops), [], 0
        while i < len(text):
            n = rng.randint(1, 4)
            out.append(stop.push(text[i : i + n]))
            i += n
        assert ("".join(out) + stop.flush(), stop.stopped) == reference(stops, text), (stops, text)


def test_limits_derive_from_the_bls():
    limits = Limits().resolve(max_input_len=4096, capacity=64 + 256)
    assert (limits.prompt_chars, limits.messages, limits.connections) == (16 * 4096, 4096, 64 + 256 + 64)
    assert limits.body_bytes == 4 * 1024 * 1024  # the longest prompt, escaped, fits
    long = Limits().resolve(max_input_len=131072)
    assert long.body_bytes >= 12 * long.prompt_chars  # a deployment of long prompts can still be sent one
    assert Limits().resolve().connections == 512 and Limits(prompt_chars=10).resolve(4096).prompt_chars == 10


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"stop": [f"s{i}" for i in range(17)]}, "stop", "at most 16"),
        ({"stop": ["x" * 257]}, "stop", "at most 256"),
        ({"prompt": "x" * (16 * 96 + 1)}, "prompt", "at most 1536"),
        ({"prompt": "\ud800 lone"}, "prompt", "U+D800"),
        ({"prompt": "a\udcff"}, "prompt", "not UTF-8"),  # what surrogateescape makes of the byte 0xff
        ({"stop": ["ok", "\udfff"]}, "stop[1]", "lone surrogate"),
        ({"user": "\ud83d"}, "user", "lone surrogate"),
        ({"metadata": {"\ud800": "x"}}, "metadata.\\ud800", "lone surrogate"),
    ],
)
def test_limits_and_text_are_checked_naming_the_field(body, param, words):
    limits = Limits().resolve(max_input_len=96)
    with pytest.raises(APIError) as err:
        parse_request({"model": "m", "prompt": "x"} | body, COMPLETION, limits)
    assert err.value.status == 400 and err.value.param == param and words in err.value.message
    json.dumps(err.value.body()).encode("utf-8")  # the error itself is sendable


def test_chat_limits_are_checked_before_the_template():
    limits = Limits().resolve(max_input_len=96)
    many = [{"role": "user", "content": "hi"}] * 97
    with pytest.raises(APIError, match="97 messages.*at most 96") as err:
        parse_request({"model": "m", "messages": many}, CHAT, limits)
    assert err.value.param == "messages"
    long = [{"role": "user", "content": "x" * 1000}, {"role": "user", "content": [{"type": "text", "text": "y" * 537}]}]
    with pytest.raises(APIError, match="1537 characters.*at most 1536"):
        parse_request({"model": "m", "messages": long}, CHAT, limits)
    with pytest.raises(APIError) as err:
        parse_request({"model": "m", "messages": [{"role": "user", "content": "\ud800"}]}, CHAT, limits)
    assert err.value.param == "messages[0].content"


def test_the_front_binds_beyond_loopback_only_with_a_key():
    from rich.console import Console

    from trtspec.openai_api import Deployment, Front, FrontError, serve_front

    deployment = Deployment("127.0.0.1:1")  # not connected: the check comes first
    for host in ("0.0.0.0", "::", "192.168.1.10", ""):
        with pytest.raises(FrontError, match="--openai-host .*--api-key-file FILE, or \\$TRTSPEC_API_KEY"):
            Front(deployment, host=host, port=9000)
    Front(deployment, host="0.0.0.0", port=9000, api_key=Key("k" * 32, "test"))  # made, not started
    Front(deployment, host="127.0.0.1", port=9000)
    with pytest.raises(FrontError, match="--host 0.0.0.0 is not loopback"):  # before it connects to Triton
        serve_front("127.0.0.1:1", host="0.0.0.0", port=9000, console=Console())


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x"}, "model"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "m", "prompt": [1, 2]}, "prompt"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": -0.5}, "temperature"),
        ({"model": "m", "prompt": "x", "top_p": 2}, "top_p"),
        ({"model": "m", "prompt": "x", "n": 3}, "n"),
        ({"model": "m", "prompt": "x", "best_of": 2}, "best_of"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo"),
        ({"model": "m", "prompt": "x", "logprobs": 2}, "logprobs"),
        ({"model": "m", "prompt": "x", "logit_bias": {"5": 1}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "stop": ["a", 3]}, "stop"),
        ({"model": "m", "prompt": "x", "messages": []}, "messages"),
        ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": "m", "prompt": "x", "speculation": "medusa"}, "speculation"),
        ({"model": "m", "prompt": "x", "num_draft_tokens": -1}, "num_draft_tokens"),
        ({"model": "m", "prompt": "x", "frobnicate": 1}, "frobnicate"),
        ({"model": "m", "prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
        ({"model": "m", "prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ],
)
def test_bad_completion_fields_are_named(body, param):
    with pytest.raises(APIError) as err:
        parse_request(body, COMPLETION)
    assert err.value.status == 400 and err.value.param == param and param in err.value.message


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"model": "m", "messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
        ({"model": "m", "messages": MESSAGES, "response_format": {"type": "json_object"}}, "response_format"),
        ({"model": "m", "messages": MESSAGES, "logprobs": True, "top_logprobs": 2}, "top_logprobs"),
        ({"model": "m", "messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_bad_chat_fields_are_named(body, param):
    with pytest.raises(APIError) as err:
        parse_request(body, CHAT)
    assert err.value.param == param


def test_harmless_and_neutral_fields_are_accepted():
    req = parse_request(
        {
            "model": "m",
            "messages": MESSAGES,
            "user": "u",
            "logprobs": False,
            "tools": [],
            "response_format": {"type": "text"},
            "presence_penalty": 0,
            "max_completion_tokens": 5,
            "max_tokens": 9,
            "stop": "x",
            "seed": None,
        },
        CHAT,
    )
    assert req.max_tokens == 5 and req.max_tokens_param == "max_completion_tokens" and req.stop == ["x"]
    assert parse_request({"model": "m", "prompt": ["one"]}, COMPLETION).prompt == "one"


# ---- on a real server ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    """A 2-layer target whose tokenizer has a chat template, a perturbed copy as its draft, served by tritonserver."""
    from support.tiny import make_checkpoint, make_perturbed_copy, write_config
    from transformers import AutoTokenizer

    from trtspec.compile import run_build
    from trtspec.config import load_config
    from trtspec.deploy.writer import write_repository
    from trtspec.server import TritonServer, free_port

    root = tmp_path_factory.mktemp("openai")
    target = make_checkpoint(root / "target", layers=2, seed=0)
    plain = root / "plain-tokenizer"  # the same tokenizer without a chat template
    AutoTokenizer.from_pretrained(target).save_pretrained(plain)
    tok = AutoTokenizer.from_pretrained(target)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(target)
    draft = make_perturbed_copy(target, root / "draft", noise=0.01)
    config = write_config(
        root / "build.yaml",
        target,
        draft,
        speculation={"max_draft_len": 4},
        engine={"max_input_len": 96, "max_seq_len": 160},
    )
    engines = run_build(config, root / "engines")
    repo = write_repository(load_config(config), engines, root / "repo")
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    server.start(timeout=300)
    server.plain_tokenizer = plain
    yield server
    server.stop()


@pytest.fixture(scope="module")
def front(triton):
    from trtspec.openai_api import Deployment, Front
    from trtspec.server import free_port

    with Front(Deployment(triton.http_url, served_model_name=MODEL).connect(), port=free_port()) as running:
        yield running


@pytest.fixture(scope="module")
def client(front):
    with openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def bls(triton):
    with SpecClient(triton.grpc_url, protocol="grpc") as c:
        yield c


def chat_text(messages) -> str:
    from jinja2 import Template

    return Template(TEMPLATE).render(messages=messages, add_generation_prompt=True)


def test_models_and_health(client, front):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with urllib.request.urlopen(f"{front.url}/health", timeout=10) as resp:
        assert resp.status == 200 and json.load(resp)["status"] == "ready"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_the_bls(client, bls, prompt):
    reference = bls.generate(prompt, max_tokens=12, temperature=0.0)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert out.choices[0].text == reference.text and out.object == "text_completion"
    assert out.choices[0].finish_reason == ("length" if reference.finish_reason == "length" else "stop")
    prompt_ids, _ = bls.tokenize(prompt)  # the deployment's preprocessing model counts as the BLS does
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), len(reference.token_ids))
    assert out.usage.total_tokens == len(prompt_ids) + len(reference.token_ids)

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].speculation["iterations"] >= 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reference.token_ids)


def test_chat_completion_equals_the_bls_on_the_templated_prompt(client, bls):
    text = chat_text(MESSAGES)
    reference = bls.generate(text, max_tokens=10, temperature=0.0)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == reference.text
    assert out.usage.prompt_tokens == len(bls.tokenize(text)[0])
    assert out.usage.completion_tokens == len(reference.token_ids)

    stream = list(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0, stream=True)
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == reference.text
    assert stream[-1].choices[0].finish_reason in ("stop", "length") and stream[-1].object == "chat.completion.chunk"


def test_chat_without_max_tokens_fills_the_context(client, bls):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    prompt = len(bls.tokenize(chat_text(MESSAGES))[0])
    assert out.usage.completion_tokens <= 160 - prompt
    assert out.choices[0].finish_reason == "stop" or out.usage.completion_tokens == 160 - prompt


def test_stop_string_ends_the_text_before_it(client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0).choices[0].text
    word = full[len(full) // 2 : len(full) // 2 + 3]
    assert word, full
    expected = full[: full.find(word)]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[word])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=word, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_speculation_fields_reach_the_bls(client, bls):
    reference = bls.generate(PROMPTS[1], max_tokens=12, temperature=0.0).text
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[1],
        max_tokens=12,
        temperature=0,
        extra_body={"num_draft_tokens": 3, "speculation": "draft_model", "adaptive_draft_length": False},
    )
    spec = out.speculation
    assert out.choices[0].text == reference  # greedy speculation changes nothing in the text
    assert spec["draft_tokens"] > 0 and 0 <= spec["acceptance_rate"] <= 1
    assert spec["accepted_draft_tokens"] <= spec["draft_tokens"] and spec["tokens_per_iteration"] > 1
    plain = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, extra_body={"num_draft_tokens": 0}
    )
    assert plain.speculation["draft_tokens"] == 0 and plain.choices[0].text == reference


def test_ignore_eos_generates_max_tokens_and_min_tokens_holds_the_end(client, bls):
    """Benchmark clients (AIPerf, guidellm) send ignore_eos for fixed output lengths: the end token is then an ordinary
    token. Of these prompts, some end on the end token well before the limit; with ignore_eos every one runs to it."""
    prompts = [f"{word} {n}" for word in ("alpha", "beta", "gamma", "delta") for n in range(6)]
    ended = []
    for prompt in prompts:
        default = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.usage.completion_tokens == 40 and out.choices[0].finish_reason == "length"
        if default.choices[0].finish_reason == "stop":
            ended.append(prompt)
            n = default.usage.completion_tokens
            held = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body={"min_tokens": n + 2}
            )
            assert held.usage.completion_tokens >= n + 2
            assert held.choices[0].text.startswith(default.choices[0].text)
    assert ended, "no prompt ended on the end token: choose prompts that do"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 30


def test_seeded_sampling_repeats(client):
    def one(seed):
        return (
            client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=seed)
            .choices[0]
            .text
        )

    assert one(7) == one(7)


@pytest.mark.parametrize(
    "kwargs, error, param",
    [
        ({"n": 2}, "BadRequestError", "n"),
        ({"max_tokens": 0}, "BadRequestError", "max_tokens"),
        ({"max_tokens": 100000}, "BadRequestError", "max_tokens"),  # refused by the BLS, named by the front
        ({"extra_body": {"num_draft_tokens": 99}}, "BadRequestError", "num_draft_tokens"),  # ditto
        ({"prompt": "hello " * 200}, "BadRequestError", "prompt"),  # longer than max_input_len
        ({"model": "gpt-4o"}, "NotFoundError", "model"),
        ({"temperature": -1}, "BadRequestError", "temperature"),
        ({"logprobs": 2}, "BadRequestError", "logprobs"),
        ({"extra_body": {"frobnicate": True}}, "BadRequestError", "frobnicate"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_errors_have_openais_shape_and_the_front_keeps_serving(client, kwargs, error, param, stream):
    request = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": stream} | kwargs
    with pytest.raises(getattr(openai, error)) as err:
        out = client.completions.create(**request)
        list(out) if stream else None
    assert err.value.param == param and err.value.type == "invalid_request_error", err.value.body
    assert param in err.value.message
    assert (
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0).usage.completion_tokens
        == 2
    )


def test_chat_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=4,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}],
        )
    assert err.value.param == "tools"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=2)
    assert err.value.param == "n"


def test_raw_http_errors(front):
    def post(path, data):
        req = urllib.request.Request(front.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=30)
        except urllib.error.HTTPError as exc:
            return exc.code, json.load(exc)["error"]
        raise AssertionError("no error")

    code, body = post("/v1/completions", b"{not json")
    assert code == 400 and "JSON" in body["message"] and body["type"] == "invalid_request_error"
    code, body = post("/v1/embeddings", b"{}")
    assert code == 404 and "/v1/completions" in body["message"]


def _record_streams(front, monkeypatch) -> list[tuple[str, float]]:
    """How each of the front's streams from Triton ends, and when: "closed early" (before the final response, which
    closes the connection, on which Triton cancels the request) or "read to the end"."""
    from trtspec.generation import Completion

    outcomes = []
    stream_of = front.deployment.upstream.stream

    async def recorded(fields):
        responses, final = stream_of(fields), False
        try:
            async for item in responses:
                final = isinstance(item, Completion)
                yield item
        finally:
            outcomes.append(("read to the end" if final else "closed early", time.monotonic()))
            await responses.aclose()

    monkeypatch.setattr(front.deployment.upstream, "stream", recorded)
    return outcomes


def test_a_client_that_leaves_mid_stream_cancels_its_request(client, front, monkeypatch):
    """The front stops reading the BLS when its client leaves: its stream from Triton is closed before the end (the
    connection closes, on which Triton cancels the request), not read to max_tokens."""
    outcomes = _record_streams(front, monkeypatch)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=140, temperature=0, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30
    while not outcomes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert outcomes and outcomes[0][0] == "closed early", outcomes
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3


def test_chat_without_a_template_is_refused_naming_messages(triton):
    from trtspec.openai_api import Deployment, Front
    from trtspec.server import free_port

    deployment = Deployment(triton.http_url, tokenizer_dir=str(triton.plain_tokenizer))
    with Front(deployment.connect(), port=free_port()) as other:
        with openai.OpenAI(base_url=f"{other.url}/v1", api_key="x", max_retries=0) as c:
            assert c.models.list().data[0].id == "plain-tokenizer"  # the default id: the tokenizer dir's name
            with pytest.raises(openai.BadRequestError) as err:
                c.chat.completions.create(model="plain-tokenizer", messages=MESSAGES, max_tokens=4)
            assert err.value.param == "messages" and "chat template" in err.value.message
            assert (
                c.completions.create(
                    model="plain-tokenizer", prompt="hi", max_tokens=2, temperature=0
                ).usage.completion_tokens
                == 2
            )  # greedy: no early end


def test_trtspec_openai_command_serves_and_stops_on_ctrl_c(triton):
    from trtspec.server import free_port

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trtspec.cli",
            "openai",
            "--triton-url",
            triton.http_url,
            "--port",
            str(port),
            "--served-model-name",
            "cli",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=os.environ | {"COLUMNS": "200"},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the front did not answer /health within 60 s"
            time.sleep(0.2)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0) as c:
            assert (
                c.completions.create(model="cli", prompt="hi", max_tokens=2, temperature=0).usage.completion_tokens == 2
            )
        # a client's keep-alive connection left open does not hold the front up; nor does the interpreter's teardown
        # of torch, which transformers' tokenizer imports (3-7 s on a loaded 2-core machine: trtspec.cli.app.main)
        idle = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        idle.request("GET", "/health")
        idle.getresponse().read()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        idle.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    from trtspec.server import _port_is_free

    assert _port_is_free("127.0.0.1", port)


def test_health_says_what_can_be_served(triton, front):
    """/health follows the models a request goes through: without the draft model requests are still served
    (degraded, 200); without the target nothing is (503); both back, ready again."""
    import tritonclient.grpc as tc

    def health():
        try:
            with urllib.request.urlopen(f"{front.url}/health", timeout=10) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as exc:
            return exc.code, json.load(exc)

    from trtspec.keys import GRPC_PREFIX

    key = {GRPC_PREFIX + k: v for k, v in triton.admin_headers.items()}  # the repository API is the admin's
    admin = tc.InferenceServerClient(triton.grpc_url)
    try:
        admin.unload_model("tensorrt_llm_draft", headers=key)
        status, body = health()
        assert status == 200 and body["status"] == "degraded" and "tensorrt_llm_draft" in body["detail"]
        admin.unload_model("tensorrt_llm", headers=key)
        status, body = health()
        assert status == 503 and "'tensorrt_llm'" in body["error"]["message"]
        assert str(triton.http_port) not in body["error"]["message"]  # Triton's address is internal
    finally:
        admin.load_model("tensorrt_llm", headers=key)
        admin.load_model("tensorrt_llm_draft", headers=key)
        admin.close()
    assert health() == (200, {"status": "ready", "model": MODEL})


# ---- the front's key and limits, on the real server ----------------------------------------------------------

KEY = Key("front-key-" + "k" * 24, "test")


@pytest.fixture(scope="module")
def keyed(triton):
    """The front with an API key."""
    from trtspec.openai_api import Deployment, Front
    from trtspec.server import free_port

    with Front(Deployment(triton.http_url, served_model_name=MODEL).connect(), port=free_port(), api_key=KEY) as f:
        yield f


def _raw(front, head: bytes, body: bytes = b"", timeout: float = 10.0) -> tuple[int, dict, dict]:
    """One request on a fresh connection, sent as given (`head`: the request line and headers without the blank
    line); its status, headers and JSON body."""
    host, port = front.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head + b"\r\n\r\n" + body)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, dict(resp.getheaders()), json.loads(resp.read())


def _post(path: str, body: bytes, *headers: bytes) -> bytes:
    lines = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: front", b"Content-Type: application/json", *headers]
    return b"\r\n".join(lines)


def _served(client, model=MODEL) -> bool:
    return client.completions.create(model=model, prompt="hi", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_every_route_but_health_asks_for_the_key(keyed):
    with openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="not-the-key-at-all", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as err:
            wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert err.value.code == "invalid_api_key" and err.value.type == "invalid_request_error"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    for path in ("/v1/models", "/v1/models/" + MODEL, "/v1/embeddings"):  # an unknown route too: nothing is said
        status, headers, body = _raw(keyed, b"GET " + path.encode() + b" HTTP/1.1\r\nHost: front")
        assert status == 401 and headers["www-authenticate"] == "Bearer", path
        assert body["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in body["error"]["message"]
    status, _, body = _raw(keyed, b"GET /v1/models HTTP/1.1\r\nHost: front\r\nAuthorization: Basic " + b"k" * 32)
    assert status == 401
    # refused before the body is read: a body announced and never sent is not waited for
    status, _, _ = _raw(keyed, _post("/v1/completions", b"", b"Content-Length: 1000"))
    assert status == 401
    status, _, body = _raw(keyed, b"GET /health HTTP/1.1\r\nHost: front")
    assert status == 200 and body["status"] == "ready"
    with openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEY.value, max_retries=0) as right:
        assert [m.id for m in right.models.list().data] == [MODEL] and _served(right)
        assert right.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices[0].message


def test_a_body_past_the_limit_is_refused_as_it_arrives(front, client):
    limit = front.deployment.limits.body_bytes
    assert limit == 4 * 1024 * 1024
    # by its Content-Length, before any of it is read
    status, headers, body = _raw(front, _post("/v1/completions", b"", f"Content-Length: {limit + 1}".encode()))
    assert status == 413 and body["error"]["param"] == "body" and str(limit) in body["error"]["message"]
    assert headers["connection"] == "close"
    # chunked (no length): counted as it arrives, refused once past the limit, not read to its end
    host, port = front.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(_post("/v1/completions", b"", b"Transfer-Encoding: chunked") + b"\r\n\r\n")
        piece, sent = b"x" * 65536, 0
        # How far past the limit the client gets before it sees the answer depends on the kernel's socket buffers
        # (several MiB on loopback) and on how busy the machine is: only "answered long before the body's end" holds.
        while not select.select([sock], [], [], 0)[0]:
            assert sent < 8 * limit, "no answer though the body is far past the limit"
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except (BrokenPipeError, ConnectionResetError):
                break  # the front answered and closed: its answer is there to read
            sent += len(piece)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"
    assert sent > limit
    assert _served(client)


def test_bad_text_and_too_many_stops_are_400s_naming_the_field(front, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stop=[f"s{i}" for i in range(17)])
    assert err.value.param == "stop" and "at most 16" in err.value.message
    assert _served(client)
    model = MODEL.encode()
    for raw, param, words in (
        (b'{"model": "%s", "prompt": "a \\ud800 b"}' % model, "prompt", "lone surrogate"),  # as JSON allows
        (b'{"model": "%s", "prompt": "hi", "stop": ["ok", "\\udc00"]}' % model, "stop[1]", "lone surrogate"),
        (b'{"model": "%s", "prompt": "caf\xe9"}' % model, "prompt", "not UTF-8"),  # Latin-1
    ):
        status, _, body = _raw(front, _post("/v1/completions", raw, b"Content-Length: %d" % len(raw)), raw)
        assert status == 400 and body["error"]["param"] == param and words in body["error"]["message"], body
    deep = b"[" * 100000 + b"]" * 100000
    status, _, body = _raw(front, _post("/v1/completions", deep, b"Content-Length: %d" % len(deep)), deep)
    assert status == 400 and body["error"]["param"] == "body"
    with pytest.raises(openai.BadRequestError) as err:  # refused before it is tokenized
        client.completions.create(model=MODEL, prompt="x" * (16 * 96 + 1), max_tokens=2)
    assert err.value.param == "prompt" and "at most 1536" in err.value.message
    assert _served(client)


def test_an_internal_failure_answers_an_id_not_the_exception(front, client, monkeypatch, caplog):
    async def broken(req, text):
        raise RuntimeError("secret detail: Triton at 10.1.2.3:8000")

    monkeypatch.setattr(front.deployment, "complete", broken)
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    message = err.value.body["message"]
    assert "secret" not in message and "RuntimeError" not in message and "error id" in message
    ref = message.split("error id ")[1].split(",")[0]
    logged = [r for r in caplog.records if r.exc_info]
    assert len(logged) == 1 and ref in logged[0].getMessage()  # the log has it once, under the id
    monkeypatch.undo()
    assert _served(client)


def test_the_limits_come_from_the_bls(triton, front):
    config = SpecClient(triton.http_url).model_config("tensorrt_llm_bls")["parameters"]
    admitted = sum(int(config[k]["string_value"]) for k in ("max_concurrent_requests", "max_queued_requests"))
    limits = front.deployment.limits
    assert (limits.prompt_chars, limits.messages, limits.connections) == (16 * 96, 96, admitted + 64)
    assert front._server.config.limit_concurrency == admitted + 64
    assert front.deployment.upstream._session.connector.limit == admitted + 64  # the pool to Triton is bounded
    from trtspec.openai_api import Deployment, FrontError

    with pytest.raises(FrontError, match="restricted"):  # the headers it is given are what it sends
        Deployment(triton.http_url, admin_headers={"trtspec-admin-key": "w" * 32}).connect()
    assert Deployment(triton.http_url, admin_headers=triton.admin_headers).connect().limits == limits


LONG = "m" * 32000  # a long model id makes every streamed chunk 32 KB: a few tokens fill the buffers
ENGINE_TOKENS = 'trtspec_engine_tokens_total{model="tensorrt_llm"}'


@pytest.fixture(scope="module")
def tight(triton):
    """A front with short deadlines, a small send buffer and three connections. The stall deadline is far shorter
    than the tiny engine's 140 tokens (about 0.25 s here), so a stalled stream ends while its request still runs."""
    from trtspec.openai_api import Deployment, Front
    from trtspec.server import free_port

    limits = Limits(stall_seconds=0.02, header_seconds=2.0, body_seconds=1.0, send_buffer_bytes=4096, connections=3)
    with Front(Deployment(triton.http_url, served_model_name=LONG, limits=limits).connect(), port=free_port()) as f:
        yield f


def _engine_tokens(triton) -> float:
    """The target engine's returned tokens, once the count has settled (it is sent every 0.25 s)."""
    from trtspec.client import fetch_metrics

    last = None
    while (now := fetch_metrics(triton.metrics_url, "trtspec_engine_tokens").get(ENGINE_TOKENS, 0.0)) != last:
        last = now
        time.sleep(0.6)
    return now


def test_a_client_that_stops_reading_loses_its_stream_and_its_request(triton, tight, monkeypatch):
    """A client sends a streaming request and reads nothing: once the buffers are full, the front waits
    stall_seconds for it, then closes the connection, which ends the stream and the request to Triton: the engine
    stops short of the 140 tokens asked for."""
    outcomes = _record_streams(tight, monkeypatch)
    before = _engine_tokens(triton)
    request = {"model": LONG, "prompt": PROMPTS[0], "max_tokens": 140, "temperature": 0, "stream": True}
    body = json.dumps(request | {"ignore_eos": True, "num_draft_tokens": 0}).encode()
    host, port = tight.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # a reader that takes next to nothing
    sock.connect((host, int(port)))
    try:
        sock.sendall(_post("/v1/completions", body, b"Content-Length: %d" % len(body)) + b"\r\n\r\n" + body)
        sent = time.monotonic()
        while not outcomes and time.monotonic() < sent + 20:
            time.sleep(0.02)
        assert outcomes and outcomes[0][0] == "closed early", outcomes
        assert outcomes[0][1] - sent < 5  # the tokens that filled the buffers, then the stall's deadline
        sock.settimeout(5)  # a connection left open would time out here
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
    finally:
        sock.close()
    generated = _engine_tokens(triton) - before
    assert generated < 140, generated  # Triton cancelled the request: its engine call stopped
    monkeypatch.undo()
    with openai.OpenAI(base_url=f"{tight.url}/v1", api_key="x", max_retries=0) as c:
        assert _served(c, LONG)


def test_a_body_that_does_not_arrive_in_time_is_refused(tight):
    status, headers, body = _raw(tight, _post("/v1/completions", b"", b"Content-Length: 100"), b'{"model":')
    assert status == 408 and body["error"]["param"] == "body" and "1 s" in body["error"]["message"]


def _closed(sock) -> bool:
    """Whether the peer closed `sock` (an open one times out here)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_connection_that_sends_no_request_is_closed(tight):
    host, port = tight.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as silent:
        with socket.create_connection((host, int(port)), timeout=10) as trickle:
            trickle.sendall(b"GET /health HTTP/1.1\r\nHost: front\r\n")  # and never the blank line
            opened = time.monotonic()
            assert _closed(silent) and _closed(trickle)
            assert 1.5 < time.monotonic() - opened < 8
        with urllib.request.urlopen(f"{tight.url}/health", timeout=10) as resp:
            assert resp.status == 200


def test_connections_past_the_limit_get_503(tight):
    host, port = tight.url.removeprefix("http://").rsplit(":", 1)
    idle = [socket.create_connection((host, int(port))) for _ in range(3)]
    try:
        time.sleep(0.2)  # the front has accepted them
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{tight.url}/health", timeout=10)
        assert err.value.code == 503
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    with urllib.request.urlopen(f"{tight.url}/health", timeout=10) as resp:
        assert resp.status == 200


def test_the_front_sends_the_key_of_tritons_inference_api(triton, tmp_path):
    """Triton bound beyond loopback asks for the API key on inference: the front that is given it (triton_headers)
    serves, one that is not answers 5xx (the deployment is misconfigured, not the request)."""
    from trtspec.keys import API_HEADER
    from trtspec.openai_api import Deployment, Front
    from trtspec.server import TritonServer, free_port

    key = Key("inference-" + "i" * 24, "test")
    ports = {"http_port": free_port(), "grpc_port": free_port(), "metrics_port": free_port()}
    exposed = TritonServer(
        triton.repo, host="0.0.0.0", api_key=key, allow_dev_server_exposure=True, log_file=tmp_path / "log", **ports
    )
    with exposed:
        for headers, serves in (({API_HEADER: key.value}, True), ({}, False)):
            deployment = Deployment(
                exposed.http_url, served_model_name=MODEL, triton_headers=headers, admin_headers=exposed.admin_headers
            )
            with Front(deployment.connect(), port=free_port()) as f:
                with openai.OpenAI(base_url=f"{f.url}/v1", api_key="x", max_retries=0) as c:
                    if serves:
                        assert _served(c)
                        continue
                    with pytest.raises(openai.InternalServerError) as err:
                        c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
                    assert API_HEADER in err.value.message
