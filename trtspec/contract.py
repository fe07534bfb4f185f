"""The tensor contract between the orchestrator and an engine: TRT-LLM's `tensorrt_llm` model.

The name tables (trtspec.interfaces) describe the tensors (name, dtype, dims) exactly as NVIDIA's models'
config.pbtxt files do; the Triton configs, the engine model, the BLS client and the in-process client are all
driven by them.
The orchestrator works with the typed `GenerationRequest` / `GenerationResult` below and never sees a
tensor; `request_to_tensors` and friends are the one place where the two meet.

Tensors carry the batch dim first (one request: [1, ...]), as the Python backend hands them over.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass, field

import numpy as np

from trtspec.errors import RequestError
from trtspec.interfaces import (  # noqa: F401  (the engine tables are part of the contract)
    BLS_INPUTS,
    BLS_OUTPUTS,
    ENGINE_INPUTS,
    ENGINE_OUTPUT_NAMES,
    ENGINE_OUTPUTS,
    NP_DTYPES,
    PERF_OUTPUTS,
    TensorSpec,
    neutral_problem,
)

KV_TOKENS_PER_BLOCK = 32  # block size the embedded engine reports reuse in (TRT-LLM's default tokens_per_block)


@dataclass(frozen=True)
class SamplingParams:
    """TRT-LLM's runtime sampling fields, meaning what TensorRT-LLM means by them: top_k 0 is no top-k filter and
    top_p 0 (or below) no nucleus filter, but both 0 together is greedy, as is temperature 0 or top_k 1
    (regularizeTopKTopP in cpp/tensorrt_llm/kernels/samplingTopKKernels.h: "if (topK == 0 && topP == 0.0f)
    topK = 1"; SamplingConfig::validate turns temperature 0 into top-k 1). So unrestricted sampling at a
    temperature is top_k 0 with top_p 1.0."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 0.0  # <= 0 or 1: no nucleus filter
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1 or (self.top_k == 0 and self.top_p <= 0.0)


@dataclass(frozen=True)
class Penalties:
    """TensorRT-LLM's repetition, presence and frequency penalties. They count every token of the sequence, the
    prompt's too (penaltyKernels.cu: the context phase counts the input), and apply after the temperature:
    logit/T, then x rp (negative) or / rp (positive), minus presence once, minus frequency x count.
    `prompt_ignore`: SamplingConfig's promptIgnoreLength, the first tokens of the call's input that presence and
    frequency do not count (repetition still does); 0 counts them all, and more than the input counts none of it.
    A request that counts only its answer, as OpenAI's penalties do, ignores its prompt's length."""

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    prompt_ignore: int = 0

    @property
    def active(self) -> bool:
        return self.repetition != 1.0 or self.presence != 0.0 or self.frequency != 0.0


@dataclass
class GenerationRequest:
    """One request to an engine (the `tensorrt_llm` inputs, without the batch dim)."""

    input_ids: list[int]
    request_output_len: int
    end_id: int | None = None
    pad_id: int | None = None
    min_tokens: int = 0
    sampling: SamplingParams = SamplingParams()
    draft_input_ids: list[int] | None = None
    draft_logits: np.ndarray | None = None  # [k, V] float32
    return_generation_logits: bool = False
    exclude_input_in_output: bool = False
    return_perf_metrics: bool = False  # the PERF_OUTPUTS, as TensorRT-LLM writes them only when asked
    penalties: Penalties = Penalties()
    stop_words: list[list[int]] = field(default_factory=list)  # generation ends after any of these
    bad_words: list[list[int]] = field(default_factory=list)  # never generated
    return_log_probs: bool = False  # cum_log_probs and output_log_probs
    return_context_logits: bool = False  # context_logits: the logits at every prompt position
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


@dataclass
class GenerationResult:
    output_ids: list[int]  # prompt + new tokens, or new tokens only with exclude_input_in_output
    new_tokens: list[int]
    generation_logits: np.ndarray | None = None  # [len(new_tokens), V] float32, when asked for
    _: KW_ONLY
    num_draft_tokens: int = 0  # draft tokens the call verified
    num_accepted_tokens: int = 0  # of those, accepted
    reused_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    computed_tokens: int = 0  # tokens that went through the network
    seconds: float = field(default=0.0, compare=False)
    times_ns: tuple[int, int, int, int] = field(default=(0, 0, 0, 0), compare=False)  # arrival, first scheduled,
    # first token, last token (steady clock, as TensorRT-LLM's perf outputs)
    log_probs: list[float] | None = None  # per new token, from the distribution it was drawn from (when asked for)
    context_logits: np.ndarray | None = None  # [len(input_ids), V] float32, when asked for
    kv_blocks: tuple[int, int, int] | None = None  # new, reused, total KV blocks (with return_perf_metrics)

    @property
    def sequence_length(self) -> int:
        return len(self.output_ids)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class StopWords:
    """A request's stop words by length, so that whether a sequence ends with one costs a set lookup per length
    however many there are (a plain call that prompt lookup may end carries hundreds)."""

    def __init__(self, words: list[list[int]]):
        self.by_length: dict[int, set[tuple[int, ...]]] = {}
        for w in words:
            if w:
                self.by_length.setdefault(len(w), set()).add(tuple(w))

    def __bool__(self) -> bool:
        return bool(self.by_length)

    @property
    def longest(self) -> int:
        return max(self.by_length, default=0)

    def completed_by(self, sequence: list[int]) -> bool:
        """Whether `sequence` ends with one of the words."""
        return any(n <= len(sequence) and tuple(sequence[-n:]) in grams for n, grams in self.by_length.items())


# ---- conversions ------------------------------------------------------------------------------------------


def request_to_tensors(r: GenerationRequest) -> dict[str, np.ndarray]:
    t = {
        "input_ids": np.asarray([r.input_ids], dtype=np.int32),
        "input_lengths": np.asarray([[len(r.input_ids)]], dtype=np.int32),
        "request_output_len": np.asarray([[r.request_output_len]], dtype=np.int32),
        "min_tokens": np.asarray([[r.min_tokens]], dtype=np.int32),
        "temperature": np.asarray([[r.sampling.temperature]], dtype=np.float32),
        "runtime_top_k": np.asarray([[r.sampling.top_k]], dtype=np.int32),
        "runtime_top_p": np.asarray([[r.sampling.top_p]], dtype=np.float32),
        "exclude_input_in_output": np.asarray([[r.exclude_input_in_output]], dtype=np.bool_),
    }
    if r.return_generation_logits:  # false when absent, here as in TensorRT-LLM (utils.cc getOutputConfigFromTensors)
        t["return_generation_logits"] = np.asarray([[True]], dtype=np.bool_)
    if r.return_perf_metrics:
        t["return_perf_metrics"] = np.asarray([[True]], dtype=np.bool_)
    if r.end_id is not None:
        t["end_id"] = np.asarray([[r.end_id]], dtype=np.int32)
    if r.pad_id is not None:
        t["pad_id"] = np.asarray([[r.pad_id]], dtype=np.int32)
    if r.sampling.seed is not None:
        t["seed"] = np.asarray([[r.sampling.seed]], dtype=np.uint64)
    if r.draft_input_ids:
        t["draft_input_ids"] = np.asarray([r.draft_input_ids], dtype=np.int32)
        if r.draft_logits is not None:
            t["draft_logits"] = np.asarray(r.draft_logits, dtype=np.float32)[None]
    pen = r.penalties
    for name, value, neutral in (
        ("repetition_penalty", pen.repetition, 1.0),
        ("presence_penalty", pen.presence, 0.0),
        ("frequency_penalty", pen.frequency, 0.0),
    ):
        if value != neutral:
            t[name] = np.asarray([[value]], dtype=np.float32)
    if pen.prompt_ignore > 0 and (pen.presence or pen.frequency):
        t[PROMPT_IGNORE_WIRE] = np.asarray([[pen.prompt_ignore]], dtype=np.float32)
    for name, words in (("stop_words_list", r.stop_words), ("bad_words_list", r.bad_words)):
        if words:
            t[name] = word_list_tensor(words)
    for name in ("return_log_probs", "return_context_logits", "return_num_input_tokens", "return_num_output_tokens"):
        if getattr(r, name):
            t[name] = np.asarray([[True]], dtype=np.bool_)
    return t


def word_list_tensor(words: list[list[int]]) -> np.ndarray:
    """Token-id words -> TensorRT-LLM's word-list layout, [1, 2, n]: the ids of every word one after another,
    and under them each word's end offset, padded with -1."""
    flat = [t for w in words for t in w]
    ends = np.cumsum([len(w) for w in words]).tolist()
    width = max(len(flat), len(ends))
    out = np.full((1, 2, width), -1, dtype=np.int32)
    out[0, 0, : len(flat)] = flat
    out[0, 1, : len(ends)] = ends
    return out


def word_lists(t: dict, name: str) -> list[list[int]]:
    """The words of a [1, 2, n] (or [2, n]) word-list tensor; raises RequestError naming it when malformed."""
    arr = np.asarray(t[name])
    if arr.ndim == 3 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 2 or arr.shape[0] != 2:
        raise RequestError(
            name,
            f"expected shape [1, 2, n] (ids, then end offsets padded with -1), got {list(np.asarray(t[name]).shape)}",
        )
    ids, ends = arr[0].astype(int).tolist(), arr[1].astype(int).tolist()
    words, start = [], 0
    for end in ends:
        if end < 0:
            break
        if not start < end <= len(ids):
            raise RequestError(name, f"end offsets must increase within the {len(ids)} ids, got {ends}")
        words.append(ids[start:end])
        start = end
    return words


def check_neutral(t: dict[str, np.ndarray], specs=ENGINE_INPUTS) -> None:
    """Refuse, naming the input, any input this deployment takes only at its neutral value and got another."""
    for spec in specs:
        if spec.name in t:
            problem = neutral_problem(spec, t[spec.name])
            if problem:
                raise RequestError(spec.name, problem)


# The retention hints change only which KV blocks a cache keeps, so the engine ignores them, but it refuses what
# TensorRT-LLM refuses: utils.cc getKvCacheRetentionConfigFromTensors (c8c6df08) and the KvCacheRetentionConfig
# constructor (kvCacheRetentionConfig.cpp), whose priorities lie in [kMinRetentionPriority, kMaxRetentionPriority].
_RETENTION = "retention_token_range_"
_PRIORITIES = range(0, 101)


def check_retention(t: dict[str, np.ndarray]) -> None:
    """Refuse retention hints TensorRT-LLM's backend would refuse, naming the input."""
    for priority in np.asarray(t.get("retention_decode_priority", [])).reshape(-1).tolist():
        if int(priority) not in _PRIORITIES:
            raise RequestError("retention_decode_priority", f"a priority must lie in [0, 100], got {priority}")
    if _RETENTION + "starts" not in t:
        return
    starts = np.asarray(t[_RETENTION + "starts"]).reshape(-1).astype(int).tolist()
    columns = {}
    for name, required in (("ends", True), ("priorities", True), ("durations_ms", False)):
        given = _RETENTION + name in t
        values = np.asarray(t[_RETENTION + name]).reshape(-1).astype(int).tolist() if given else None
        if (required and not given) or (given and len(values) != len(starts)):
            must = "must be provided, and have" if required else "must have"
            raise RequestError(_RETENTION + name, f"{must} the same length as {_RETENTION}starts")
        columns[name] = values
    for priority in columns["priorities"]:
        if int(priority) not in _PRIORITIES:
            raise RequestError(_RETENTION + "priorities", f"a priority must lie in [0, 100], got {priority}")
    ranges = sorted(zip(starts, [None if end == -1 else end for end in columns["ends"]], strict=True))
    for i, (start, end) in enumerate(ranges):
        if end is None and i != len(ranges) - 1:
            raise RequestError(_RETENTION + "ends", "only the last range may run to the end (-1)")
        if start < 0:
            raise RequestError(_RETENTION + "starts", "token indices must be non-negative")
        if end is not None and start >= end:
            raise RequestError(_RETENTION + "ends", "a range must have a positive, non-zero length")
        if i != len(ranges) - 1 and end > ranges[i + 1][0]:
            raise RequestError(_RETENTION + "starts", "token ranges must be non-overlapping")


# The tensorrt_llm input that carries promptIgnoreLength in TensorRT-LLM 1.2.x. Its Triton backend builds the
# SamplingConfig positionally with 17 arguments, and PR #8127 (1.2.0rc) had put promptIgnoreLength 14th of 20, so
# len_penalty lands there, converted to an int, and each argument after it one slot on (utils.cc
# getSamplingConfigFromTensors against executor.h's constructor, as NVIDIA's PR #13633 describes it for 1.2.0rc4 and
# 1.2.0; 1.2.1 was released on 2026-04-20, before that fix was merged on 2026-05-01). After the fix a
# `prompt_ignore_length` input carries it and len_penalty is a length penalty again (nothing at beam width 1).
PROMPT_IGNORE_WIRE = "len_penalty"
# The same shift sends num_return_sequences, the call's 17th argument, to noRepeatNgramSize: there 1 forbids every
# token the sequence already holds, so 1.2.x answers it as no client means it. The engine refuses it in any value,
# naming why, rather than serve it as if it asked for one sequence.
SHIFTED_INPUTS = {
    "num_return_sequences": "TensorRT-LLM 1.2.x's tensorrtllm backend passes it to the sampler as noRepeatNgramSize "
    "(1 would forbid repeating any token of the sequence); leave it out: the engine returns one sequence",
}
# The releases whose backend is known to do so (1.2.0 by NVIDIA's PR, 1.2.1 by its date); the embedded engine
# follows the pinned one.
PROMPT_IGNORE_RELEASES = ("1.2.0", "1.2.1")


def takes_prompt_ignore(backend: str, version: str) -> bool:
    """Whether an engine of this backend and TensorRT-LLM version (its config.json's) reads PROMPT_IGNORE_WIRE as
    promptIgnoreLength."""
    return backend == "torch" or version in PROMPT_IGNORE_RELEASES


def _prompt_ignore(t: dict[str, np.ndarray]) -> int:
    value = _scalar(t, PROMPT_IGNORE_WIRE, float, 0.0)
    if not (math.isfinite(value) and abs(value) < 2**31):  # C++ converts it to int32: beyond that, undefined
        raise RequestError(PROMPT_IGNORE_WIRE, f"must be a finite number of tokens below 2**31, got {value}")
    return max(0, int(value))  # toward zero, as C++ converts; <= 0: no effect


def tensors_to_request(t: dict[str, np.ndarray]) -> GenerationRequest:
    """Tensors of one request (batch dim 1) -> GenerationRequest; raises RequestError naming the tensor."""
    for name, why in SHIFTED_INPUTS.items():
        if name in t and np.asarray(t[name]).size:
            raise RequestError(name, why)
    check_neutral(t)
    check_retention(t)
    for spec in ENGINE_INPUTS:
        if not spec.optional and spec.name not in t:
            raise RequestError(spec.name, "is required")
    if "input_ids" not in t:
        raise RequestError("input_ids", "is required")
    ids = _row(t, "input_ids")
    length = _scalar(t, "input_lengths", int)
    if length != len(ids):
        if not 0 < length <= len(ids):
            raise RequestError("input_lengths", f"{length} does not match input_ids of length {len(ids)}")
        ids = ids[:length]  # ragged batches arrive padded; input_lengths says where each row ends
    draft = _row(t, "draft_input_ids") if "draft_input_ids" in t else None
    draft_logits = None
    if "draft_logits" in t:
        draft_logits = np.asarray(t["draft_logits"], dtype=np.float32)
        draft_logits = draft_logits.reshape(draft_logits.shape[-2:]) if draft_logits.ndim == 3 else draft_logits
    seed = _scalar(t, "seed", int, None)
    return GenerationRequest(
        input_ids=ids,
        request_output_len=_scalar(t, "request_output_len", int),
        end_id=_scalar(t, "end_id", int, None),
        pad_id=_scalar(t, "pad_id", int, None),
        min_tokens=_scalar(t, "min_tokens", int, 0),
        sampling=SamplingParams(
            temperature=_scalar(t, "temperature", float, 1.0),  # TensorRT-LLM's default when absent
            top_k=_scalar(t, "runtime_top_k", int, 0),
            top_p=_scalar(t, "runtime_top_p", float, 0.0),
            seed=seed,
        ),
        draft_input_ids=draft or None,
        draft_logits=draft_logits,
        return_generation_logits=_scalar(t, "return_generation_logits", bool, False),
        exclude_input_in_output=_scalar(t, "exclude_input_in_output", bool, False),
        return_perf_metrics=_scalar(t, "return_perf_metrics", bool, False),
        penalties=Penalties(
            repetition=_scalar(t, "repetition_penalty", float, 1.0),
            presence=_scalar(t, "presence_penalty", float, 0.0),
            frequency=_scalar(t, "frequency_penalty", float, 0.0),
            prompt_ignore=_prompt_ignore(t),
        ),
        stop_words=word_lists(t, "stop_words_list") if "stop_words_list" in t else [],
        bad_words=word_lists(t, "bad_words_list") if "bad_words_list" in t else [],
        return_log_probs=_scalar(t, "return_log_probs", bool, False),
        return_context_logits=_scalar(t, "return_context_logits", bool, False),
        return_num_input_tokens=_scalar(t, "return_num_input_tokens", bool, False),
        return_num_output_tokens=_scalar(t, "return_num_output_tokens", bool, False),
    )


def result_to_tensors(
    r: GenerationResult,
    *,
    with_logits: bool,
    with_perf: bool,
    input_tokens: int | None = None,
    output_tokens: bool = False,
) -> dict[str, np.ndarray]:
    """`input_tokens`: the prompt's length, for num_input_tokens (return_num_input_tokens); `output_tokens`: write
    num_output_tokens (return_num_output_tokens). Log probs and context logits go out when the result has them."""
    t = {
        "output_ids": np.asarray([[r.output_ids]], dtype=np.int32),  # [batch, beam, len]
        "sequence_length": np.asarray([[r.sequence_length]], dtype=np.int32),
    }
    if with_logits and r.generation_logits is not None:
        t["generation_logits"] = np.asarray(r.generation_logits, dtype=np.float32)[None, None]
    if r.log_probs is not None:
        t["output_log_probs"] = np.asarray([[r.log_probs]], dtype=np.float32)  # [batch, beam, new tokens]
        t["cum_log_probs"] = np.asarray([[sum(r.log_probs)]], dtype=np.float32)  # [batch, beam]
    if r.context_logits is not None:
        t["context_logits"] = np.asarray(r.context_logits, dtype=np.float32)[None]  # [batch, prompt, vocab]
    if input_tokens is not None:
        t["num_input_tokens"] = np.asarray([[input_tokens]], dtype=np.int32)
    if output_tokens:
        t["num_output_tokens"] = np.asarray([[len(r.new_tokens)]], dtype=np.int32)
    if with_perf:  # all of PERF_OUTPUTS, as TensorRT-LLM writes them
        blocks = -(-(r.reused_tokens + r.computed_tokens) // KV_TOKENS_PER_BLOCK)
        reused = r.reused_tokens // KV_TOKENS_PER_BLOCK
        values = {
            "kv_cache_alloc_new_blocks": blocks - reused,
            "kv_cache_reused_blocks": reused,
            "kv_cache_alloc_total_blocks": blocks,
            "arrival_time_ns": r.times_ns[0],
            "first_scheduled_time_ns": r.times_ns[1],
            "first_token_time_ns": r.times_ns[2],
            "last_token_time_ns": r.times_ns[3],
            "acceptance_rate": r.acceptance_rate,
            "total_accepted_draft_tokens": r.num_accepted_tokens,
            "total_draft_tokens": r.num_draft_tokens,
        }
        for spec in PERF_OUTPUTS:
            t[spec.name] = np.asarray([[values[spec.name]]], dtype=spec.np_dtype)
    return t


def tensors_to_result(
    t: dict[str, np.ndarray], prompt: list[int], excluded: bool = False, log_probs_from: int = 0
) -> GenerationResult:
    """Engine outputs -> GenerationResult; `prompt` is what was sent (to split off the new tokens).
    `log_probs_from`: where this response's tokens start in its `output_log_probs`, which a streaming call fills
    with the log probs of every token it has generated so far (see StreamedResults)."""
    out = np.asarray(t["output_ids"])
    length = int(np.asarray(t["sequence_length"]).reshape(-1)[0])
    # [batch, beam, len]; a streamed response may hold no token at all (a stopped call's last)
    ids = out.reshape(-1, out.shape[-1])[0][:length].astype(int).tolist() if out.size else []
    new = ids if excluded else ids[len(prompt) :]
    logits = t.get("generation_logits")
    if logits is not None:
        logits = np.asarray(logits, dtype=np.float32)
        # the leading dims by their product: -1 cannot be inferred when a response carries no token (shape [.., 0, V])
        logits = logits.reshape(int(np.prod(logits.shape[:-2])), *logits.shape[-2:])[0]
    drafted = int(np.asarray(t["total_draft_tokens"]).reshape(-1)[0]) if "total_draft_tokens" in t else 0
    accepted = (
        int(np.asarray(t["total_accepted_draft_tokens"]).reshape(-1)[0]) if "total_accepted_draft_tokens" in t else 0
    )
    reused = (
        int(np.asarray(t["kv_cache_reused_blocks"]).reshape(-1)[0]) * KV_TOKENS_PER_BLOCK
        if "kv_cache_reused_blocks" in t
        else 0
    )
    log_probs = None
    if "output_log_probs" in t:
        values = np.asarray(t["output_log_probs"], dtype=np.float32).reshape(-1)
        log_probs = values[log_probs_from : log_probs_from + len(new)].tolist()
    context = t.get("context_logits")
    if context is not None:
        context = np.asarray(context, dtype=np.float32).reshape(-1, np.asarray(context).shape[-1])
    kv = None
    if "kv_cache_alloc_total_blocks" in t:
        kv = tuple(
            int(np.asarray(t[n]).reshape(-1)[0])
            for n in ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks")
        )
    return GenerationResult(
        ids,
        new,
        logits,
        num_draft_tokens=drafted,
        num_accepted_tokens=accepted,
        reused_tokens=reused,
        log_probs=log_probs,
        context_logits=context,
        kv_blocks=kv,
    )


class StreamedResults:
    """One streaming call's responses, each as a GenerationResult of the tokens it brings and their log probs.
    TensorRT-LLM streams only the tokens since the previous response (LlmRequest::createResult slices
    outputTokenIds from getMaxSentTokenLen()) but the log probs of every token the call has generated so far
    (`result.logProbs = sliceBeams(getLogProbs())`, unsliced: cpp/tensorrt_llm/batch_manager/llmRequest.cpp,
    NVIDIA/TensorRT-LLM 89fd9b74; fillTritonResponse writes that list as output_log_probs [1, beams, n]), so each
    response's own log probs start after the tokens the call sent before it. A stopped call's last response
    may list one more log prob than the tokens it sent: the step the stop discarded (clearGeneratedTokens)."""

    def __init__(self):
        self.tokens = 0  # the call's tokens in the responses read so far

    def __call__(self, t: dict[str, np.ndarray]) -> GenerationResult:
        result = tensors_to_result(t, [], excluded=True, log_probs_from=self.tokens)
        self.tokens += len(result.new_tokens)
        return result


def _row(t: dict, name: str) -> list[int]:
    arr = np.asarray(t[name])
    if arr.ndim == 0 or arr.ndim > 2 or (arr.ndim == 2 and arr.shape[0] != 1):
        raise RequestError(name, f"expected shape [1, n] (one request), got {list(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise RequestError(name, f"expected integer token ids, got {arr.dtype}")
    return arr.reshape(-1).astype(np.int64).tolist()


def _scalar(t: dict, name: str, kind, default=...):
    if name not in t:
        if default is ...:
            raise RequestError(name, "is required")
        return default
    arr = np.asarray(t[name]).reshape(-1)
    if arr.size != 1:
        raise RequestError(name, f"expected one value, got {arr.size}")
    value = arr[0]
    return bool(value) if kind is bool else kind(value)
