"""Property-based fuzzing of the speculative BLS through the real tritonserver: requests generated over every BLS
field (valid, boundary and invalid values, wrong types, unknown fields), sent over HTTP `/generate`,
`/generate_stream` and gRPC streaming. Every request gets an answer or an error that names a field, the server
never stops being ready, and a greedy answer equals the target-only answer. `benchmarks/fuzz.py` runs the same
generator for many more cases."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from support.fuzzing import OUTPUT_NEUTRAL, PROMPTS, Outcome, bls_requests, send, wrong_json_type  # noqa: E402
from test_serving import grpc_generate, ids_of  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from support.tiny import served_pair

    server = served_pair(tmp_path_factory.mktemp("fuzz"), max_input_len=64)
    server.start(timeout=300)
    yield server
    server.stop()


REFERENCES: dict[tuple[str, int], list[int]] = {}


def _reference(server, prompt: str, max_tokens: int) -> list[int]:
    key = (prompt, max_tokens)
    if key not in REFERENCES:
        REFERENCES[key] = ids_of(grpc_generate(server.grpc_url, {"text_input": prompt, "max_tokens": max_tokens}))
    return REFERENCES[key]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=bls_requests())
def test_every_request_gets_an_answer_or_an_error_naming_a_field(server, case):
    transport, fields = case
    outcome = send(server, transport, fields)
    allowed = {Outcome.ANSWER, Outcome.FIELD_ERROR}
    if transport != "grpc" and wrong_json_type(fields):
        allowed.add(Outcome.JSON_TYPE_ERROR)  # refused by Triton's generate extension before the BLS sees it
    assert outcome.kind in allowed, (transport, fields, outcome.detail)
    with urllib.request.urlopen(f"{server.http_base_url}/v2/health/ready", timeout=10) as ready:
        assert ready.status == 200
    if outcome.kind == Outcome.ANSWER and set(fields) <= OUTPUT_NEUTRAL and fields.get("text_input") in PROMPTS:
        # greedy, nothing that changes the output: the answer is the target's own
        assert outcome.ids == _reference(server, fields["text_input"], fields["max_tokens"]), (transport, fields)


def test_the_classifier_is_not_kind(server):
    """An error that names no field is not accepted as one."""
    req = urllib.request.Request(
        f"{server.http_base_url}/v2/models/tensorrt_llm_bls/generate",
        data=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(req, timeout=30)
    assert Outcome.classify_error(json.loads(caught.value.read().decode()).get("error", ""), {}) == Outcome.OTHER_ERROR
