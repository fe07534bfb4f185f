"""Liveness on a real server: a target whose every call fails (TensorRT-LLM's executor after a sticky CUDA error, played
by tests/support/failing_engine.py over the backend's stand-in) keeps its model READY, so readiness cannot see it; the
BLS counts the engine's failures, and the OpenAI front's /health/live answers 503 once the target has failed every call
for the rule's time, then 200 again after its next answer. A client's bad request is never counted."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from trtspec.engine_health import FAILURES, failing_from_scrape

FAILING_MODEL = Path(__file__).parent / "support" / "failing_engine.py"
MODEL = "tiny"
FAILING = "FAILING"  # failing_engine.FAILING (that module runs only inside the server: it needs pb_utils)


def _write(config, engines, repo, overrides):
    from support.standin_repo import write_standin_repository

    repo = write_standin_repository(config, engines, repo, overrides=overrides)
    version = repo / "tensorrt_llm" / "1"
    shutil.copy(version / "model.py", version / "tensorrtllm_standin.py")
    shutil.copy(FAILING_MODEL, version / "model.py")
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from support.tiny import served_pair

    server = served_pair(tmp_path_factory.mktemp("liveness"), write=_write)
    server.start(timeout=300)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def front(server):
    from trtspec.engine_health import LivenessRule
    from trtspec.openai_api import Deployment, Front
    from trtspec.openai_api.liveness import Liveness
    from trtspec.server import free_port

    liveness = Liveness(server.metrics_url, LivenessRule(seconds=1.0, failures=2), unready_grace=600)
    deployment = Deployment(server.http_url, served_model_name=MODEL, liveness=liveness).connect()
    with Front(deployment, port=free_port()) as running:
        yield running


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _complete(front) -> tuple[int, dict]:
    return _post(f"{front.url}/v1/completions", {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 6})


def _failures(server) -> float:
    scrape = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    run = failing_from_scrape(scrape, "tensorrt_llm_bls").get("tensorrt_llm")
    return run.failures if run else 0


@pytest.mark.server
def test_a_target_that_fails_every_call_stops_the_pod_being_live_and_an_answer_brings_it_back(server, front):
    assert _complete(front)[0] == 200
    assert _get(f"{front.url}/health/live") == (200, {"status": "live", "model": MODEL})
    switch = server.repo / "tensorrt_llm" / "1" / FAILING
    switch.touch()
    try:
        # a client's bad request ends in the BLS, before any engine call: not the engine's failure
        status, body = _post(
            f"{server.http_base_url}/v2/models/tensorrt_llm_bls/generate",
            {"text_input": "The quick brown fox", "max_tokens": 4, "temperature": -1.0},
        )
        assert status == 400 and "temperature" in body["error"], body
        assert _failures(server) == 0
        started = time.time()
        for _ in range(2):
            status, body = _complete(front)
            # the server's failure, said as one: never the client's
            assert status >= 500 and "forwardAsync" in body["error"]["message"], (status, body)
        assert _failures(server) == 2
        # Triton still calls every model ready: readiness cannot tell, liveness can
        assert _get(f"{front.url}/health")[0] == 200
        time.sleep(max(0.0, started + 1.2 - time.time()))
        status, body = _get(f"{front.url}/health/live")
        assert status == 503, body
        assert "'tensorrt_llm' has failed every call" in body["error"]["message"]
    finally:
        switch.unlink()
    # the engine answers again: the run is over, and the pod is live
    assert _complete(front)[0] == 200
    assert _failures(server) == 0
    assert _get(f"{front.url}/health/live")[0] == 200
    scrape = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    assert f'{FAILURES}{{engine="tensorrt_llm",model="tensorrt_llm_bls"}} 0' in scrape


@pytest.mark.server
def test_the_liveness_probe_needs_no_key_where_every_other_route_does(server):
    from trtspec.keys import Key
    from trtspec.openai_api import Deployment, Front
    from trtspec.server import free_port

    with Front(Deployment(server.http_url).connect(), port=free_port(), api_key=Key("k" * 32, "test")) as keyed:
        assert _get(f"{keyed.url}/health/live")[0] == 200  # kubelet's probe carries no key
        assert _get(f"{keyed.url}/v1/models")[0] == 401
