"""The deployed repository on a real tritonserver: the engine models answer as the in-process engine does, the
ensemble detokenizes the greedy decode, and a bad request gets an error without harming the next one."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from trtspec.contract import GenerationRequest, request_to_tensors
from trtspec.engine.runtime import Engine

PROTOCOLS = {"http": httpclient, "grpc": grpcclient}
COMPARED = ("output_ids", "sequence_length", "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")


@pytest.fixture(scope="module")
def engines(built_fp8):
    """The same engine dirs, loaded in this process (their own prefix caches)."""
    return {
        "tensorrt_llm": Engine.load(built_fp8.target, "cpu"),
        "tensorrt_llm_draft": Engine.load(built_fp8.draft, "cpu"),
    }


@pytest.fixture(scope="module")
def tokenizer(built_fp8):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(built_fp8.target))


@pytest.fixture(params=sorted(PROTOCOLS))
def client(request, triton_server):
    module = PROTOCOLS[request.param]
    c = module.InferenceServerClient(triton_server.http_url if request.param == "http" else triton_server.grpc_url)
    c.module = module
    yield c
    c.close()


def infer(client, model: str, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    inputs = []
    for name, value in tensors.items():
        value = np.asarray(value)
        tensor = client.module.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    result = client.infer(model, inputs)
    response = result.get_response()
    names = (
        [o["name"] for o in response["outputs"]] if isinstance(response, dict) else [o.name for o in response.outputs]
    )
    return {name: result.as_numpy(name) for name in names}


def text(value: str | list[str]) -> np.ndarray:
    rows = [value] if isinstance(value, str) else value
    return np.array([[r.encode()] for r in rows], dtype=np.object_)


def test_engine_models_answer_as_the_in_process_engine(client, engines):
    prompt = [11, 42, 7, 99, 3, 250, 18]
    draft_req = GenerationRequest(input_ids=prompt, request_output_len=3, end_id=-1, return_perf_metrics=True)
    drafted = infer(client, "tensorrt_llm_draft", request_to_tensors(draft_req))
    local_draft = engines["tensorrt_llm_draft"].serve(request_to_tensors(draft_req))
    for name in COMPARED:
        np.testing.assert_array_equal(drafted[name], local_draft[name], err_msg=name)
    draft_tokens = drafted["output_ids"][0, 0, len(prompt) :].tolist()
    assert len(draft_tokens) == 3

    # verify: prompt + draft through the target, accepted inside the engine
    verify = request_to_tensors(
        GenerationRequest(
            input_ids=prompt, request_output_len=8, draft_input_ids=draft_tokens, end_id=-1, return_perf_metrics=True
        )
    )
    served, local = infer(client, "tensorrt_llm", verify), engines["tensorrt_llm"].serve(verify)
    for name in COMPARED:
        np.testing.assert_array_equal(served[name], local[name], err_msg=name)
    assert served["output_ids"].dtype == np.int32 and served["output_ids"].shape[:2] == (1, 1)
    assert served["total_draft_tokens"].item() == 3
    assert 1 <= served["sequence_length"].item() - len(prompt) <= 4

    # plain generation with a logits request
    plain = request_to_tensors(
        GenerationRequest(input_ids=prompt, request_output_len=5, end_id=-1, return_generation_logits=True)
    )
    served, local = infer(client, "tensorrt_llm", plain), engines["tensorrt_llm"].serve(plain)
    np.testing.assert_array_equal(served["output_ids"], local["output_ids"])
    np.testing.assert_allclose(served["generation_logits"], local["generation_logits"], rtol=1e-4, atol=1e-4)
    assert served["generation_logits"].shape == (1, 1, 5, engines["tensorrt_llm"].info.vocab_size)


def test_ensemble_returns_the_detokenized_greedy_decode(client, engines, tokenizer):
    prompts, max_tokens = ["The quick brown fox", "Triton serves"], [6, 4]
    expected = []
    for prompt, n in zip(prompts, max_tokens):
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        result = engines["tensorrt_llm"].generate(GenerationRequest(input_ids=ids, request_output_len=n))
        expected.append(tokenizer.decode(result.output_ids, skip_special_tokens=True))

    out = infer(
        client, "ensemble", {"text_input": text(prompts[0]), "max_tokens": np.array([[max_tokens[0]]], np.int32)}
    )
    assert out["text_output"].reshape(-1)[0].decode() == expected[0]
    # a batch of two prompts needs decoupled engine models, as TensorRT-LLM's backend (tests/test_nvidia_clients.py)
    with pytest.raises(InferenceServerException, match="a batch of 2 requests needs a decoupled model"):
        infer(
            client,
            "ensemble",
            {"text_input": text(prompts), "max_tokens": np.array([[n] for n in max_tokens], np.int32)},
        )
    out = infer(
        client, "ensemble", {"text_input": text(prompts[1]), "max_tokens": np.array([[max_tokens[1]]], np.int32)}
    )
    assert out["text_output"].reshape(-1)[0].decode() == expected[1]


def test_ensemble_options_and_the_generate_endpoint(triton_server, engines, tokenizer):
    prompt = "Once upon a time"
    ids = tokenizer.encode(prompt)
    new = engines["tensorrt_llm"].generate(GenerationRequest(input_ids=ids, request_output_len=5)).new_tokens
    body = {"text_input": prompt, "max_tokens": 5, "exclude_input_in_output": True, "temperature": 0.0}
    request = urllib.request.Request(
        f"{triton_server.http_base_url}/v2/models/ensemble/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=30) as response:
        answer = json.loads(response.read())
    assert answer["text_output"] == tokenizer.decode(new, skip_special_tokens=True)


def test_a_bad_request_gets_an_error_and_the_model_keeps_serving(client, engines):
    bad = request_to_tensors(GenerationRequest(input_ids=[5, 100000, 6], request_output_len=3))
    with pytest.raises(
        InferenceServerException, match=r"tensorrt_llm: input_ids: token id 100000 is outside the vocabulary"
    ):
        infer(client, "tensorrt_llm", bad)
    too_many = request_to_tensors(GenerationRequest(input_ids=[5, 6], request_output_len=9, draft_input_ids=[1] * 9))
    with pytest.raises(
        InferenceServerException, match=r"draft_input_ids: 9 draft tokens exceed the engine's max_draft_len 4"
    ):
        infer(client, "tensorrt_llm", too_many)
    with pytest.raises(InferenceServerException, match=r"request_output_len"):
        infer(client, "ensemble", {"text_input": text("hello"), "max_tokens": np.array([[0]], np.int32)})

    good = request_to_tensors(GenerationRequest(input_ids=[5, 6, 7], request_output_len=3, end_id=-1))
    np.testing.assert_array_equal(
        infer(client, "tensorrt_llm", good)["output_ids"], engines["tensorrt_llm"].serve(good)["output_ids"]
    )


def test_bad_request_status_is_400_over_http(triton_server):
    with httpclient.InferenceServerClient(triton_server.http_url) as c:
        tensors = request_to_tensors(GenerationRequest(input_ids=[-3], request_output_len=2))
        inputs = []
        for name, value in tensors.items():
            t = httpclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
            t.set_data_from_numpy(value)
            inputs.append(t)
        with pytest.raises(InferenceServerException) as err:
            c.infer("tensorrt_llm", inputs)
        assert err.value.status() == "400"
