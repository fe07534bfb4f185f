"""NVIDIA's stock clients against a trtspec deployment: the tensor sets that tensorrtllm_backend's client scripts
send (inflight_batcher_llm_client.py to tensorrt_llm, end_to_end_grpc_client.py to ensemble and tensorrt_llm_bls,
e2e_grpc_speculative_decoding_client.py's client-side loop through preprocessing -> tensorrt_llm_draft ->
tensorrt_llm -> postprocessing, and speculative_decoding_test.py's comparison of that loop with the ensemble),
every input with the dtype and shape those scripts give it, through tritonclient against the real server."""

from __future__ import annotations

import queue
from functools import partial

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def unary_models(tmp_path_factory):
    """`trtspec deploy --decoupled-mode false`: engine models that answer unary calls."""
    from support.tiny import served_pair

    server = served_pair(tmp_path_factory.mktemp("clients-unary"), overrides={"decoupled_mode": False})
    server.start(timeout=300)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def default_models(tmp_path_factory):
    """The default deployment: decoupled engine models, which stream."""
    from support.tiny import served_pair

    server = served_pair(tmp_path_factory.mktemp("clients-default"))
    server.start(timeout=300)
    yield server
    server.stop()


def tensor(name: str, value) -> grpcclient.InferInput:
    arr = np.asarray(value)
    t = grpcclient.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
    t.set_data_from_numpy(arr)
    return t


def i32(v):
    return np.array([[v]], dtype=np.int32)


def f32(v):
    return np.array([[v]], dtype=np.float32)


def b(v):
    return np.array([[v]], dtype=bool)


def text(values):
    return np.array([[v.encode() for v in values]], dtype=object)


def unary(server, model: str, inputs: dict, **kw) -> dict:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        result = client.infer(model, [tensor(n, v) for n, v in inputs.items()], **kw)
    return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}


def streamed(server, model: str, inputs: dict, request_id: str = "") -> list:
    """Every response of one request over a gRPC stream (the stock e2e client's transport); errors are raised."""
    responses: queue.Queue = queue.Queue()

    def callback(q, result, error):
        q.put(error if error is not None else result)

    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=partial(callback, responses))
        client.async_stream_infer(
            model, [tensor(n, v) for n, v in inputs.items()], request_id=request_id, enable_empty_final_response=True
        )
        out = []
        while True:
            item = responses.get(timeout=120)
            if isinstance(item, InferenceServerException):
                client.stop_stream()
                raise item
            response = item.get_response()
            if response.outputs:
                out.append({o.name: item.as_numpy(o.name) for o in response.outputs})
            if response.parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    return out


def prompt_ids(server) -> tuple[list[int], int, int]:
    out = unary(server, "preprocessing", {"QUERY": text([PROMPT]), "REQUEST_OUTPUT_LEN": i32(16)})
    return out["INPUT_ID"][0].tolist(), int(out["OUT_END_ID"][0][0]), int(out["OUT_PAD_ID"][0][0])


def inflight_client_inputs(ids, end_id, pad_id, n=12, streaming=False) -> dict:
    """The ten inputs inflight_batcher_llm_client.py always sends, with its defaults."""
    return {
        "input_ids": np.array([ids], dtype=np.int32),
        "input_lengths": i32(len(ids)),
        "request_output_len": i32(n),
        "beam_width": i32(1),
        "temperature": f32(1.0),
        "streaming": b(streaming),
        "end_id": i32(end_id),
        "pad_id": i32(pad_id),
        "runtime_top_k": i32(1),
        "runtime_top_p": f32(0.0),
    }


# ---- inflight_batcher_llm_client.py -> tensorrt_llm ------------------------------------------------------------


def test_inflight_client_unary(unary_models):
    ids, end_id, pad_id = prompt_ids(unary_models)
    base = unary(
        unary_models, "tensorrt_llm", inflight_client_inputs(ids, end_id, pad_id), parameters={"Streaming": False}
    )
    assert base["output_ids"].shape[:2] == (1, 1) and base["output_ids"][0, 0, : len(ids)].tolist() == ids
    length = int(base["sequence_length"][0][0])
    new = base["output_ids"][0, 0, len(ids) : length].tolist()
    assert 0 < len(new) <= 12 and end_id not in new
    # every optional input it sends on a flag, at once
    extra = {
        "return_log_probs": b(True),
        "return_context_logits": b(True),
        "return_generation_logits": b(True),
        "return_num_input_tokens": b(True),
        "return_num_output_tokens": b(True),
        "exclude_input_in_output": b(True),
        "return_perf_metrics": b(True),
        "lora_task_id": np.array([[0]], dtype=np.uint64),
    }
    out = unary(unary_models, "tensorrt_llm", inflight_client_inputs(ids, end_id, pad_id) | extra)
    assert out["output_ids"][0, 0, : out["sequence_length"][0][0]].tolist() == new  # excluded input, same tokens
    assert out["output_log_probs"].shape == (1, 1, len(new)) and np.all(out["output_log_probs"] <= 0)
    assert out["cum_log_probs"][0][0] == pytest.approx(out["output_log_probs"].sum(), rel=1e-5)
    assert out["context_logits"].shape[:2] == (1, len(ids))
    assert out["generation_logits"].shape[:3] == (1, 1, len(new))
    assert (out["num_input_tokens"][0][0], out["num_output_tokens"][0][0]) == (len(ids), len(new))
    assert out["kv_cache_alloc_total_blocks"][0][0] >= 1 and out["arrival_time_ns"][0][0] > 0
    # the penalties change the answer, and the stop request it can send is refused by name (not supported)
    logged = inflight_client_inputs(ids, end_id, pad_id) | {"return_log_probs": b(True)}
    penalized = unary(
        unary_models,
        "tensorrt_llm",
        logged | {"repetition_penalty": f32(3.0), "presence_penalty": f32(1.0), "frequency_penalty": f32(1.0)},
    )
    assert (
        penalized["output_log_probs"].tolist()
        != unary(unary_models, "tensorrt_llm", logged)["output_log_probs"].tolist()
    )
    # its --num-return-sequences flag: TensorRT-LLM 1.2.x's backend would read it as noRepeatNgramSize
    with pytest.raises(InferenceServerException, match="num_return_sequences: .*noRepeatNgramSize"):
        unary(
            unary_models, "tensorrt_llm", inflight_client_inputs(ids, end_id, pad_id) | {"num_return_sequences": i32(1)}
        )
    with pytest.raises(InferenceServerException, match="stop"):
        unary(
            unary_models,
            "tensorrt_llm",
            {
                "input_ids": np.array([[1]], dtype=np.int32),
                "input_lengths": i32(0),
                "request_output_len": i32(0),
                "stop": b(True),
            },
        )


def test_unary_clients_need_decoupled_mode_false(default_models):
    """NVIDIA's e2e_grpc_speculative_decoding_client.py (and inflight_batcher_llm_client.py without --streaming)
    call tensorrt_llm with plain infer, which Triton refuses for a decoupled model, the default: those clients need
    `trtspec deploy --decoupled-mode false` (the unary_models tests above)."""
    ids, end_id, pad_id = prompt_ids(default_models)
    with pytest.raises(InferenceServerException, match="decoupled transaction policy"):
        unary(default_models, "tensorrt_llm", inflight_client_inputs(ids, end_id, pad_id))


def test_inflight_client_streaming_needs_decoupled_mode(unary_models, default_models):
    ids, end_id, pad_id = prompt_ids(unary_models)
    with pytest.raises(InferenceServerException, match="streaming"):
        streamed(unary_models, "tensorrt_llm", inflight_client_inputs(ids, end_id, pad_id, streaming=True))
    whole = unary(unary_models, "tensorrt_llm", inflight_client_inputs(ids, end_id, pad_id))
    length = int(whole["sequence_length"][0][0])
    expected = whole["output_ids"][0, 0, len(ids) : length].tolist()
    parts = streamed(
        default_models,
        "tensorrt_llm",
        inflight_client_inputs(ids, end_id, pad_id, streaming=True)
        | {"return_log_probs": b(True), "return_perf_metrics": b(True)},
    )
    tokens = [t for p in parts for t in p["output_ids"][0, 0, : p["sequence_length"][0][0]].tolist()]
    assert tokens == expected and len(parts) >= len(expected)  # one response per token (+ the final one)
    assert all("kv_cache_alloc_total_blocks" in p for p in parts)  # perf metrics on every response
    # the log probs of every token so far with each response, as TensorRT-LLM streams them (createResult)
    so_far = np.cumsum([int(p["sequence_length"][0][0]) for p in parts]).tolist()
    assert [p["output_log_probs"].shape[-1] for p in parts] == so_far and so_far[-1] == len(expected)
    # and non-streaming requests to the default_models model still get one answer
    single = streamed(default_models, "tensorrt_llm", inflight_client_inputs(ids, end_id, pad_id))
    assert [p["output_ids"].tolist() for p in single] == [whole["output_ids"].tolist()]


# ---- end_to_end_grpc_client.py -> ensemble / tensorrt_llm_bls --------------------------------------------------


def e2e_inputs(output_len=16, stream=False, **flags) -> dict:
    """What end_to_end_grpc_client.py sends (run_inference), and speculative_decoding_test.py's control call."""
    inputs = {
        "text_input": text([PROMPT]),
        "max_tokens": i32(output_len),
        "stream": b(stream),
        "beam_width": i32(1),
        "temperature": f32(1.0),
        "exclude_input_in_output": b(False),
        "embedding_bias_words": np.empty((1, 0), dtype=object),
        "embedding_bias_weights": np.empty((1, 0), dtype=np.float32),
    }
    return inputs | flags


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_end_to_end_client(default_models, model):
    (answer,) = streamed(default_models, model, e2e_inputs())
    assert answer["text_output"].shape == (1,)  # flat: the client reads text_output[0]
    text_output = answer["text_output"][0].decode()
    assert text_output.startswith(PROMPT) and len(text_output) > len(PROMPT)
    flags = {
        "bad_words": text(["xyz"]),
        "stop_words": text(["."]),
        "repetition_penalty": f32(1.1),
        "presence_penalty": f32(0.1),
        "frequency_penalty": f32(0.1),
        "return_log_probs": b(True),
        "return_context_logits": b(True),
        "return_generation_logits": b(True),
        "return_perf_metrics": b(True),
        "end_id": i32(0),
        "pad_id": i32(1),
    }
    (full,) = streamed(default_models, model, e2e_inputs(**flags))
    assert full["output_log_probs"].ndim == 3 and full["cum_log_probs"].shape == (1, 1)
    assert full["generation_logits"].shape[2] == full["output_log_probs"].shape[2]
    for name in ("kv_cache_alloc_new_blocks", "first_token_time_ns", "acceptance_rate", "total_draft_tokens"):
        assert full[name].shape == (1, 1), name


def test_ensemble_and_bls_agree_as_speculative_decoding_test_checks(default_models):
    """speculative_decoding_test.py --execute-bls-speculative-decoding: the same text from both."""
    (control,) = streamed(default_models, "ensemble", e2e_inputs(output_len=20))
    (spec,) = streamed(
        default_models,
        "tensorrt_llm_bls",
        e2e_inputs(output_len=20, num_draft_tokens=i32(3), use_draft_logits=b(False), return_perf_metrics=b(True)),
    )
    assert spec["text_output"][0] == control["text_output"][0]
    assert spec["total_draft_tokens"][0][0] > 0


def test_streaming_through_the_ensemble_and_the_bls(default_models):
    whole = streamed(default_models, "ensemble", e2e_inputs(output_len=12))[0]["text_output"][0].decode()
    for model in ("ensemble", "tensorrt_llm_bls"):
        parts = streamed(default_models, model, e2e_inputs(output_len=12, stream=True, return_perf_metrics=b(True)))
        assert len(parts) > 2
        assert PROMPT + "".join(p["text_output"][0].decode() for p in parts) == whole, model
        assert all("first_token_time_ns" in p for p in parts), model


def test_a_batch_through_the_decoupled_ensemble(unary_models, default_models):
    """end_to_end_grpc_client.py --batch-inputs: rows concatenated on axis 0; each row answered on its own, placed
    by batch_index. A batch needs decoupled engine models, as TensorRT-LLM's backend requires."""
    prompts = [PROMPT, "Once upon a time"]
    single = [
        streamed(default_models, "ensemble", e2e_inputs(output_len=8) | {"text_input": text([p])})[0]["text_output"][0]
        for p in prompts
    ]
    batch = {name: np.concatenate([v, v]) for name, v in e2e_inputs(output_len=8).items()}
    batch["text_input"] = np.array([[p.encode()] for p in prompts], dtype=object)
    parts = streamed(default_models, "ensemble", batch)
    assert sorted(int(p["batch_index"][0][0]) for p in parts) == [0, 1]
    assert {int(p["batch_index"][0][0]): p["text_output"][0] for p in parts} == dict(enumerate(single))
    with pytest.raises(InferenceServerException, match="batch of 2 requests needs a decoupled model"):
        streamed(unary_models, "ensemble", batch)


@pytest.mark.parametrize(
    "name,value",
    [
        ("embedding_bias_words", text(["fox"])),
        ("beam_width", i32(2)),
        ("num_return_sequences", i32(2)),
        ("guided_decoding_guide_type", text(["json"])),
        ("lora_task_id", np.array([[3]], dtype=np.uint64)),
    ],
)
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_what_cannot_be_served_is_refused_by_name(default_models, model, name, value):
    with pytest.raises(
        InferenceServerException, match=name.upper() if model == "ensemble" and name.startswith("embedding") else name
    ):
        streamed(default_models, model, e2e_inputs(**{name: value}))
    assert streamed(default_models, model, e2e_inputs(output_len=2))  # and the server keeps serving


# ---- e2e_grpc_speculative_decoding_client.py: the loop on the client side ---------------------------------------


def client_side_speculation(server, output_len: int, num_draft_tokens: int, stop_words=(), bad_words=()) -> str:
    """The stock client's loop, as its tensors go: draft num_draft_tokens with the draft model, verify them with
    the target, until the output length, an unchanged output (the end token) or a stop word."""
    pre = {"QUERY": text([PROMPT]), "REQUEST_OUTPUT_LEN": i32(output_len)}
    if stop_words:
        pre["STOP_WORDS_DICT"] = text(stop_words)
    if bad_words:
        pre["BAD_WORDS_DICT"] = text(bad_words)
    p = unary(server, "preprocessing", pre)
    input_ids = p["INPUT_ID"].squeeze(0).astype(np.int32)
    bad, stop = p["BAD_WORDS_IDS"].astype(np.int32), p["STOP_WORDS_IDS"].astype(np.int32)
    assert bad.shape[:2] == stop.shape[:2] == (1, 2)
    common = {
        "bad_words_list": bad,
        "stop_words_list": stop,
        "beam_width": i32(1),
        "temperature": f32(1.0),
        "end_id": p["OUT_END_ID"].astype(np.int32),
        "pad_id": p["OUT_PAD_ID"].astype(np.int32),
    }
    prompt_len, last = len(input_ids), None
    while True:
        draft = unary(
            server,
            "tensorrt_llm_draft",
            {
                "input_ids": input_ids[None],
                "input_lengths": i32(len(input_ids)),
                "request_output_len": i32(num_draft_tokens),
            }
            | common,
        )
        draft_ids = draft["output_ids"].squeeze(axis=(0, 1))
        draft_tokens = draft_ids[len(input_ids) : int(draft["sequence_length"][0][0])]
        target_in = {
            "input_ids": input_ids[None],
            "input_lengths": i32(len(input_ids)),
            "request_output_len": i32(len(draft_tokens) + 1),
        } | common
        if len(draft_tokens):
            target_in["draft_input_ids"] = draft_tokens[None].astype(np.int32)
        target = unary(server, "tensorrt_llm", target_in)
        assert target["sequence_length"].shape == (1, 1)
        last, input_ids = input_ids, target["output_ids"].squeeze(axis=(0, 1))
        if len(input_ids) >= prompt_len + output_len or np.array_equal(last, input_ids):
            break
        if any(len(w) and np.array_equal(input_ids[-len(w) :], w) for w in _words(stop)):
            break
    post = unary(
        server,
        "postprocessing",
        {"TOKENS_BATCH": input_ids[None, None].astype(np.int32), "SEQUENCE_LENGTH": i32(len(input_ids))},
    )
    assert post["OUTPUT"].shape == (1,)
    return post["OUTPUT"][0].decode()


def _words(word_list: np.ndarray) -> list[np.ndarray]:
    ids, ends = word_list[0]
    out, start = [], 0
    for end in ends:
        if end < 0:
            break
        out.append(ids[start:end])
        start = end
    return out


@pytest.mark.parametrize("k", [1, 4])
def test_client_side_speculation_equals_the_ensemble(unary_models, k):
    """speculative_decoding_test.py's default mode: the client-side loop's text equals the ensemble's."""
    control = streamed(unary_models, "ensemble", e2e_inputs(output_len=20))[0]["text_output"][0].decode()
    assert client_side_speculation(unary_models, 20, k)[: len(control)] == control


def test_client_side_speculation_with_word_lists(unary_models):
    control = streamed(
        unary_models, "ensemble", e2e_inputs(output_len=16, bad_words=text(["the"]), stop_words=text(["."]))
    )
    got = client_side_speculation(unary_models, 16, 3, stop_words=["."], bad_words=["the"])
    assert got[: len(control[0]["text_output"][0].decode())] == control[0]["text_output"][0].decode()
