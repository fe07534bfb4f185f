"""The rules of TensorRT-LLM's `tensorrtllm` backend that the embedded engine once did not enforce, checked on the
strict stand-in (tests/support/tensorrtllm_standin.py) under the engine configs `trtspec deploy` writes for TensorRT
engines, through the real tritonserver: what would have broken the first run on a GPU."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_serving import grpc_generate, ids_of

from trtspec.client import ClientError, SpecClient
from trtspec.contract import PERF_OUTPUTS, GenerationRequest, SamplingParams, request_to_tensors

PROMPT = "The quick brown fox"


def _serve(root, name: str, edit=None):
    from support.standin_repo import write_standin_repository
    from support.tiny import served_pair

    def write(config, engines, repo, overrides):
        return write_standin_repository(config, engines, repo, edit=edit, overrides=overrides)

    return served_pair(root / name, write=write)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("standin")


@pytest.fixture(scope="module")
def server(root):
    server = _serve(root, "repo")
    server.start(timeout=300)
    yield server
    server.stop()


def _infer(server, request: GenerationRequest, outputs=None, model="tensorrt_llm"):
    with SpecClient(server.grpc_url, "grpc") as client:
        return client.infer(model, request_to_tensors(request), outputs)


@pytest.mark.server
def test_the_engine_model_does_not_load_without_the_parameters_the_backend_requires(root):
    from trtspec.server import ServerError

    broken = _serve(
        root,
        "no-tokenizer-dir",
        edit=lambda text: "\n".join(line for line in text.splitlines() if '"tokenizer_dir"' not in line),
    )
    with pytest.raises(ServerError, match="Cannot find parameter with name: tokenizer_dir"):
        broken.start(timeout=300)


def test_perf_outputs_come_only_when_asked_and_then_all_of_them(server):
    prompt = [5, 6, 7, 8]
    plain = _infer(server, GenerationRequest(prompt, 3, draft_input_ids=[1, 2]))
    assert set(plain) == {"output_ids", "sequence_length"}
    perf = _infer(server, GenerationRequest(prompt, 3, draft_input_ids=[1, 2], return_perf_metrics=True))
    assert set(perf) == {"output_ids", "sequence_length", *(t.name for t in PERF_OUTPUTS)}
    assert int(perf["total_draft_tokens"].reshape(-1)[0]) == 2


def test_output_ids_and_sequence_length_must_be_requested(server):
    with pytest.raises(ClientError, match="output_ids tensor must be present"):
        _infer(server, GenerationRequest([5, 6, 7], 2), outputs=["sequence_length"])


def test_top_k_0_with_top_p_0_is_greedy_as_in_tensorrt_llm(server):
    prompt = [5, 6, 7, 8, 9]
    greedy = _infer(server, GenerationRequest(prompt, 12))["output_ids"].reshape(-1).tolist()
    for seed in (1, 2, 3):
        hot = GenerationRequest(prompt, 12, sampling=SamplingParams(temperature=1.5, top_k=0, top_p=0.0, seed=seed))
        assert _infer(server, hot)["output_ids"].reshape(-1).tolist() == greedy


def test_the_bls_reads_sampling_fields_as_tensorrt_llm(server):
    """The BLS passes temperature, top_k and top_p on as NVIDIA's does: a temperature alone (top_k 0, top_p 0) is
    greedy, as the ensemble's answer to the same fields is; top_p 1.0 samples from the whole distribution. (A fixed
    draft length: a seed reproduces a sampled output where the calls are the same, and the adaptive length chooses
    them from measured timings.)"""
    greedy = ids_of(grpc_generate(server.grpc_url, {"text_input": PROMPT, "max_tokens": 12}))
    hot = {"text_input": PROMPT, "max_tokens": 12, "temperature": 1.5, "adaptive_draft_length": False}
    assert ids_of(grpc_generate(server.grpc_url, hot | {"seed": 1})) == greedy
    sampled = [ids_of(grpc_generate(server.grpc_url, hot | {"top_p": 1.0, "seed": s})) for s in (1, 2, 3)]
    assert any(s != greedy for s in sampled)
    again = ids_of(grpc_generate(server.grpc_url, hot | {"top_p": 1.0, "seed": 1}))
    assert again == sampled[0]  # a seed reproduces


def test_acceptance_does_not_depend_on_optional_outputs(server):
    out = grpc_generate(
        server.grpc_url,
        {
            "text_input": PROMPT,
            "max_tokens": 24,
            "num_draft_tokens": 3,
            "adaptive_draft_length": False,
            "return_perf_metrics": True,
        },
    )
    drafted, accepted = (
        int(np.asarray(out[-1][n]).reshape(-1)[0]) for n in ("total_draft_tokens", "total_accepted_draft_tokens")
    )
    assert drafted > 0 and 0 < accepted <= drafted


@pytest.mark.server
def test_logits_of_another_dtype_than_declared_fail_the_response(root):
    def fp16(text):  # NVIDIA's ${logits_datatype}: both logits outputs
        for name in ("context_logits", "generation_logits"):
            text = text.replace(f'name: "{name}" data_type: TYPE_FP32', f'name: "{name}" data_type: TYPE_FP16')
        return text

    server = _serve(root, "fp16-logits", edit=fp16)
    ensemble = server.repo / "ensemble" / "config.pbtxt"  # Triton refuses an ensemble whose steps disagree on a dtype
    ensemble.write_text(fp16(ensemble.read_text()))
    server.start(timeout=300)
    try:
        with pytest.raises(ClientError, match="logits of the engine are float32"):
            _infer(server, GenerationRequest([5, 6, 7], 2, return_generation_logits=True))
        assert set(_infer(server, GenerationRequest([5, 6, 7], 2))) == {"output_ids", "sequence_length"}
    finally:
        server.stop()


@pytest.mark.server
def test_unary_engine_models_refuse_streaming_and_the_bls_still_streams(root):
    """`trtspec deploy --decoupled-mode false` on the stand-in: the backend refuses `streaming` on a model that is
    not decoupled ("Streaming is only supported if model is deployed using decoupled mode.", utils.cc), so a
    streamed BLS request asks the target for one token per call, and its tokens are the same."""
    from support.standin_repo import write_standin_repository
    from support.tiny import served_pair

    server = served_pair(
        root / "unary",
        write=lambda config, engines, repo, overrides: write_standin_repository(
            config, engines, repo, overrides={"decoupled_mode": False}
        ),
    )
    server.start(timeout=300)
    try:
        request = GenerationRequest(input_ids=[5, 9, 23], request_output_len=4, end_id=-1)
        tensors = request_to_tensors(request) | {"streaming": np.ones((1, 1), np.bool_)}
        with SpecClient(server.grpc_url, "grpc") as client, pytest.raises(ClientError, match="decoupled"):
            client.infer("tensorrt_llm", tensors)
        with SpecClient(server.grpc_url, "grpc") as client:
            whole = client.generate(PROMPT, max_tokens=12, num_draft_tokens=0, end_id=-1)
            streamed = client.generate(PROMPT, max_tokens=12, num_draft_tokens=0, end_id=-1, stream=True)
        assert streamed.token_ids == whole.token_ids and len([c for c in streamed.chunks if c.token_ids]) == 12
    finally:
        server.stop()


@pytest.mark.parametrize("draft", [0, 3])
def test_a_streamed_request_gets_each_tokens_own_log_prob(server, draft):
    """The stand-in streams the log probs of every token so far with each response, as TensorRT-LLM does
    (llmRequest.cpp createResult, 89fd9b74: logProbs unsliced); the BLS takes each token's own, so a streamed
    request's log probs are the unstreamed ones."""
    fields = {"text_input": PROMPT, "max_tokens": 12, "num_draft_tokens": draft, "return_log_probs": True}
    whole = grpc_generate(server.grpc_url, fields)
    streamed = grpc_generate(server.grpc_url, fields | {"stream": True})

    def log_probs(responses):
        return [float(v) for r in responses for v in np.asarray(r.get("output_log_probs", [])).reshape(-1)]

    assert ids_of(streamed) == ids_of(whole) and len(log_probs(whole)) == len(ids_of(whole)) > 1
    np.testing.assert_allclose(log_probs(streamed), log_probs(whole), atol=1e-5)


def test_a_stopped_call_sends_no_token_of_the_step_it_was_in(server):
    """TensorRT-LLM ends a cancelled request after the step in flight and clears its tokens (forwardSync:
    clearGeneratedTokens, trtGptModelInflightBatching.cpp b35ac1b6): a stopped streaming call's last response holds
    no token, what it streamed before is the unstopped call's beginning, and a stopped unary call answers with no
    generated token at all (llmRequest.cpp createResult, 89fd9b74)."""
    from test_engine_isolation import engine_call, engine_tensors, stop

    prompt = engine_tensors()["input_ids"].reshape(-1).tolist()
    call = engine_call(server, engine_tensors(output_len=200, streaming=True), "stopped-stream")
    try:
        call.first()
        for _ in range(3):
            call.next()
        stop(server, "stopped-stream")
        parts = call.rest()
    finally:
        call.close()
    counts = [int(p["sequence_length"].reshape(-1)[0]) for p in parts]
    assert counts[-1] == 0 and all(n == 1 for n in counts[:-1]) and len(counts) > 4
    tokens = [int(t) for p in parts for t in p["output_ids"].reshape(-1)]
    whole = _infer(server, GenerationRequest(prompt, len(tokens), end_id=-1))["output_ids"].reshape(-1).tolist()
    assert tokens == whole[len(whole) - len(tokens) :]

    answers = []
    for i, wait in enumerate((0.2, 0.1, 0.05, 0.02)):  # until a stop finds the call running
        call = engine_call(server, engine_tensors(output_len=200), f"stopped-unary-{i}")
        try:
            time.sleep(wait)
            stop(server, f"stopped-unary-{i}")
            (answer,) = call.rest()
        finally:
            call.close()
        ids = answer["output_ids"].reshape(-1)[: int(answer["sequence_length"].reshape(-1)[0])].tolist()
        answers.append(len(ids) - len(prompt) if ids[: len(prompt)] == prompt else len(ids))
        if answers[-1] < 200:
            break
    # a call the stop found running answers with no generated token (the prompt, or nothing where the input is
    # excluded); one that ended first has all 200
    assert answers[-1] == 0 and all(n in (0, 200) for n in answers), answers
