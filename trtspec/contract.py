"""The tensor contract between the orchestrator and an engine: TRT-LLM's `tensorrt_llm` model.

One name table describes the tensors (name, dtype, dims) exactly as the `tensorrt_llm` model's config.pbtxt
does; the Triton configs, the engine model, the BLS client and the in-process client are all driven by it.
The orchestrator works with the typed `GenerationRequest` / `GenerationResult` below and never sees a
tensor; `request_to_tensors` and friends are the one place where the two meet.

Tensors carry the batch dim first (one request: [1, ...]), as the Python backend hands them over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trtspec.errors import RequestError


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str             # Triton's TYPE_* name without the prefix
    dims: tuple[int, ...]  # without the batch dim
    optional: bool = True

    @property
    def np_dtype(self):
        return NP_DTYPES[self.dtype]


NP_DTYPES = {"INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_, "STRING": np.object_}

# The subset of `tensorrt_llm`'s inputs and outputs (reference: tensorrtllm_backend config.pbtxt) that
# speculative decoding uses. Names, dtypes and dims follow it exactly so the same BLS talks to TRT-LLM.
ENGINE_INPUTS = (
    TensorSpec("input_ids", "INT32", (-1,)),
    TensorSpec("input_lengths", "INT32", (1,), optional=False),
    TensorSpec("request_output_len", "INT32", (1,), optional=False),
    TensorSpec("draft_input_ids", "INT32", (-1,)),
    TensorSpec("draft_logits", "FP32", (-1, -1)),
    TensorSpec("end_id", "INT32", (1,)),
    TensorSpec("pad_id", "INT32", (1,)),
    TensorSpec("min_tokens", "INT32", (1,)),
    TensorSpec("temperature", "FP32", (1,)),
    TensorSpec("runtime_top_k", "INT32", (1,)),
    TensorSpec("runtime_top_p", "FP32", (1,)),
    TensorSpec("seed", "UINT64", (1,)),
    TensorSpec("return_generation_logits", "BOOL", (1,)),
    TensorSpec("return_perf_metrics", "BOOL", (1,)),
    TensorSpec("exclude_input_in_output", "BOOL", (1,)),
    TensorSpec("streaming", "BOOL", (1,)),
)
# The outputs TensorRT-LLM's `tensorrtllm` backend writes when (and only when) a request sets return_perf_metrics,
# all of them, with no check that the config declares them, so a config must declare every one
# (triton_backend/inflight_batcher_llm/src/model_instance_state.cc, fillTritonResponse, 1.2.0rc8).
PERF_OUTPUTS = (
    TensorSpec("kv_cache_alloc_new_blocks", "INT32", (1,)),
    TensorSpec("kv_cache_reused_blocks", "INT32", (1,)),
    TensorSpec("kv_cache_alloc_total_blocks", "INT32", (1,)),
    TensorSpec("arrival_time_ns", "INT64", (1,)),
    TensorSpec("first_scheduled_time_ns", "INT64", (1,)),
    TensorSpec("first_token_time_ns", "INT64", (1,)),
    TensorSpec("last_token_time_ns", "INT64", (1,)),
    TensorSpec("acceptance_rate", "FP32", (1,)),
    TensorSpec("total_accepted_draft_tokens", "INT32", (1,)),
    TensorSpec("total_draft_tokens", "INT32", (1,)),
)
ENGINE_OUTPUTS = (
    TensorSpec("output_ids", "INT32", (-1, -1)),
    TensorSpec("sequence_length", "INT32", (-1,)),
    TensorSpec("generation_logits", "FP32", (-1, -1, -1)),
    *PERF_OUTPUTS,
)
ENGINE_OUTPUT_NAMES = tuple(t.name for t in ENGINE_OUTPUTS)

# The client-facing `tensorrt_llm_bls` model (reference §2.3): the stock names and types, and trtspec's
# additions (acceptance statistics, timings, finish_reason) as new optional outputs. Dims without the batch dim.
BLS_INPUTS = (
    TensorSpec("text_input", "STRING", (1,), optional=False),
    TensorSpec("max_tokens", "INT32", (1,), optional=False),
    TensorSpec("num_draft_tokens", "INT32", (1,)),
    TensorSpec("use_draft_logits", "BOOL", (1,)),
    TensorSpec("stream", "BOOL", (1,)),
    TensorSpec("temperature", "FP32", (1,)),
    TensorSpec("top_k", "INT32", (1,)),
    TensorSpec("top_p", "FP32", (1,)),
    TensorSpec("seed", "UINT64", (1,)),
    TensorSpec("end_id", "INT32", (1,)),
    TensorSpec("pad_id", "INT32", (1,)),
    TensorSpec("min_tokens", "INT32", (1,)),
    TensorSpec("stop_words", "STRING", (-1,)),
    TensorSpec("bad_words", "STRING", (-1,)),
    TensorSpec("return_perf_metrics", "BOOL", (1,)),
    TensorSpec("exclude_input_in_output", "BOOL", (1,)),
    TensorSpec("speculation", "STRING", (1,)),        # "draft_model" | "prompt_lookup" | "none"
    TensorSpec("adaptive_draft_length", "BOOL", (1,)),  # false: draft exactly num_draft_tokens every iteration
    TensorSpec("timeout_ms", "INT32", (1,)),            # the request ends with an error past this many ms
)
BLS_OUTPUTS = (
    TensorSpec("text_output", "STRING", (-1,)),
    TensorSpec("output_ids", "INT32", (-1,)),          # the token ids of this response
    TensorSpec("acceptance_rate", "FP32", (1,)),
    TensorSpec("total_accepted_draft_tokens", "INT32", (1,)),
    TensorSpec("total_draft_tokens", "INT32", (1,)),
    TensorSpec("num_iterations", "INT32", (1,)),
    TensorSpec("draft_time_ms", "FP32", (1,)),
    TensorSpec("verify_time_ms", "FP32", (1,)),
    TensorSpec("accepted_per_position", "INT32", (-1,)),
    TensorSpec("drafted_per_position", "INT32", (-1,)),
    TensorSpec("finish_reason", "STRING", (1,)),
    TensorSpec("fallbacks", "INT32", (1,)),             # times speculation was switched off for this request
    TensorSpec("fallback_reasons", "STRING", (-1,)),    # "reason:count" for each reason
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
    top_k: int = 0          # 0: no top-k filter
    top_p: float = 0.0      # <= 0 or 1: no nucleus filter
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1 or (self.top_k == 0 and self.top_p <= 0.0)


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
    draft_logits: np.ndarray | None = None   # [k, V] float32
    return_generation_logits: bool = False
    exclude_input_in_output: bool = False
    return_perf_metrics: bool = False        # the PERF_OUTPUTS, as TensorRT-LLM writes them only when asked


@dataclass
class GenerationResult:
    output_ids: list[int]                 # prompt + new tokens, or new tokens only with exclude_input_in_output
    new_tokens: list[int]
    generation_logits: np.ndarray | None = None  # [len(new_tokens), V] float32, when asked for
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    reused_tokens: int = 0                # prompt tokens whose KV came from the prefix cache
    computed_tokens: int = 0              # tokens that went through the network
    seconds: float = field(default=0.0, compare=False)
    times_ns: tuple[int, int, int, int] = field(default=(0, 0, 0, 0), compare=False)  # arrival, first scheduled,
                                          # first token, last token (steady clock, as TensorRT-LLM's perf outputs)

    @property
    def sequence_length(self) -> int:
        return len(self.output_ids)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


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
        "return_generation_logits": np.asarray([[r.return_generation_logits]], dtype=np.bool_),
        "exclude_input_in_output": np.asarray([[r.exclude_input_in_output]], dtype=np.bool_),
    }
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
    return t


def tensors_to_request(t: dict[str, np.ndarray]) -> GenerationRequest:
    """Tensors of one request (batch dim 1) -> GenerationRequest; raises RequestError naming the tensor."""
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
    )


def result_to_tensors(r: GenerationResult, *, with_logits: bool, with_perf: bool) -> dict[str, np.ndarray]:
    t = {
        "output_ids": np.asarray([[r.output_ids]], dtype=np.int32),  # [batch, beam, len]
        "sequence_length": np.asarray([[r.sequence_length]], dtype=np.int32),
    }
    if with_logits and r.generation_logits is not None:
        t["generation_logits"] = np.asarray(r.generation_logits, dtype=np.float32)[None, None]
    if with_perf:  # all of PERF_OUTPUTS, as TensorRT-LLM writes them
        blocks = -(-(r.reused_tokens + r.computed_tokens) // KV_TOKENS_PER_BLOCK)
        reused = r.reused_tokens // KV_TOKENS_PER_BLOCK
        values = {
            "kv_cache_alloc_new_blocks": blocks - reused, "kv_cache_reused_blocks": reused,
            "kv_cache_alloc_total_blocks": blocks,
            "arrival_time_ns": r.times_ns[0], "first_scheduled_time_ns": r.times_ns[1],
            "first_token_time_ns": r.times_ns[2], "last_token_time_ns": r.times_ns[3],
            "acceptance_rate": r.acceptance_rate, "total_accepted_draft_tokens": r.num_accepted_draft_tokens,
            "total_draft_tokens": r.num_draft_tokens,
        }
        for spec in PERF_OUTPUTS:
            t[spec.name] = np.asarray([[values[spec.name]]], dtype=spec.np_dtype)
    return t


def tensors_to_result(t: dict[str, np.ndarray], prompt: list[int], excluded: bool = False) -> GenerationResult:
    """Engine outputs -> GenerationResult; `prompt` is what was sent (to split off the new tokens)."""
    out = np.asarray(t["output_ids"]).reshape(-1, np.asarray(t["output_ids"]).shape[-1])[0]
    length = int(np.asarray(t["sequence_length"]).reshape(-1)[0])
    ids = out[:length].astype(int).tolist()
    new = ids if excluded else ids[len(prompt):]
    logits = t.get("generation_logits")
    if logits is not None:
        logits = np.asarray(logits, dtype=np.float32).reshape(-1, *np.asarray(logits).shape[-2:])[0]
    drafted = int(np.asarray(t["total_draft_tokens"]).reshape(-1)[0]) if "total_draft_tokens" in t else 0
    accepted = int(np.asarray(t["total_accepted_draft_tokens"]).reshape(-1)[0]) if "total_accepted_draft_tokens" in t else 0
    reused = int(np.asarray(t["kv_cache_reused_blocks"]).reshape(-1)[0]) * KV_TOKENS_PER_BLOCK if "kv_cache_reused_blocks" in t else 0
    return GenerationResult(ids, new, logits, drafted, accepted, reused)


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
