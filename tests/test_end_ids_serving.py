"""min_tokens and the model's several end tokens on a real server, over the strict stand-in of TensorRT-LLM's
backend (tests/support/tensorrtllm_standin.py): the target declares a second end token (as Llama 3.x Instruct declares
128001, 128008 and 128009) that its greedy answer reaches early. TensorRT-LLM's min-length rule masks the request's
one end_id, so the BLS bans the others until min_tokens are out; and min_tokens never reaches an engine with no end
id (ignore_eos), which the stand-in refuses as kernels without the guard of 3c44cb97 would get it wrong."""

from __future__ import annotations

import json

import pytest
from test_serving import PROMPTS, grpc_generate, ids_of

from trtspec.client import ClientError, SpecClient
from trtspec.contract import GenerationRequest, request_to_tensors


@pytest.fixture(scope="module")
def ends(tmp_path_factory):
    """The served pair on the stand-in, its target declaring a second end token: the first token of its greedy
    answer, from the sixth on, that is not the eos; and the answer held back as min_tokens holds it."""
    from support.standin_repo import write_standin_repository
    from support.tiny import served_pair
    from transformers import AutoTokenizer

    from trtspec.engine.runtime import Engine, InProcessClient

    found = {}

    def write(config, engines, repo, overrides):
        target = engines / "target"
        prompt = AutoTokenizer.from_pretrained(str(target))(PROMPTS[0])["input_ids"]
        engine = InProcessClient(Engine.load(target))
        answer = engine.generate(GenerationRequest(prompt, 24, end_id=-1)).new_tokens
        declared = json.loads((target / "generation_config.json").read_text())
        other = next(t for t in answer[6:] if t != declared["eos_token_id"])
        declared["eos_token_id"] = [declared["eos_token_id"], other]
        (target / "generation_config.json").write_text(json.dumps(declared))
        at = answer.index(other)
        # min_tokens past the other end token: banned for the first at + 2 tokens, then ending the answer
        held = engine.generate(GenerationRequest(prompt, at + 2, end_id=-1, bad_words=[[other]])).new_tokens
        rest = engine.generate(GenerationRequest(prompt + held, 24 - len(held), end_id=-1)).new_tokens
        found.update(
            answer=answer,
            other=other,
            at=at,
            eos=declared["eos_token_id"][0],
            held=held + (rest[: rest.index(other)] if other in rest else rest),
        )
        return write_standin_repository(config, engines, repo, overrides=overrides)

    server = served_pair(tmp_path_factory.mktemp("end-ids"), write=write)
    server.start(timeout=300)
    yield server, found
    server.stop()


@pytest.mark.server
def test_min_tokens_holds_back_every_declared_end_token(ends):
    server, found = ends
    other, at, held = found["other"], found["at"], found["held"]
    assert found["answer"][at] == other and other not in held[: at + 2]  # the ban changed the answer there
    for fields in (
        {"num_draft_tokens": 0},
        {"num_draft_tokens": 0, "stream": True},
        {},
        {"stream": True},
        {"speculation": "draft_model", "num_draft_tokens": 3, "adaptive_draft_length": False},
    ):
        out = grpc_generate(
            server.grpc_url,
            {"text_input": PROMPTS[0], "max_tokens": 24, "min_tokens": at + 2, "return_perf_metrics": True, **fields},
        )
        assert ids_of(out) == held, fields
        reason = out[-1]["finish_reason"].reshape(-1)[0].decode()
        assert reason == ("end_id" if len(held) < 24 else "length"), fields


@pytest.mark.server
def test_min_tokens_with_no_end_id_is_refused_by_the_engine_and_never_sent_by_the_bls(ends):
    server, found = ends
    prompt = [5, 9, 23]
    with SpecClient(server.grpc_url, "grpc") as client:
        for end_id in (-1, None):
            tensors = request_to_tensors(GenerationRequest(prompt, 4, end_id=end_id, min_tokens=2))
            with pytest.raises(ClientError, match="min_tokens: 2 with no end_id"):
                client.infer("tensorrt_llm", tensors)
        # the engine serves on
        assert len(client.infer("tensorrt_llm", request_to_tensors(GenerationRequest(prompt, 4, end_id=-1)))) > 0
    # ignore_eos (end_id -1) with min_tokens through the BLS: served, the whole budget, drafts included
    for fields in ({}, {"speculation": "draft_model", "num_draft_tokens": 3}, {"num_draft_tokens": 0}):
        out = grpc_generate(
            server.grpc_url,
            {"text_input": PROMPTS[0], "max_tokens": 24, "end_id": -1, "min_tokens": 10, **fields},
        )
        assert ids_of(out) == found["answer"], fields
