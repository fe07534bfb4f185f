"""What the BLS's engine calls cost and how they end, on the strict stand-in of TensorRT-LLM's backend through the real
tritonserver: each call asks for its new tokens alone (TensorRT-LLM's `exclude_input_in_output`), so a response does not
carry the sequence again; no call or response is kept once read, so many long requests leave the BLS's shared memory
where it was; and a stop that reaches the engine before its call (tests/support/late_engine.py takes long calls in late)
still ends that call, which would otherwise run its whole budget."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from test_serving import grpc_generate

from trtspec.client import SpecClient
from trtspec.contract import GenerationRequest, request_to_tensors

LATE_ENGINE = Path(__file__).parent / "support" / "late_engine.py"
CALLS = "CALLS"  # late_engine.CALLS (that module runs only inside the server: it needs pb_utils)
SHORT = 8  # late_engine.SHORT: calls asking for more tokens are taken in late
PROMPT = "The quick brown fox"
REGION = "triton_python_backend_shm_region"


def _write(config, engines, repo, overrides):
    from support.standin_repo import write_standin_repository

    repo = write_standin_repository(config, engines, repo, overrides=overrides)
    version = repo / "tensorrt_llm" / "1"
    shutil.copy(version / "model.py", version / "tensorrtllm_standin.py")
    shutil.copy(LATE_ENGINE, version / "model.py")
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from support.tiny import served_pair

    server = served_pair(tmp_path_factory.mktemp("engine-calls"), write=_write, max_input_len=256)
    server.start(timeout=300)
    yield server
    server.stop()


def _calls(server) -> list[tuple[int, int]]:
    """(budget, tokens returned) of every call the target has ended."""
    path = server.repo / "tensorrt_llm" / "1" / CALLS
    lines = path.read_text().splitlines() if path.exists() else []
    return [tuple(int(v) for v in line.split()) for line in lines]


def _infer(server, request: GenerationRequest, drop=()):
    tensors = {k: v for k, v in request_to_tensors(request).items() if k not in drop}
    with SpecClient(server.grpc_url, "grpc") as client:
        return client.infer("tensorrt_llm", tensors)


def test_a_call_that_excludes_its_input_gets_the_new_tokens_alone_as_from_the_backend(server):
    prompt = [5, 6, 7, 8, 9]
    whole = _infer(server, GenerationRequest(prompt, 6, end_id=-1, exclude_input_in_output=False))
    new = _infer(server, GenerationRequest(prompt, 6, end_id=-1, exclude_input_in_output=True))
    # fillTritonResponse: output_ids [1, beams, tokens] and sequence_length [1, beams] = the tokens it holds
    assert whole["output_ids"].shape == (1, 1, 11) and whole["sequence_length"].tolist() == [[11]]
    assert new["output_ids"].shape == (1, 1, 6) and new["sequence_length"].tolist() == [[6]]
    assert new["output_ids"][0, 0].tolist() == whole["output_ids"][0, 0, 5:].tolist()
    # without the tensor, the model's parameter decides (false in the config trtspec deploys)
    default = _infer(server, GenerationRequest(prompt, 6, end_id=-1), drop=("exclude_input_in_output",))
    assert default["output_ids"].tolist() == whole["output_ids"].tolist()


class _Recorded:
    """An engine client that keeps the requests it is given."""

    def __init__(self, client):
        self.client, self.requests = client, []

    def generate(self, request: GenerationRequest):
        self.requests.append(request)
        return self.client.generate(request)


def test_every_engine_call_of_a_request_asks_for_its_new_tokens_alone(built_none):
    from trtspec.contract import SamplingParams
    from trtspec.engine.runtime import Engine, InProcessClient
    from trtspec.orchestrator.drafters import make_drafter
    from trtspec.orchestrator.loop import SpecRequest, speculate
    from trtspec.orchestrator.stats import RequestStats

    engine = InProcessClient(Engine.load(built_none.target))
    target, draft = _Recorded(engine), _Recorded(InProcessClient(Engine.load(built_none.draft)))
    drafter = make_drafter(
        "draft_model", client=draft, sampling=SamplingParams(), end_id=None, pad_id=None, use_logits=False
    )
    prompt = [5, 6, 7, 8]

    def tokens(request, client, drafter):
        return [t for chunk in speculate(request, client, drafter, stats=RequestStats()) for t in chunk]

    reference = tokens(SpecRequest(prompt, 24, end_id=-1), engine, None)
    assert tokens(SpecRequest(prompt, 24, num_draft_tokens=3, end_id=-1), target, drafter) == reference
    assert len(target.requests) > 1 and draft.requests
    assert all(r.exclude_input_in_output for r in target.requests + draft.requests)


def _bls_region(server) -> Path:
    (pid,) = server.stub_pids("tensorrt_llm_bls")
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    (region,) = {line.split(maxsplit=5)[-1] for line in maps if REGION in line}
    return Path(region)


def test_many_long_requests_leave_the_bls_shared_memory_as_it_was(server):
    """Per request, about a hundred verification and draft calls of a sequence of up to 250 tokens: kept for the
    request's life, with the sequence in each call and again in each response, these 8 requests grew the BLS's region
    by 5 MiB here (it grows in 1 MiB steps and never shrinks); read and let go, by one step at most."""
    from concurrent.futures import ThreadPoolExecutor

    fields = {
        "text_input": PROMPT,
        "max_tokens": 240,
        "min_tokens": 240,
        "speculation": "draft_model",
        "num_draft_tokens": 4,
        "adaptive_draft_length": False,  # every call short: none is taken in late
    }
    grpc_generate(server.grpc_url, {**fields, "max_tokens": 8, "min_tokens": 8})  # the region as it serves
    region = _bls_region(server)
    before = region.stat().st_size
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: grpc_generate(server.grpc_url, fields, timeout=600), range(8)))
    assert all(sum(len(np.atleast_1d(r["output_ids"]).reshape(-1)) for r in a) == 240 for a in answers)
    grown = region.stat().st_size - before
    assert grown <= 2**20, f"the BLS's shared memory grew by {grown / 2**20:.1f} MiB"


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_a_stop_that_reaches_the_engine_before_its_call_still_stops_it(server, stream):
    from tritonclient.utils import InferenceServerException

    before = len(_calls(server))
    fields = {"text_input": PROMPT, "max_tokens": 480, "min_tokens": 480, "speculation": "none", "stream": stream}
    # the deadline passes while the long call is on its way, not yet in the engine: the BLS's stop arrives first
    with pytest.raises(InferenceServerException, match="timeout_ms"):
        grpc_generate(server.grpc_url, {**fields, "timeout_ms": 500})
    _assert_stopped(server, before)


def test_a_call_that_reaches_the_engine_after_the_request_stopped_waiting_is_still_stopped(server):
    import re

    from tritonclient.utils import InferenceServerException

    # engine_client.STOP_TIMEOUT_SECONDS, read from its source (the module imports pb_utils, which lives in the server)
    source = (Path(__file__).parents[1] / "trtspec" / "triton" / "engine_client.py").read_text()
    STOP_TIMEOUT_SECONDS = float(re.search(r"^STOP_TIMEOUT_SECONDS = ([\d.]+)", source, re.M).group(1))
    before = len(_calls(server))
    late = server.repo / "tensorrt_llm" / "1" / "LATE"
    late.write_text(str(STOP_TIMEOUT_SECONDS + 2.0))  # past the request's wait for its stopped call
    try:
        fields = {"text_input": PROMPT, "max_tokens": 480, "min_tokens": 480, "speculation": "none"}
        started = time.monotonic()
        with pytest.raises(InferenceServerException, match="timeout_ms"):
            grpc_generate(server.grpc_url, {**fields, "timeout_ms": 500})
        # the client had its answer without waiting for the call to arrive
        assert time.monotonic() - started < STOP_TIMEOUT_SECONDS + 2.0
        _assert_stopped(server, before)
    finally:
        late.unlink(missing_ok=True)


def test_a_cancelled_request_whose_stop_reaches_the_engine_before_its_call_still_stops_it(server):
    from test_engine_isolation import bls_call

    before = len(_calls(server))
    fields = {"text_input": PROMPT, "max_tokens": 480, "min_tokens": 480, "speculation": "none", "stream": True}
    call = bls_call(server, fields, "cancelled")
    try:
        call.first()  # the first token's call is short; the stretch after it is on its way when the client leaves
    finally:
        call.close(cancel=True)
    _assert_stopped(server, before)


def _assert_stopped(server, before: int) -> None:
    """The long call among the target's calls after the first `before` ended well short of its budget."""
    until = time.monotonic() + 120
    while not any(budget > SHORT for budget, _ in _calls(server)[before:]) and time.monotonic() < until:
        time.sleep(0.1)
    (budget, tokens), *_ = [call for call in _calls(server)[before:] if call[0] > SHORT]
    assert budget >= 400, budget
    assert tokens < budget // 2, f"the call ran on to {tokens} of its {budget} tokens after its stop"
