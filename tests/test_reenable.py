"""Speculation switched off and on while a request streams (an operator's force through the control file), on the
embedded engine and on the strict stand-in of TensorRT-LLM's backend: the output is the target's own, and drafting
after it comes back is accepted as before it went (the draft model sees every token the target produced while it was
off: no row of its cache left unwritten, as TensorRT-LLM's drafters once did after such a switch)."""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from trtspec import control

PROMPT = "The quick brown fox"
TOKENS = 1600  # long enough that the force, its stretch and the release all land inside it (the file is read at
# most twice a second, and this pair makes hundreds of tokens a second)
REQUEST = {
    "text_input": PROMPT,
    "max_tokens": TOKENS,
    "end_id": -1,
    "num_draft_tokens": 4,
    "speculation": "draft_model",
    "adaptive_draft_length": False,  # a fixed K: acceptance depends on the text alone, not on measured timings
    "stream": True,
    "return_perf_metrics": True,  # each response carries the request's draft and accepted tokens so far
}
# Acceptance of this pair's greedy drafts varies along the text (about half of them accepted over a whole answer);
# a draft model that attended rows never written would have next to none accepted after the switch.
TOLERANCE = 0.25


@pytest.fixture(scope="module", params=["embedded", "tensorrtllm-standin"])
def spec_server(tmp_path_factory, request):
    from support.standin_repo import write_standin_repository
    from support.tiny import make_checkpoint, make_perturbed_copy, write_config

    from trtspec.compile import run_build
    from trtspec.config import load_config
    from trtspec.deploy.writer import write_repository
    from trtspec.server import TritonServer, free_port

    root = tmp_path_factory.mktemp("reenable")
    target = make_checkpoint(root / "target", layers=3, seed=0)
    draft = make_perturbed_copy(target, root / "draft", noise=0.01)
    config = write_config(
        root / "build.yaml",
        target,
        draft,
        speculation={"max_draft_len": 8},
        engine={"max_input_len": 64, "max_seq_len": 2048},
    )
    engines = run_build(config, root / "engines")
    if request.param == "embedded":
        repo = write_repository(load_config(config), engines, root / "repo")
    else:
        repo = write_standin_repository(config, engines, root / "repo")
    server = TritonServer(
        repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), control_file=root / "force.json"
    )
    server.start(timeout=300)
    yield server
    server.stop()


def streamed(url: str, fields: dict):
    """Yield each response's outputs of one streamed request to the BLS, as they arrive."""
    from test_serving import BLS, BLS_TYPES

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        inputs = []
        for name, value in fields.items():
            spec = BLS_TYPES[name]
            if spec.dtype == "STRING":
                arr = np.asarray([[str(value).encode()]], dtype=np.object_)
            else:
                arr = np.asarray([np.atleast_1d(value)]).astype(spec.np_dtype)
            tensor = grpcclient.InferInput(name, list(arr.shape), "BYTES" if spec.dtype == "STRING" else spec.dtype)
            tensor.set_data_from_numpy(arr)
            inputs.append(tensor)
        client.async_stream_infer(BLS, inputs, enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=300)
            if error is not None:
                raise error
            names = [o.name for o in result.get_response().outputs]
            if names:
                yield {n: result.as_numpy(n) for n in names}
            if result.get_response().parameters["triton_final_response"].bool_param:
                return
    finally:
        client.stop_stream()
        client.close()


def _count(response, name: str) -> int:
    return int(np.asarray(response[name]).reshape(-1)[0])


@pytest.mark.server
def test_speculation_forced_off_and_on_mid_stream_keeps_the_output_and_the_acceptance(spec_server):
    from test_serving import grpc_generate, ids_of

    path = spec_server.control_file
    reference = ids_of(grpc_generate(spec_server.grpc_url, REQUEST | {"num_draft_tokens": 0, "stream": False}))
    assert len(reference) == TOKENS
    ids: list[int] = []
    marks = {}  # phase -> (tokens, draft tokens, accepted tokens) when it began
    phase, quiet = "before", (0, 0)  # (draft tokens, tokens when they last grew) while forced
    try:
        for response in streamed(spec_server.grpc_url, REQUEST):
            ids += [int(t) for t in np.asarray(response.get("output_ids", [])).reshape(-1)]
            drafted, accepted = _count(response, "total_draft_tokens"), _count(response, "total_accepted_draft_tokens")
            now = (len(ids), drafted, accepted)
            if phase == "before" and drafted >= 40:  # drafting went on for a while: force plain
                control.write(path, control.Force("plain", time.time() + 120, "chaos", "operator"))
                marks["forced"], phase, quiet = now, "forced", (drafted, len(ids))
            elif phase == "forced" and drafted != quiet[0]:
                quiet = (drafted, len(ids))  # still drafting: the BLS reads the file at most twice a second
            elif phase == "forced" and len(ids) >= quiet[1] + 40:
                # 40 tokens with no draft: the force reached the running request; release it
                control.write(path, None)
                marks["released"], phase = now, "released"
            elif phase == "released" and drafted > marks["released"][1] and "resumed" not in marks:
                marks["resumed"] = now
        final = now
    finally:
        control.write(path, None)
    assert ids == reference  # greedy: the target's own output, whatever the switches
    assert set(marks) == {"forced", "released", "resumed"}, f"the switches did not all land inside the answer: {marks}"
    fallbacks = [bytes(v).decode() for v in np.asarray(response["fallback_reasons"]).reshape(-1)]
    assert "governor:1" in fallbacks
    forced, released = marks["forced"], marks["released"]
    before = forced[2] / forced[1]
    after_drafted, after_accepted = final[1] - released[1], final[2] - released[2]
    assert after_drafted >= 40, f"too little drafting after speculation came back to judge it: {marks}, {final}"
    after = after_accepted / after_drafted
    print(f"acceptance before the switch {before:.3f} ({forced[1]} drafted), after {after:.3f} ({after_drafted})")
    assert abs(after - before) <= TOLERANCE, f"acceptance {before:.2f} before the switch, {after:.2f} after it"


@pytest.mark.server
def test_a_request_admitted_while_forced_plain_decodes_plainly_and_the_next_speculates(spec_server):
    """The other half of the switch: a force read when a request arrives (no draft at all, fallback governor), and
    after its release the next request drafts again, with the target's output both times."""
    from test_serving import grpc_generate, ids_of

    path = spec_server.control_file
    fields = REQUEST | {"max_tokens": 48, "stream": False}
    reference = ids_of(grpc_generate(spec_server.grpc_url, fields | {"num_draft_tokens": 0}))
    try:
        control.write(path, control.Force("plain", time.time() + 120, "chaos", "operator"))
        time.sleep(0.6)  # the BLS reads the file at most twice a second
        forced = grpc_generate(spec_server.grpc_url, fields)[-1]
        control.write(path, None)
        time.sleep(0.6)
        released = grpc_generate(spec_server.grpc_url, fields)[-1]
    finally:
        control.write(path, None)
    assert ids_of([forced]) == ids_of([released]) == reference
    assert _count(forced, "total_draft_tokens") == 0
    assert _count(released, "total_draft_tokens") > 0
