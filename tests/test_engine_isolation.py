"""Clients that share the engines cannot reach each other's calls, through the real tritonserver: a client's request
id never names an engine call (the BLS gives each call an id of its own), and the engines' waiting queues are
bounded (max_queue_size), so a flood of direct calls is refused at once while the server keeps serving. Each test
runs on the embedded engine models and on the strict stand-in of TensorRT-LLM's backend."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from test_serving import BLS, BLS_TYPES, PROMPTS, ids_of
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from trtspec.contract import GenerationRequest, request_to_tensors

MAX_QUEUE_SIZE = 1  # with the engines' max_batch_size 2: two calls run, one waits, the next is refused


@pytest.fixture(scope="module", params=["embedded", "tensorrtllm-standin"])
def server(tmp_path_factory, request):
    server = _served(tmp_path_factory.mktemp("isolation"), request.param)
    server.start(timeout=300)
    yield server
    server.stop()


def test_a_client_that_leaves_does_not_end_another_client_s_answer_with_the_same_id(server):
    """Two clients give their requests the same id ("1", as clients that number their requests do). A is in the
    middle of a long streamed plain stretch when B starts, so B's engine call is the latest to carry "1" if the BLS
    passes clients' ids on; A then leaves, and the BLS stops A's call. B still gets its whole answer, the one it
    gets alone. (Were the client's id the engine call's, A's stop would end B's call: the backend's stop cancels the
    latest call with the id, and B's answer would end early, as if on the end token.)"""
    fields = {"text_input": PROMPTS[0], "max_tokens": 400, "end_id": -1, "num_draft_tokens": 0, "stream": True}
    alone_call = bls_call(server, fields, "1")
    try:
        alone = ids_of(alone_call.rest())
    finally:
        alone_call.close()
    assert len(alone) == 400

    a = bls_call(server, fields | {"max_tokens": 480}, "1")
    b = None
    try:
        a.first()  # A's engine call is running
        b = bls_call(server, fields, "1")
        b.first()  # and B's, started after it
        a.close(cancel=True)  # A leaves
        assert ids_of(b.rest()) == alone
    finally:
        if b is not None:
            b.close()
        if not a.done:
            a.close(cancel=True)


def test_a_full_engine_queue_refuses_at_once_and_the_server_keeps_serving(server):
    """max_queue_size bounds the calls that wait for a batch slot, as TensorRT-LLM's executor bounds its queue: a
    request whose rows would pass it is refused at once (the embedded engine names max_queue_size; the backend says
    "Maximum queue size of N has been reached, please try again later"). The BLS's own call refused so is the
    server's failure, not the client's: the BLS says the engine is busy (the OpenAI front answers it 503) and counts
    an engine error, not a bad request; once the queue has room it serves again."""
    from trtspec.client import ClientError, SpecClient
    from trtspec.openai_api.errors import bls_error
    from trtspec.openai_api.protocol import COMPLETION, Request

    refusal = _refusal(server)
    batch = engine_call(server, engine_tensors(rows=2, output_len=4), "two-rows")
    with pytest.raises(InferenceServerException, match=refusal):  # more rows than the queue holds: never queued
        batch.rest()
    batch.close()

    errors = {kind: bls_errors(server, kind) for kind in ("engine_error", "bad_request")}
    fields = {"text_input": PROMPTS[0], "max_tokens": 8, "end_id": -1, "num_draft_tokens": 0}
    with full_queue(server):
        call = bls_call(server, fields, "client-1")
        with pytest.raises(InferenceServerException, match=f"tensorrt_llm is busy: .*{refusal}"):
            call.rest()
        call.close()
        # the front's path (HTTP generate): its client's error, as the front reads it
        with SpecClient(server.http_url, "http") as client, pytest.raises(ClientError) as refused:
            client.generate(PROMPTS[0], max_tokens=8, end_id=-1, num_draft_tokens=0)
        assert bls_error(refused.value, Request(kind=COMPLETION, model="tiny")).status == 503
    assert bls_errors(server, "engine_error") == errors["engine_error"] + 2
    assert bls_errors(server, "bad_request") == errors["bad_request"]
    call = bls_call(server, fields, "client-1")  # a retry, once the queue has room
    try:
        assert len(ids_of(call.rest())) == 8
    finally:
        call.close()


# ---- helpers ---------------------------------------------------------------------------------------------------


def _served(root, backend: str, decoupled: bool = True):
    from support.standin_repo import write_standin_repository
    from support.tiny import served_pair

    def standin(config, engines, repo, overrides):
        return write_standin_repository(config, engines, repo, overrides=overrides)

    return served_pair(
        root,
        max_input_len=1024,  # room for calls long enough to hold the batch slots while a test looks
        engine={"max_batch_size": 2},
        overrides={"max_queue_size": MAX_QUEUE_SIZE, "decoupled_mode": decoupled},
        write=None if backend == "embedded" else standin,
    )


def _refusal(server) -> str:
    config = (server.repo / "tensorrt_llm" / "config.pbtxt").read_text()
    if "gpt_model_path" in config:  # the stand-in, under the TensorRT-LLM engine config
        return f"Maximum queue size of {MAX_QUEUE_SIZE} has been reached"
    return f"max_queue_size {MAX_QUEUE_SIZE}"


@contextlib.contextmanager
def full_queue(server):
    """Every batch slot of the target taken and its queue full (direct calls, stopped by their ids after)."""
    ids = ["running-0", "running-1", "waiting"]
    calls = []
    try:
        for request_id in ids[:2]:
            calls.append(engine_call(server, engine_tensors(streaming=True), request_id))
            calls[-1].first()
        calls.append(engine_call(server, engine_tensors(), ids[2]))
        with pytest.raises(queue.Empty):  # waiting, not refused
            calls[-1].responses.get(timeout=0.5)
        yield
    finally:
        for call, request_id in zip(calls, ids, strict=False):
            stop(server, request_id)
            call.rest()
            call.close()


def bls_errors(server, kind: str) -> float:
    time.sleep(0.3)
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("trtspec_request_errors_total{") and f'kind="{kind}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


class Call:
    """One request to a model over gRPC: on a stream of its own (a decoupled model's responses arrive on it), or,
    `unary`, as one infer on a thread of its own; its responses arrive on `responses`."""

    def __init__(self, url: str, model: str, inputs: list, request_id: str, unary: bool = False):
        self.responses: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.unary = unary
        self.parts: list[dict] = []
        self.done = False
        if unary:

            def infer():
                try:
                    self.responses.put((self.client.infer(model, inputs, request_id=request_id), None))
                except InferenceServerException as exc:
                    self.responses.put((None, exc))

            threading.Thread(target=infer, daemon=True).start()
        else:
            self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))
            self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)

    def next(self, timeout: float = 120) -> bool:
        """Read one response into `parts` (raising its error); False once the final one was read."""
        result, error = self.responses.get(timeout=timeout)
        if error is not None:
            self.done = True
            raise error
        response = result.get_response()
        if response.outputs:
            self.parts.append({o.name: result.as_numpy(o.name) for o in response.outputs})
        self.done = self.unary or response.parameters["triton_final_response"].bool_param
        return not self.done

    def first(self) -> None:
        """Wait for the first response with tokens."""
        while not self.parts and self.next():
            pass

    def rest(self) -> list[dict]:
        while not self.done and self.next():
            pass
        return self.parts

    def close(self, cancel: bool = False) -> None:
        if not self.unary:
            self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def bls_call(server, fields: dict, request_id: str) -> Call:
    inputs = []
    for name, value in fields.items():
        spec = BLS_TYPES[name]
        if spec.dtype == "STRING":
            arr = np.asarray([[str(value).encode()]], dtype=np.object_)
        else:
            arr = np.asarray([[value]]).astype(spec.np_dtype)
        tensor = grpcclient.InferInput(name, list(arr.shape), "BYTES" if spec.dtype == "STRING" else spec.dtype)
        tensor.set_data_from_numpy(arr)
        inputs.append(tensor)
    return Call(server.grpc_url, BLS, inputs, request_id)


def engine_call(server, tensors: dict[str, np.ndarray], request_id: str, unary: bool = False) -> Call:
    inputs = []
    for name, value in tensors.items():
        tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return Call(server.grpc_url, "tensorrt_llm", inputs, request_id, unary=unary)


def engine_tensors(rows: int = 1, output_len: int = 2000, streaming: bool = False) -> dict[str, np.ndarray]:
    one = request_to_tensors(GenerationRequest(input_ids=[5, 9, 23, 7], request_output_len=output_len, end_id=-1))
    tensors = {name: np.repeat(value, rows, axis=0) for name, value in one.items()}
    if streaming:
        tensors["streaming"] = np.ones((rows, 1), np.bool_)
    return tensors


def stop(server, request_id: str, unary: bool = False) -> None:
    """NVIDIA's send_cancellation_request: stop true with the id of the call to stop."""
    tensors = {
        "input_ids": np.zeros((1, 1), np.int32),
        "input_lengths": np.zeros((1, 1), np.int32),
        "request_output_len": np.zeros((1, 1), np.int32),
        "stop": np.ones((1, 1), np.bool_),
    }
    call = engine_call(server, tensors, request_id, unary=unary)
    try:
        call.rest()
    finally:
        call.close()
