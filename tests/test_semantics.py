"""What the tensorrt_llm inputs beyond plain generation mean on the embedded engine, against references the
engine does not share code with: Hugging Face's own logits processors (repetition penalty, bad words, minimum
new tokens) and a numpy transcription of TensorRT-LLM's penalty kernel (presence and frequency). Every rule
must hold under verification too: a draft is accepted exactly where plain decoding would have chosen it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.tiny import hf_generate

from trtspec.contract import GenerationRequest, Penalties, SamplingParams, request_to_tensors, tensors_to_request
from trtspec.engine.runtime import Engine
from trtspec.errors import RequestError

EOS = 0
PROMPT = (100, 3, 200, 17, 42, 9, 9, 9, 17, 42)
N = 24


@pytest.fixture(scope="module")
def engine(built_none):
    return Engine.load(built_none.target)


@pytest.fixture(scope="module")
def hf(tiny_pair):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_pair.target), dtype=torch.float32).eval()


def gen(engine, n=N, prompt=PROMPT, end_id=EOS, **kw) -> list[int]:
    return engine.generate(
        GenerationRequest(input_ids=list(prompt), request_output_len=n, end_id=end_id, **kw)
    ).new_tokens


def hf_greedy(hf, n=N, **kw) -> list[int]:
    return hf_generate(hf, PROMPT, n, eos=EOS, **kw)[0, len(PROMPT) :].tolist()


def test_repetition_penalty_matches_hugging_face(engine, hf):
    plain = gen(engine)
    penalized = gen(engine, penalties=Penalties(repetition=1.8))
    assert penalized == hf_greedy(hf, repetition_penalty=1.8)
    assert penalized != plain  # the penalty changed something on this prompt, so the comparison means something


def test_bad_words_match_hugging_face(engine, hf):
    plain = gen(engine)
    bad = [[plain[2]], [plain[5], plain[6]]]  # a single token, and a two-token word plain decoding produces
    out = gen(engine, bad_words=bad)
    assert out == hf_greedy(hf, bad_words_ids=bad)
    assert plain[2] not in out


def test_min_tokens_match_hugging_face(engine, hf):
    # make a token plain decoding reaches early the end token
    plain = gen(engine)
    stop = plain[3]
    short = engine.generate(GenerationRequest(input_ids=list(PROMPT), request_output_len=N, end_id=stop)).new_tokens
    assert short == plain[:3]  # the end token itself is not returned, as TensorRT-LLM
    held = engine.generate(GenerationRequest(input_ids=list(PROMPT), request_output_len=N, end_id=stop, min_tokens=10))
    ref = hf_generate(hf, PROMPT, N, eos=stop, min_new_tokens=10)[0, len(PROMPT) :].tolist()
    assert held.new_tokens == ref[: len(held.new_tokens)] and len(held.new_tokens) > 10


def _penalty_reference(
    logits: np.ndarray,
    history: list[int],
    temperature: float,
    rep: float,
    pres: float,
    freq: float,
    ignore: int = 0,
):
    """TensorRT-LLM's batchApplyPenalty for one position, transcribed: temperature, then for each token seen:
    repetition (x or / by sign), presence once, frequency times its count; presence and frequency count the
    tokens after the first `ignore` (promptIgnoreLength), repetition every token."""
    out = logits.astype(np.float64) / temperature
    seen = np.bincount(np.asarray(history), minlength=len(out))
    counts = np.bincount(np.asarray(history[ignore:], dtype=np.int64), minlength=len(out))
    for token in np.nonzero(seen)[0]:
        v = out[token]
        out[token] = v * rep if v < 0 else v / rep
    for token in np.nonzero(counts)[0]:
        out[token] = out[token] - pres - freq * counts[token]
    return out


@pytest.mark.parametrize("ignore", [0, 4, len(PROMPT)])
def test_presence_and_frequency_penalties_follow_tensorrt_llm(engine, ignore):
    """Through the tensors, as the engine model takes them: `ignore` (promptIgnoreLength) travels as len_penalty,
    where TensorRT-LLM 1.2's backend puts it."""
    pen = Penalties(repetition=1.2, presence=0.5, frequency=0.7, prompt_ignore=ignore)
    request = GenerationRequest(
        input_ids=list(PROMPT), request_output_len=12, end_id=-1, penalties=pen, return_log_probs=True
    )
    tensors = request_to_tensors(request)
    assert ("len_penalty" in tensors) == (ignore > 0) and tensors_to_request(tensors).penalties.prompt_ignore == ignore
    out = engine.generate(tensors_to_request(tensors))
    seq = list(PROMPT)
    for i, token in enumerate(out.new_tokens):
        raw = engine.generate(
            GenerationRequest(input_ids=seq, request_output_len=1, end_id=-1, return_generation_logits=True)
        ).generation_logits[0]
        ref = _penalty_reference(raw, seq, 1.0, 1.2, 0.5, 0.7, ignore)
        assert token == int(np.argmax(ref)), f"position {i}"
        log_p = ref - np.logaddexp.reduce(ref)
        assert out.log_probs[i] == pytest.approx(log_p[token], abs=1e-4)
        seq.append(token)
    assert out.new_tokens != gen(engine, n=12, end_id=-1)  # the penalties changed something on this prompt


@pytest.mark.parametrize(
    "rules",
    [
        dict(penalties=Penalties(repetition=1.5, presence=0.3, frequency=0.4)),
        dict(penalties=Penalties(repetition=1.5, presence=0.3, frequency=0.4, prompt_ignore=len(PROMPT))),
        dict(bad_words="plain"),
        dict(min_tokens=6),
        dict(stop_words="plain"),
        dict(return_log_probs=True),
    ],
)
@pytest.mark.parametrize("draft_at,k", [(0, 4), (3, 3)])
def test_verification_chooses_what_plain_decoding_chooses(engine, rules, draft_at, k):
    """Accepted tokens + the target's own token = plain decoding's tokens, under every rule."""
    plain0 = gen(engine, n=N, end_id=-1)
    if rules.get("bad_words") == "plain":
        rules = dict(bad_words=[[plain0[draft_at + 1]], [plain0[draft_at], plain0[draft_at + 2]]])
    if rules.get("stop_words") == "plain":
        rules = dict(stop_words=[[plain0[draft_at + 1], plain0[draft_at + 2]]])
    kw = dict(rules, end_id=EOS if "min_tokens" not in rules else plain0[draft_at + 1])
    end_id = kw.pop("end_id")
    plain_full = engine.generate(GenerationRequest(input_ids=list(PROMPT), request_output_len=N, end_id=end_id, **kw))
    plain = plain_full.new_tokens
    if len(plain) <= draft_at + 1:
        pytest.skip("plain decoding ended before the draft")
    kw_v = dict(kw)
    if "min_tokens" in kw_v:
        kw_v["min_tokens"] = max(0, kw_v["min_tokens"] - draft_at)
    draft = list(plain[draft_at : draft_at + k]) + [5] * max(0, draft_at + k - len(plain))
    draft[-1] = (draft[-1] + 7) % 320
    result = engine.generate(
        GenerationRequest(
            input_ids=list(PROMPT) + plain[:draft_at],
            request_output_len=k + 1,
            end_id=end_id,
            draft_input_ids=draft,
            **kw_v,
        )
    )
    assert result.new_tokens == plain[draft_at : draft_at + len(result.new_tokens)]
    if "stop_words" in rules:
        assert len(result.new_tokens) <= 3  # the stop word completes at draft_at + 2
    if rules.get("return_log_probs"):
        np.testing.assert_allclose(
            result.log_probs, plain_full.log_probs[draft_at : draft_at + len(result.new_tokens)], atol=1e-5
        )


def test_stop_words_end_generation_after_the_word(engine):
    plain = gen(engine, end_id=-1)
    word = plain[4:6]
    out = gen(engine, end_id=-1, stop_words=[[999 % 320, 3], word])
    first = next(i for i in range(1, len(plain)) if plain[i - 1 : i + 1] == word)
    assert out == plain[: first + 1]


def test_log_probs_of_greedy_tokens_are_the_softmax_of_generation_logits(engine):
    out = engine.generate(
        GenerationRequest(
            input_ids=list(PROMPT),
            request_output_len=8,
            end_id=-1,
            return_log_probs=True,
            return_generation_logits=True,
        )
    )
    logits = out.generation_logits.astype(np.float64)
    expected = [row[t] - np.logaddexp.reduce(row) for row, t in zip(logits, out.new_tokens)]
    np.testing.assert_allclose(out.log_probs, expected, atol=1e-5)


def test_sampled_log_probs_include_the_temperature(engine):
    params = SamplingParams(temperature=0.7, top_k=0, top_p=1.0, seed=3)
    out = engine.generate(
        GenerationRequest(
            input_ids=list(PROMPT),
            request_output_len=6,
            end_id=-1,
            sampling=params,
            return_log_probs=True,
            return_generation_logits=True,
        )
    )
    logits = out.generation_logits.astype(np.float64) / 0.7
    expected = [row[t] - np.logaddexp.reduce(row) for row, t in zip(logits, out.new_tokens)]
    np.testing.assert_allclose(out.log_probs, expected, atol=1e-5)


def test_context_logits_are_the_logits_at_every_prompt_position(engine):
    out = engine.generate(
        GenerationRequest(
            input_ids=list(PROMPT),
            request_output_len=3,
            end_id=-1,
            return_context_logits=True,
            return_generation_logits=True,
        )
    )
    assert out.context_logits.shape == (len(PROMPT), engine.info.vocab_size)
    np.testing.assert_array_equal(out.context_logits[-1], out.generation_logits[0])
    for j in (0, 4):
        first = engine.generate(
            GenerationRequest(
                input_ids=list(PROMPT[: j + 1]), request_output_len=1, end_id=-1, return_generation_logits=True
            )
        ).generation_logits[0]
        np.testing.assert_allclose(out.context_logits[j], first, atol=1e-4, rtol=1e-4)
    # a second request of the same prompt still gets every position (nothing is served from the prefix cache)
    again = engine.generate(
        GenerationRequest(input_ids=list(PROMPT), request_output_len=1, end_id=-1, return_context_logits=True)
    )
    np.testing.assert_array_equal(again.context_logits, out.context_logits)


def test_word_lists_round_trip_in_tensorrt_llm_layout():
    words = [[5], [7, 8, 9], [11, 12]]
    t = request_to_tensors(GenerationRequest(input_ids=[1, 2], request_output_len=4, stop_words=words, bad_words=[[3]]))
    assert t["stop_words_list"].tolist() == [[[5, 7, 8, 9, 11, 12], [1, 4, 6, -1, -1, -1]]]
    assert t["bad_words_list"].tolist() == [[[3], [1]]]
    back = tensors_to_request(t)
    assert back.stop_words == words and back.bad_words == [[3]]
    t["stop_words_list"] = np.asarray([[[5, 7], [3, -1]]], dtype=np.int32)
    with pytest.raises(RequestError, match="stop_words_list"):
        tensors_to_request(t)


@pytest.mark.parametrize(
    "name,value,ok",
    [
        ("beam_width", np.int32(1), True),
        ("beam_width", np.int32(2), False),
        # 1.2.x's backend reads it as noRepeatNgramSize: refused, 1 included
        ("num_return_sequences", np.int32(1), False),
        ("num_return_sequences", np.int32(3), False),
        ("len_penalty", np.float32(0.3), True),  # promptIgnoreLength 0 in 1.2's backend: no effect
        ("len_penalty", np.float32(np.nan), False),  # converted to int32 there: undefined
        ("len_penalty", np.float32(3e9), False),
        ("early_stopping", np.bool_(True), True),
        ("embedding_bias", np.zeros((1, 0), np.float32), True),
        ("embedding_bias", np.ones((1, 320), np.float32), False),
        ("lora_task_id", np.uint64(4), False),
        ("lora_task_id", np.uint64(0), True),
        ("prompt_vocab_size", np.int32(0), True),
        ("prompt_vocab_size", np.int32(8), False),
        ("runtime_top_p_decay", np.float32(1.0), True),
        ("runtime_top_p_decay", np.float32(0.5), False),
        ("guided_decoding_guide_type", np.asarray([[b""]], dtype=object), True),
        ("guided_decoding_guide_type", np.asarray([[b"json"]], dtype=object), False),
        ("stop", np.bool_(False), True),  # stop: true is the engine model's stop request (tests/test_serving.py)
    ],
)
def test_unsupported_inputs_are_taken_only_at_their_neutral_value(engine, name, value, ok):
    t = request_to_tensors(GenerationRequest(input_ids=list(PROMPT), request_output_len=2, end_id=-1))
    t[name] = value if isinstance(value, np.ndarray) and value.ndim else np.asarray([[value]])
    if ok:
        assert len(engine.serve(t)["output_ids"][0, 0]) == len(PROMPT) + 2
    else:
        with pytest.raises(RequestError, match=name):
            engine.serve(t)


def test_bad_penalty_is_refused_naming_it(engine):
    with pytest.raises(RequestError, match="repetition_penalty"):
        gen(engine, penalties=Penalties(repetition=0.0))
    with pytest.raises(RequestError, match="bad_words_list"):
        gen(engine, bad_words=[[100000]])


@pytest.mark.parametrize("temperature", [-0.5, float("nan")])
def test_a_temperature_the_executor_refuses_is_refused_naming_it(engine, temperature):
    """TensorRT-LLM's SamplingConfig::checkTemperature requires temperature >= 0, which NaN fails too; a direct
    caller of tensorrt_llm is refused so, not answered with what a NaN distribution samples."""
    with pytest.raises(RequestError, match=r"^temperature: must be >= 0"):
        gen(engine, sampling=SamplingParams(temperature=temperature, top_p=1.0))


def test_a_streamed_response_without_tokens_keeps_its_empty_generation_logits():
    """A streaming engine's last response may carry no token (the call ended on the end token, which it does not
    return): its generation logits are [1, 1, 0, V], and reading them gives an empty [0, V] block, not an error."""
    from trtspec.contract import tensors_to_result

    out = tensors_to_result(
        {
            "output_ids": np.zeros((1, 1, 0), np.int32),
            "sequence_length": np.zeros((1, 1), np.int32),
            "generation_logits": np.zeros((1, 1, 0, 320), np.float32),
        },
        [],
        excluded=True,
    )
    assert out.new_tokens == [] and out.generation_logits.shape == (0, 320)
