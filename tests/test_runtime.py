"""The embedded engine against Hugging Face on the same weights: greedy generation, verification of drafts
(all, some, none accepted), end_id and length limits inside a draft, prefix-cache reuse that changes
nothing but the work done, request checks, load errors, and the tensor contract round trip."""

from __future__ import annotations

import json
import random
import shutil
from functools import cache

import numpy as np
import pytest
import torch
from conftest import MAX_DRAFT_LEN, MAX_SEQ_LEN
from safetensors.torch import load_file
from support.tiny import hf_generate

from trtspec.contract import (
    ENGINE_OUTPUTS,
    KV_TOKENS_PER_BLOCK,
    GenerationRequest,
    SamplingParams,
    request_to_tensors,
    tensors_to_request,
)
from trtspec.engine import fp8
from trtspec.engine.runtime import Engine, InProcessClient
from trtspec.errors import EngineError, RequestError

VOCAB = 320
EOS = 0
PROMPTS = [
    (5, 6, 7, 8),
    (100, 3, 200, 17, 42, 9, 9, 9),
    tuple(range(20, 60)),
]
N = 32  # tokens per reference continuation


# ---- references ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_models(tiny_pair, built_fp8):
    """Hugging Face models: the original checkpoint, and the same with the FP8 engine's dequantized weights."""
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(str(tiny_pair.target), dtype=torch.float32).eval()
    dequantized = AutoModelForCausalLM.from_pretrained(str(tiny_pair.target), dtype=torch.float32).eval()
    state = fp8.dequantize_state_dict(load_file(str(built_fp8.target / "rank0.safetensors")), torch.float32)
    missing, unexpected = dequantized.load_state_dict(state, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    changed = [k for k, v in state.items() if not torch.equal(v, original.state_dict()[k])]
    assert len(changed) == 14  # the 7 linear weights of both layers
    return {"none": original, "fp8": dequantized}


def hf_greedy(model, prompt: tuple[int, ...], n: int = N) -> tuple[list[int], np.ndarray]:
    """A Hugging Face model's `generate` with do_sample=False (stops at eos, as the engine): tokens and logits."""
    out = hf_generate(model, prompt, n, eos=EOS, return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float().numpy()


@pytest.fixture(scope="module")
def reference(hf_models):
    """greedy(kind, prompt, n): hf_greedy on the original or the FP8 engine's dequantized weights."""

    @cache
    def greedy(kind: str, prompt: tuple[int, ...], n: int = N) -> tuple[list[int], np.ndarray]:
        return hf_greedy(hf_models[kind], prompt, n)

    return greedy


@pytest.fixture
def engines(built_fp8, built_none):
    """A fresh engine per kind for each test (loading takes milliseconds), so no test sees another's cache."""
    return {"fp8": Engine.load(built_fp8.target), "none": Engine.load(built_none.target)}


def req(prompt, n=N, **kw) -> GenerationRequest:
    return GenerationRequest(input_ids=list(prompt), request_output_len=n, **kw)


def corrupt(tokens: list[int], at: int) -> list[int]:
    out = list(tokens)
    out[at] = (out[at] + 1) % VOCAB
    return out


# ---- greedy generation ----------------------------------------------------------------------------------------


def test_a_head_quantized_to_fp8_is_its_own_tensor_and_equals_hugging_face(tiny_pair, built_fp8_head):
    """quantize_lm_head on a checkpoint whose head is tied to the embedding: the engine stores the head's FP8 codes
    and scales apart, keeps the embedding exactly, reads the head as codes, and generates what Hugging Face does on
    the same dequantized weights with the head untied."""
    from transformers import AutoModelForCausalLM

    weights = load_file(str(built_fp8_head.target / "rank0.safetensors"))
    original = load_file(str(tiny_pair.target / "model.safetensors"))
    assert weights["lm_head.weight"].dtype == fp8.FP8_DTYPE
    assert weights["lm_head.weight_scale"].shape == (VOCAB, 1)  # per channel, as the target's layers
    assert torch.equal(weights["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    draft = load_file(str(built_fp8_head.draft / "rank0.safetensors"))
    assert draft["lm_head.weight"].dtype == fp8.FP8_DTYPE and draft["lm_head.weight_scale"].shape == ()

    reference = AutoModelForCausalLM.from_pretrained(
        str(tiny_pair.target), dtype=torch.float32, tie_word_embeddings=False
    ).eval()
    missing, unexpected = reference.load_state_dict(fp8.dequantize_state_dict(weights, torch.float32), strict=False)
    assert not missing and not unexpected
    assert not torch.equal(reference.lm_head.weight, reference.model.embed_tokens.weight)
    engine, hf_engine = Engine.load(built_fp8_head.target), Engine.load(built_fp8_head.target, forward="hf")
    if engine.model.linear_kind == "packed":
        assert engine.model.head.format in ("e4m3", "bfloat16") and engine.model.head.scale is not None
    for prompt in PROMPTS:
        expected, expected_logits = hf_greedy(reference, prompt)
        for e in (engine, hf_engine):
            result = e.generate(req(prompt, return_generation_logits=True))
            assert result.new_tokens == expected
            np.testing.assert_allclose(result.generation_logits, expected_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["none", "fp8"])
def test_greedy_equals_hugging_face(engines, reference, kind):
    for prompt in PROMPTS:
        expected, expected_logits = reference(kind, prompt)
        result = engines[kind].generate(req(prompt, return_generation_logits=True))
        assert result.new_tokens == expected
        assert result.output_ids == list(prompt) + expected
        assert result.num_draft_tokens == 0 and result.num_accepted_tokens == 0
        assert result.generation_logits.shape == (len(expected), VOCAB)
        np.testing.assert_allclose(result.generation_logits, expected_logits, atol=1e-4, rtol=1e-4)
        assert len(expected) >= 8  # a real continuation, not an immediate eos


def test_fp8_engine_reproduces_fp8_rounding(engines, reference):
    """The FP8 engine computes with the dequantized weights, not the originals: its logits match the
    dequantized Hugging Face model closely and the original one only loosely."""
    differs = 0
    for prompt in PROMPTS:
        result = engines["fp8"].generate(req(prompt, n=1, return_generation_logits=True))
        _, fp8_logits = reference("fp8", prompt)
        _, original_logits = reference("none", prompt)
        np.testing.assert_allclose(result.generation_logits[0], fp8_logits[0], atol=1e-4, rtol=1e-4)
        differs += float(np.abs(result.generation_logits[0] - original_logits[0]).max()) > 1e-2
    assert differs == len(PROMPTS)
    assert any(reference("fp8", p)[0] != reference("none", p)[0] for p in PROMPTS)


def test_exclude_input_and_end_id(engines, reference):
    prompt = PROMPTS[1]
    expected, _ = reference("fp8", prompt)
    result = engines["fp8"].generate(req(prompt, exclude_input_in_output=True))
    assert result.output_ids == result.new_tokens == expected
    # an end_id the continuation reaches stops it, the end token not returned (TensorRT-LLM's executor: "The
    # generation will stop at the endId, but not include it in the output", NVIDIA/TensorRT-LLM issue 2190)
    j = next(i for i in range(2, len(expected)) if expected[i] not in expected[:i])
    result = engines["fp8"].generate(req(prompt, end_id=expected[j]))
    assert result.new_tokens == expected[:j]
    # min_tokens forbids the end token until that many tokens are out
    result = engines["fp8"].generate(req(prompt, n=j + 3, end_id=expected[j], min_tokens=j + 3))
    assert len(result.new_tokens) == j + 3 and expected[j] not in result.new_tokens
    # end_id -1 disables the checkpoint's eos
    assert engines["fp8"].generate(req(prompt, n=4, end_id=-1)).new_tokens == expected[:4]


@pytest.mark.parametrize("end_id", [-1, None])
def test_min_tokens_with_no_end_id_is_refused_naming_the_fix(engines, end_id):
    """TensorRT-LLM's min-length rule writes to logits[end_id], -1 with no end id (an absent one too), in kernels
    without the guard of 3c44cb97: the engine refuses what such a backend would get wrong, and serves on."""
    with pytest.raises(RequestError, match="min_tokens: 2 with no end_id .*send min_tokens 0 when end_id is -1"):
        engines["fp8"].generate(req(PROMPTS[1], n=4, end_id=end_id, min_tokens=2))
    assert len(engines["fp8"].generate(req(PROMPTS[1], n=4, end_id=end_id, min_tokens=0)).new_tokens) >= 1


# ---- verification of drafts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["none", "fp8"])
@pytest.mark.parametrize("m", range(MAX_DRAFT_LEN + 1))
def test_verify_accepts_the_matching_prefix(engines, reference, kind, m):
    """A draft of the target's own greedy continuation, wrong from position m on: m tokens are accepted and
    the target's own token follows them (m = MAX_DRAFT_LEN: all accepted, plus the bonus token)."""
    prompt = PROMPTS[0]
    expected, expected_logits = reference(kind, prompt)
    draft = expected[:MAX_DRAFT_LEN]
    if m < MAX_DRAFT_LEN:
        draft = corrupt(draft, m)
    result = engines[kind].generate(req(prompt, draft_input_ids=draft, return_generation_logits=True))
    assert result.num_draft_tokens == MAX_DRAFT_LEN
    assert result.num_accepted_tokens == m
    assert result.new_tokens == expected[: m + 1]
    assert result.new_tokens[:m] == draft[:m]
    assert result.output_ids == list(prompt) + expected[: m + 1]
    assert result.acceptance_rate == m / MAX_DRAFT_LEN
    np.testing.assert_allclose(result.generation_logits, expected_logits[: m + 1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", ["none", "fp8"])
def test_speculative_loop_equals_greedy(engines, reference, kind):
    """A BLS-like loop (re-send the whole sequence with a draft every step, drafts wrong at random places)
    produces exactly the greedy output."""
    rng = random.Random(1)
    engine = engines[kind]
    for prompt in PROMPTS:
        expected, _ = reference(kind, prompt)
        seq, new, accepted = list(prompt), [], 0
        while len(new) < len(expected) and (not new or new[-1] != EOS):
            k = rng.randint(1, MAX_DRAFT_LEN)
            draft = expected[len(new) : len(new) + k] or [7]
            draft += [7] * (k - len(draft))  # past the end of the reference: anything
            if rng.random() < 0.5:
                draft = corrupt(draft, rng.randrange(k))
            result = engine.generate(req(seq, n=min(N - len(new), MAX_SEQ_LEN - len(seq)), draft_input_ids=draft))
            assert 1 <= len(result.new_tokens) <= result.num_draft_tokens + 1
            assert result.num_accepted_tokens == len(result.new_tokens) - 1 or result.new_tokens[-1] == EOS
            seq += result.new_tokens
            new += result.new_tokens
            accepted += result.num_accepted_tokens
        assert new == expected
        assert accepted > len(expected) // 4  # the loop did speculate
    assert engine.stats.verify_requests > 0 and engine.stats.num_accepted_tokens > 0


def test_end_id_inside_the_draft_stops_the_output(engines, reference):
    prompt = PROMPTS[0]
    expected, _ = reference("fp8", prompt)
    draft = expected[:MAX_DRAFT_LEN]
    j = next(i for i in range(1, MAX_DRAFT_LEN - 1) if draft[i] not in draft[:i])
    # an accepted draft token equal to end_id ends the output before it: nothing from it on, not the bonus token
    result = engines["fp8"].generate(req(prompt, draft_input_ids=draft, end_id=draft[j]))
    assert result.new_tokens == expected[:j]
    assert result.num_accepted_tokens == j and result.num_draft_tokens == MAX_DRAFT_LEN
    # the same end_id stops plain generation at the same place
    assert engines["fp8"].generate(req(prompt, end_id=draft[j])).new_tokens == expected[:j]
    # end_id as the target's own token after a rejection
    result = engines["fp8"].generate(req(prompt, draft_input_ids=corrupt(draft, j), end_id=draft[j]))
    assert result.new_tokens == expected[:j] and result.num_accepted_tokens == j
    # the kept KV cache is consistent: the next request continues correctly
    result = engines["fp8"].generate(req(list(prompt) + expected[: j + 1], n=4))
    assert result.new_tokens == reference("fp8", tuple(prompt) + tuple(expected[: j + 1]), 4)[0]


@pytest.mark.parametrize("output_len", [1, 2, 3, MAX_DRAFT_LEN, MAX_DRAFT_LEN + 1, MAX_DRAFT_LEN + 3])
def test_verify_emits_at_most_request_output_len(engines, reference, output_len):
    prompt = PROMPTS[1]
    expected, _ = reference("fp8", prompt)
    result = engines["fp8"].generate(req(prompt, n=output_len, draft_input_ids=expected[:MAX_DRAFT_LEN]))
    emitted = min(output_len, MAX_DRAFT_LEN + 1)
    assert result.new_tokens == expected[:emitted]
    assert result.num_draft_tokens == min(MAX_DRAFT_LEN, output_len - 1)
    assert result.num_accepted_tokens == emitted - 1


def test_verify_at_the_edge_of_max_seq_len(engines):
    prompt = list(range(10, 70))  # 60 tokens: room for MAX_SEQ_LEN - 60 more
    room = MAX_SEQ_LEN - len(prompt)
    expected = engines["none"].generate(req(prompt, n=MAX_DRAFT_LEN + 1, end_id=-1)).new_tokens
    result = engines["none"].generate(req(prompt, n=room, end_id=-1, draft_input_ids=expected[:MAX_DRAFT_LEN]))
    assert result.new_tokens == expected and result.num_accepted_tokens == MAX_DRAFT_LEN
    with pytest.raises(RequestError) as info:
        engines["none"].generate(req(prompt, n=room + 1, draft_input_ids=expected[:MAX_DRAFT_LEN]))
    assert info.value.field == "request_output_len" and f"at most {room} tokens" in str(info.value)


# ---- prefix cache ---------------------------------------------------------------------------------------------


def _bls_session(engine: Engine, reference) -> list:
    """Two conversations, interleaved, re-sending the growing sequence each step as the BLS does; the
    second shares the first's first tokens (a common system prompt). Returns every result."""
    rng = random.Random(7)
    conversations = [list(PROMPTS[2]), list(PROMPTS[2][:24]) + [300, 301, 302]]
    results = []
    for step in range(12):
        for seq in conversations:
            if step % 4 == 3:  # a plain generate step now and then
                result = engine.generate(req(seq, n=2, end_id=-1, return_generation_logits=True))
            else:
                expected, _ = reference("fp8", tuple(seq), MAX_DRAFT_LEN)
                draft = (expected + [3] * MAX_DRAFT_LEN)[:MAX_DRAFT_LEN]
                if rng.random() < 0.5:
                    draft = corrupt(draft, rng.randrange(MAX_DRAFT_LEN))
                result = engine.generate(
                    req(seq, n=MAX_DRAFT_LEN + 1, end_id=-1, draft_input_ids=draft, return_generation_logits=True)
                )
            seq += result.new_tokens
            results.append(result)
    return results


def test_prefix_cache_changes_nothing_but_the_work(built_fp8, reference):
    plain, reusing = Engine.load(built_fp8.target), Engine.load(built_fp8.target)
    plain.cache.reuse = False
    without, with_ = _bls_session(plain, reference), _bls_session(reusing, reference)
    for a, b in zip(without, with_, strict=True):
        assert a.output_ids == b.output_ids
        assert (a.num_draft_tokens, a.num_accepted_tokens) == (b.num_draft_tokens, b.num_accepted_tokens)
        np.testing.assert_allclose(a.generation_logits, b.generation_logits, atol=1e-4, rtol=1e-4)
        assert a.reused_tokens == 0
    assert plain.cache.entries == [] and plain.cache.stats.hits == 0
    # every step after each conversation's first reuses all but the newest tokens
    assert all(b.reused_tokens > 0 for b in with_[2:])
    assert all(b.reused_tokens + b.computed_tokens >= len(b.output_ids) - len(b.new_tokens) for b in with_)
    assert sum(b.computed_tokens for b in with_) < sum(a.computed_tokens for a in without) / 3
    # the second conversation's first step reused the shared prefix of the first
    assert with_[1].reused_tokens == 24
    assert reusing.cache.stats.hits == len(with_) - 1


def test_prefix_cache_eviction_keeps_outputs(built_fp8):
    tiny = Engine.load(built_fp8.target)
    tiny.cache.reuse_bytes = 1  # nothing can be kept: every entry is evicted at once
    normal = Engine.load(built_fp8.target)
    for prompt in PROMPTS:
        a, b = tiny.generate(req(prompt, n=8)), normal.generate(req(prompt, n=8))
        assert a.output_ids == b.output_ids
        a, b = tiny.generate(req(a.output_ids, n=3)), normal.generate(req(b.output_ids, n=3))
        assert a.output_ids == b.output_ids and a.reused_tokens == 0 < b.reused_tokens
    assert tiny.cache.entries == [] and tiny.cache.stats.evictions == 2 * len(PROMPTS)


def test_sampling_is_seeded_and_cache_independent(built_fp8):
    a, b = Engine.load(built_fp8.target), Engine.load(built_fp8.target)
    b.cache.reuse = False
    sampling = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    first = a.generate(req(PROMPTS[0], n=16, sampling=sampling, end_id=-1))
    assert a.generate(req(PROMPTS[0], n=16, sampling=sampling, end_id=-1)).new_tokens == first.new_tokens
    assert b.generate(req(PROMPTS[0], n=16, sampling=sampling, end_id=-1)).new_tokens == first.new_tokens
    other = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=4321)
    assert a.generate(req(PROMPTS[0], n=16, sampling=other, end_id=-1)).new_tokens != first.new_tokens
    # verification with draft logits under sampling runs and respects the limits
    draft_logits = np.random.default_rng(0).normal(size=(MAX_DRAFT_LEN, VOCAB)).astype(np.float32)
    result = a.generate(
        req(
            PROMPTS[0],
            n=8,
            sampling=sampling,
            draft_input_ids=first.new_tokens[:MAX_DRAFT_LEN],
            draft_logits=draft_logits,
        )
    )
    assert 1 <= len(result.new_tokens) <= MAX_DRAFT_LEN + 1 and result.num_draft_tokens == MAX_DRAFT_LEN


# ---- request checks -------------------------------------------------------------------------------------------

BAD_REQUESTS = {
    "id above vocab": ("target", req([5, VOCAB], n=4), "input_ids"),
    "negative id": ("target", req([-1, 5], n=4), "input_ids"),
    "empty input": ("target", req([], n=4), "input_ids"),
    "zero output": ("target", req([5], n=0), "request_output_len"),
    "beyond max_seq_len": ("target", req(list(range(1, 60)), n=MAX_SEQ_LEN - 58), "request_output_len"),
    "end_id outside vocab": ("target", req([5], n=4, end_id=VOCAB), "end_id"),
    "pad_id outside vocab": ("target", req([5], n=4, pad_id=-2), "pad_id"),
    "draft on the draft engine": ("draft", req([5], n=4, draft_input_ids=[1, 2]), "draft_input_ids"),
    "too many draft tokens": ("target", req([5], n=8, draft_input_ids=[1] * (MAX_DRAFT_LEN + 1)), "draft_input_ids"),
    "draft id outside vocab": ("target", req([5], n=4, draft_input_ids=[1, VOCAB]), "draft_input_ids"),
    "draft_logits rows": (
        "target",
        req([5], n=4, draft_input_ids=[1, 2], draft_logits=np.zeros((3, VOCAB), np.float32)),
        "draft_logits",
    ),
    "draft_logits vocab": (
        "target",
        req([5], n=4, draft_input_ids=[1, 2], draft_logits=np.zeros((2, VOCAB - 1), np.float32)),
        "draft_logits",
    ),
    "draft_logits 1-d": (
        "target",
        req([5], n=4, draft_input_ids=[1], draft_logits=np.zeros(VOCAB, np.float32)),
        "draft_logits",
    ),
    "draft_logits alone": ("target", req([5], n=4, draft_logits=np.zeros((1, VOCAB), np.float32)), "draft_logits"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=list(BAD_REQUESTS))
def test_bad_requests_name_the_field(built_fp8, case):
    role, request, field = BAD_REQUESTS[case]
    engine = Engine.load(getattr(built_fp8, role))
    with pytest.raises(RequestError) as info:
        engine.generate(request)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert engine.stats.requests == 0 and engine.cache.stats.lookups == 0  # refused before any work
    if case in ("draft_logits alone", "draft_logits 1-d"):
        return  # not expressible as tensors: request_to_tensors sends draft_logits only with a draft, as [1, k, V]
    with pytest.raises(RequestError) as info:  # the same through the tensor contract
        InProcessClient(engine).generate(request)
    assert info.value.field == field


def test_limits_are_inclusive(built_fp8):
    engine = Engine.load(built_fp8.target)
    assert len(engine.generate(req(list(range(1, 60)), n=MAX_SEQ_LEN - 59, end_id=-1)).new_tokens) == MAX_SEQ_LEN - 59
    assert len(engine.generate(req([5], n=8, end_id=-1, draft_input_ids=[1] * MAX_DRAFT_LEN)).new_tokens) >= 1
    wide = np.zeros((2, VOCAB + 64), np.float32)  # padded vocab: extra columns are ignored
    assert engine.generate(req([5], n=4, draft_input_ids=[1, 2], draft_logits=wide)).num_draft_tokens == 2


@pytest.mark.parametrize(
    "tensors, field",
    [
        ({"input_ids": np.array([[1, 2]], np.int32), "request_output_len": np.array([[4]], np.int32)}, "input_lengths"),
        ({"input_ids": np.array([[1, 2]], np.int32), "input_lengths": np.array([[2]], np.int32)}, "request_output_len"),
        (
            {
                "input_ids": np.array([[1.0, 2.0]], np.float32),
                "input_lengths": np.array([[2]], np.int32),
                "request_output_len": np.array([[4]], np.int32),
            },
            "input_ids",
        ),
        (
            {
                "input_ids": np.array([[1, 2], [3, 4]], np.int32),
                "input_lengths": np.array([[2]], np.int32),
                "request_output_len": np.array([[4]], np.int32),
            },
            "input_ids",
        ),
        (
            {
                "input_ids": np.array([[1, 2]], np.int32),
                "input_lengths": np.array([[3]], np.int32),
                "request_output_len": np.array([[4]], np.int32),
            },
            "input_lengths",
        ),
        (
            {
                "input_ids": np.array([[1, 2]], np.int32),
                "input_lengths": np.array([[2]], np.int32),
                "request_output_len": np.array([[4, 5]], np.int32),
            },
            "request_output_len",
        ),
    ],
)
def test_bad_tensors_name_the_tensor(built_fp8, tensors, field):
    engine = Engine.load(built_fp8.target)
    with pytest.raises(RequestError) as info:
        engine.serve(tensors)
    assert info.value.field == field


# ---- loading --------------------------------------------------------------------------------------------------


def test_load_errors(built_fp8, tmp_path):
    with pytest.raises(EngineError, match="config.json is missing"):
        Engine.load(tmp_path)

    broken = tmp_path / "truncated"
    shutil.copytree(built_fp8.target, broken)
    weights = broken / "rank0.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(EngineError, match="cannot read .*rank0.safetensors"):
        Engine.load(broken)

    weights.unlink()
    with pytest.raises(EngineError, match="rank0.safetensors is missing"):
        Engine.load(broken)

    shutil.copy(built_fp8.target / "rank0.safetensors", weights)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text("{not json")
    with pytest.raises(EngineError, match="not valid JSON"):
        Engine.load(broken)

    del config["build_config"]["max_seq_len"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match="build_config.max_seq_len"):
        Engine.load(broken)

    config["build_config"]["max_seq_len"] = 100
    config["trtspec"]["backend"] = "trtllm"
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match="trtllm engine"):
        Engine.load(broken)

    # weights of another model under a valid config
    config["trtspec"]["backend"] = "torch"
    (broken / "config.json").write_text(json.dumps(config))
    shutil.copy(built_fp8.draft / "rank0.safetensors", weights)
    with pytest.raises(EngineError, match="does not match"):
        Engine.load(broken)

    # weights whose shapes disagree with the config
    shutil.copy(built_fp8.target / "rank0.safetensors", weights)
    config["trtspec"]["hf_config"]["intermediate_size"] = 256
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(EngineError, match="does not match"):
        Engine.load(broken)


# ---- the tensor contract --------------------------------------------------------------------------------------


def test_in_process_client_round_trip(built_fp8, reference):
    direct, client_engine = Engine.load(built_fp8.target), Engine.load(built_fp8.target)
    client = InProcessClient(client_engine)
    prompt = PROMPTS[2]
    expected, expected_logits = reference("fp8", prompt)
    requests = [
        req(prompt, n=6),
        req(prompt, n=6, exclude_input_in_output=True, return_generation_logits=True),
        req(list(prompt) + expected[:6], n=MAX_DRAFT_LEN + 1, draft_input_ids=expected[6 : 6 + MAX_DRAFT_LEN]),
        req(
            list(prompt) + expected[:11],
            n=MAX_DRAFT_LEN + 1,
            draft_input_ids=corrupt(expected[11 : 11 + MAX_DRAFT_LEN], 2),
            draft_logits=np.zeros((MAX_DRAFT_LEN, VOCAB), np.float32),
            return_generation_logits=True,
        ),
        req(
            list(prompt) + expected[:14],
            n=MAX_DRAFT_LEN + 1,
            draft_input_ids=expected[14 : 14 + MAX_DRAFT_LEN],
            sampling=SamplingParams(temperature=0.8, top_k=20, seed=5),
            draft_logits=np.zeros((MAX_DRAFT_LEN, VOCAB), np.float32),
        ),
    ]
    results = []
    for request in requests:
        request.return_perf_metrics = True  # the counts come back through the perf outputs, as from TensorRT-LLM
        a, b = direct.generate(request), client.generate(request)
        assert b.output_ids == a.output_ids and b.new_tokens == a.new_tokens
        assert (b.num_draft_tokens, b.num_accepted_tokens) == (a.num_draft_tokens, a.num_accepted_tokens)
        assert b.reused_tokens == a.reused_tokens // KV_TOKENS_PER_BLOCK * KV_TOKENS_PER_BLOCK  # reported in blocks
        if request.return_generation_logits:
            np.testing.assert_array_equal(b.generation_logits, a.generation_logits)
        else:
            assert b.generation_logits is None
        results.append(b)
    assert results[0].new_tokens == expected[:6] and results[0].output_ids == list(prompt) + expected[:6]
    assert results[1].output_ids == results[1].new_tokens == expected[:6]
    np.testing.assert_allclose(results[1].generation_logits, expected_logits[:6], atol=1e-4, rtol=1e-4)
    assert results[2].new_tokens == expected[6:11] and results[2].num_accepted_tokens == MAX_DRAFT_LEN
    assert results[2].reused_tokens >= KV_TOKENS_PER_BLOCK  # 46 tokens re-sent, all but the last cached
    assert results[3].new_tokens == expected[11:14] and results[3].num_accepted_tokens == 2


def test_serve_outputs_follow_the_name_table(built_fp8):
    engine = Engine.load(built_fp8.target)
    plain = engine.serve(request_to_tensors(req(PROMPTS[0], n=5, draft_input_ids=[1, 2, 3])))
    assert set(plain) == {"output_ids", "sequence_length"}  # perf outputs only when asked, as TensorRT-LLM
    tensors = request_to_tensors(
        req(
            PROMPTS[0],
            n=5,
            draft_input_ids=[1, 2, 3],
            return_generation_logits=True,
            return_perf_metrics=True,
            return_log_probs=True,
            return_context_logits=True,
            return_num_input_tokens=True,
            return_num_output_tokens=True,
        )
    )
    assert tensors_to_request(tensors).draft_input_ids == [1, 2, 3]
    out = engine.serve(tensors)
    specs = {s.name: s for s in ENGINE_OUTPUTS}
    # then all of them, but those of features the embedded engine has not (disaggregated serving, several
    # sequences per request)
    assert set(out) == set(specs) - {"batch_index", "sequence_index", "context_phase_params"}
    times = [
        int(out[n][0, 0])
        for n in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")
    ]
    assert times == sorted(times) and times[0] > 0
    for name, value in out.items():
        assert value.dtype == specs[name].np_dtype, name
        assert value.ndim == len(specs[name].dims) + 1, name  # batch dim first
        assert value.shape[0] == 1
    length = int(out["sequence_length"][0, 0])
    assert out["output_ids"].shape == (1, 1, length)
    assert out["total_draft_tokens"][0, 0] == 3
    assert out["generation_logits"].shape == (1, 1, length - len(PROMPTS[0]), VOCAB)
    # a ragged batch row: input_lengths says where the ids end
    padded = dict(tensors, input_ids=np.array([list(PROMPTS[0]) + [1, 1]], np.int32))
    padded.pop("draft_input_ids")
    assert tensors_to_request(padded).input_ids == list(PROMPTS[0])
