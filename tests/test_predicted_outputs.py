"""OpenAI's Predicted Outputs, log probabilities and penalties on a real tritonserver: the BLS's `prediction` input
and its counts, and the OpenAI front called with the official `openai` package."""

from __future__ import annotations

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from trtspec.client import SpecClient  # noqa: E402
from trtspec.orchestrator.drafters.prediction import prediction_usage  # noqa: E402

MODEL = "tiny-target"
PROMPT = "def add(a, b):"
MESSAGES = [{"role": "user", "content": "Return the code unchanged: x = 1"}]


def _copying_pair(root):
    """A target whose greedy text repeats a token (each position's logits depend on its own token alone), so its
    answer is text that tokenizes back to the same tokens: a prediction made of it is exactly right, token for
    token, and the counts are known; and a perturbed copy as its draft."""
    from support.tiny import make_bigram_copy, make_checkpoint, make_perturbed_copy

    target = make_bigram_copy(make_checkpoint(root / "base", layers=2, seed=0), root / "target")
    return target, make_perturbed_copy(target, root / "draft", noise=0.01)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from support.tiny import chat_tokenizer, served_pair

    root = tmp_path_factory.mktemp("predicted")
    server = served_pair(root, pair=_copying_pair)
    server.start(timeout=900)  # generous: the machine may be busy with other work
    server.chat_tokenizer = chat_tokenizer(server.repo, root / "chat-tokenizer")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def bls(server):
    with SpecClient(server.grpc_url, protocol="grpc") as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.chat_tokenizer)


@pytest.fixture(scope="module")
def front(server):
    from trtspec.openai_api import Deployment, Front
    from trtspec.server import free_port

    deployment = Deployment(server.http_url, served_model_name=MODEL, tokenizer_dir=str(server.chat_tokenizer))
    with Front(deployment.connect(), port=free_port()) as running:
        yield running


@pytest.fixture(scope="module")
def client(front):
    with openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _predictions(text: str) -> dict[str, str]:
    """A right prediction (the answer's own text), a partly right one (its middle replaced), a wrong one, one
    longer than the answer, and an empty one."""
    third = len(text) // 3
    return {
        "right": text,
        "partly right": text[:third] + "#edited: 1 2 3#" + text[2 * third :],
        "wrong": "Triton serves models over HTTP and gRPC; metrics are exported for Prometheus. " * 2,
        "longer": text + " and then some more text that the answer never reaches",
        "empty": "",
    }


@pytest.mark.server
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("speculation", [None, "draft_model"])
def test_the_bls_answers_the_targets_tokens_whatever_the_prediction(bls, tokenizer, stream, speculation):
    reference = bls.generate(PROMPT, max_tokens=40, temperature=0.0, num_draft_tokens=0, end_id=-1)
    n = len(reference.token_ids)
    assert tokenizer(reference.text, add_special_tokens=False)["input_ids"] == reference.token_ids  # known counts
    for name, prediction in _predictions(reference.text).items():
        out = bls.generate(
            PROMPT,
            max_tokens=40,
            temperature=0.0,
            num_draft_tokens=4,
            end_id=-1,
            stream=stream,
            speculation=speculation,
            prediction=prediction,
        )
        assert out.token_ids == reference.token_ids, name
        # OpenAI's counts: the prediction's tokens (as the BLS tokenizes it) that appear in the answer, and the rest
        ids = tokenizer(prediction, add_special_tokens=False)["input_ids"] if prediction else []
        counts = (out.accepted_prediction_tokens, out.rejected_prediction_tokens)
        assert counts == prediction_usage(ids, out.token_ids), name
        if name == "right":
            assert counts == (n, 0)
        if name == "longer":  # the answer, then tokens it never reaches
            assert ids[:n] == reference.token_ids and counts == (n, len(ids) - n)
        if name == "empty":
            assert counts == (0, 0)
        if name == "right" and speculation == "draft_model":  # free beside the draft model: drafted, and accepted
            assert out.sources.get("prediction", 0) > 0 and out.accepted_draft_tokens >= n // 2
    plain = bls.generate(PROMPT, max_tokens=4, temperature=0.0)
    assert plain.accepted_prediction_tokens is None  # no prediction, no counts


@pytest.mark.server
def test_a_bad_prediction_is_refused_naming_it_and_the_server_keeps_serving(bls):
    from trtspec.client import ClientError

    with pytest.raises(ClientError, match="prediction"):
        bls.generate(PROMPT, max_tokens=4, prediction="x" * 10**6)
    assert bls.generate(PROMPT, max_tokens=4, temperature=0.0).token_ids


@pytest.mark.server
@pytest.mark.parametrize("stream", [False, True])
def test_the_front_reports_prediction_usage_and_answers_as_without_it(client, tokenizer, stream):
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 30, "temperature": 0}
    reference = client.chat.completions.create(**kwargs)
    text = reference.choices[0].message.content
    for prediction in (text, "", text + " and more"):
        body = kwargs | {"extra_body": {"prediction": {"type": "content", "content": prediction}}}
        if stream:
            chunks = list(client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
            answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            out = client.chat.completions.create(**body)
            answer, usage = out.choices[0].message.content, out.usage
        assert answer == text
        ids = tokenizer(prediction, add_special_tokens=False)["input_ids"] if prediction else []
        details = usage.completion_tokens_details
        assert details is not None, usage
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == len(ids)
        if not prediction:
            assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)
    # /v1/completions takes it too, with OpenAI's array of text parts
    parts = [{"type": "text", "text": "def "}, {"type": "text", "text": "add"}]
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"prediction": {"type": "content", "content": parts}},
    )
    ids = tokenizer("def add", add_special_tokens=False)["input_ids"]
    details = out.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == len(ids)


def _engine_log_probs(bls, prompt_ids: list[int], output: list[int]) -> list[float]:
    """The target engine's own log probability of each output token: log softmax of its logits after the tokens
    before it (one engine call per position, generation logits on)."""
    values = []
    for i, token in enumerate(output):
        logits = bls.engine_logits(prompt_ids + output[:i]).astype(np.float64)
        shifted = logits - logits.max()
        values.append(float(shifted[token] - np.log(np.exp(shifted).sum())))
    return values


@pytest.mark.server
@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_the_engines_own(client, bls, tokenizer, stream):
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "logprobs": True}
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        out = client.chat.completions.create(**kwargs)
        entries, text = out.choices[0].logprobs.content, out.choices[0].message.content
    from jinja2 import Template
    from support.tiny import CHAT_TEMPLATE

    prompt = Template(CHAT_TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True)
    reference = bls.generate(prompt, max_tokens=12, temperature=0.0)
    assert text == reference.text
    assert [e.token for e in entries] == [tokenizer.decode([i]) for i in reference.token_ids]
    prompt_ids = tokenizer(prompt)["input_ids"]
    expected = _engine_log_probs(bls, prompt_ids, reference.token_ids)
    assert np.allclose([e.logprob for e in entries], expected, atol=1e-3)
    assert all(e.top_logprobs == [] for e in entries)

    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    lp = out.choices[0].logprobs
    reference = bls.generate(PROMPT, max_tokens=6, temperature=0.0)
    expected = _engine_log_probs(bls, tokenizer(PROMPT)["input_ids"], reference.token_ids)
    assert np.allclose(lp.token_logprobs, expected, atol=1e-3)
    assert "".join(lp.tokens) == out.choices[0].text and lp.text_offset[0] == 0


@pytest.mark.server
@pytest.mark.parametrize("stream", [False, True])
def test_the_fronts_penalties_count_the_answer_alone(client, bls, stream):
    """OpenAI's presence and frequency penalties count the tokens generated so far, not the prompt's: the front asks
    the BLS to skip the whole prompt (prompt_ignore_length), so its answer is the BLS's with that input, with the
    deployment's speculation as with the target alone, and not the answer of penalties that count the prompt."""
    from jinja2 import Template
    from support.tiny import CHAT_TEMPLATE

    penalties = {"presence_penalty": 1.5, "frequency_penalty": 0.75}
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "temperature": 0} | penalties
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    prompt = Template(CHAT_TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True)

    def bls_text(**more) -> str:
        return bls.generate(prompt, max_tokens=16, temperature=0.0, **more).text

    skip = {"prompt_ignore_length": 2**31 - 1}
    assert text == bls_text(**penalties, **skip) == bls_text(**penalties, **skip, num_draft_tokens=0)
    assert text != bls_text(**penalties)  # the prompt's tokens counted: another answer on this prompt
    assert text != bls_text()  # and the penalties changed the answer


@pytest.mark.server
@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),  # OpenAI's range: -2 to 2
        ({"logprobs": True, "top_logprobs": 2}, "top_logprobs"),
        ({"extra_body": {"prediction": {"type": "content", "content": 5}}}, "prediction.content"),
    ],
)
def test_what_the_front_cannot_honour_is_a_400_naming_it(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, **kwargs)
    assert err.value.param == param
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0).choices
