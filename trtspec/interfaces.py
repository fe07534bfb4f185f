"""The tensors of the models `trtspec deploy` writes, as NVIDIA declares them for the models of the same name.

Source: NVIDIA/TensorRT-LLM, `triton_backend/all_models/inflight_batcher_llm/<model>/config.pbtxt`, the latest
versions before the pinned release 1.2.1: tensorrt_llm at 0c8de69a1ca6213eebb20a51873890ff128666c2 (1.2.0rc8; its
tensors are those of 2a9abd9536aa62ad3e4b9314be9286b1b1be523b too), the others at the commit named above each
table. NVIDIA templates some dtypes; these are the values trtspec fills in: FP32 logits (trtspec builds
float32 logits), FP16 prompt tables and encoder features. Names,
dtypes, dims, optional flags, reshapes and ragged batching are NVIDIA's, so a client written against NVIDIA's
repository sends nothing a trtspec deployment refuses for its shape. trtspec's own additions (the BLS's
speculation statistics and controls) are marked `extension`.

What an input means to trtspec is its `support`:
- USED: it does what TensorRT-LLM does with it;
- IGNORED: accepted, because it changes nothing at beam width 1 (beam-search knobs) or only which KV blocks a
  cache keeps (retention hints, refused where TensorRT-LLM refuses them: contract.check_retention);
- a neutral value (NEUTRAL_EMPTY: absent, no elements or empty strings; NEUTRAL_ZERO: also all zeros; or a
  number): accepted at that value, refused with an
  error naming the input otherwise (beam search, LoRA, prompt tables, guided decoding, embedding bias, encoder
  and multimodal inputs, lookahead decoding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

USED = "used"
IGNORED = "ignored"
NEUTRAL_EMPTY = "empty"
NEUTRAL_ZERO = "zero"  # empty, or every element 0 (a bias that adds nothing)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # Triton's TYPE_* name without the prefix
    dims: tuple[int, ...]  # without the batch dim
    optional: bool = True
    reshape: tuple[int, ...] | None = None  # `reshape: { shape: [...] }`
    ragged: bool = False  # allow_ragged_batch
    support: object = USED  # USED, IGNORED, NEUTRAL_EMPTY or the one neutral value (inputs only)
    extension: bool = False  # trtspec's own, not in NVIDIA's model

    @property
    def np_dtype(self):
        return NP_DTYPES[self.dtype]


NP_DTYPES = {
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT64": np.uint64,
    "UINT8": np.uint8,
    "FP16": np.float16,
    "FP32": np.float32,
    "BOOL": np.bool_,
    "STRING": np.object_,
}


def _scalar(name: str, dtype: str, support: object = USED, optional: bool = True) -> TensorSpec:
    """A per-request scalar as the tensorrt_llm model declares it: dims [1] reshaped to []."""
    return TensorSpec(name, dtype, (1,), optional=optional, reshape=(), support=support)


def _ragged(name: str, dtype: str, dims: tuple[int, ...], support: object = USED) -> TensorSpec:
    return TensorSpec(name, dtype, dims, ragged=True, support=support)


# ---- tensorrt_llm (and tensorrt_llm_draft, the same model on the draft engine); commit 0c8de69a1ca6 ------------
ENGINE_INPUTS = (
    _ragged("input_ids", "INT32", (-1,)),
    _ragged("encoder_input_features", "FP16", (-1, -1), NEUTRAL_EMPTY),
    _scalar("encoder_output_lengths", "INT32", NEUTRAL_EMPTY),
    _scalar("input_lengths", "INT32", optional=False),
    _scalar("request_output_len", "INT32", optional=False),
    # refused in any value: 1.2.x's backend passes it on as noRepeatNgramSize (contract.SHIFTED_INPUTS)
    _scalar("num_return_sequences", "INT32", NEUTRAL_EMPTY),
    _ragged("draft_input_ids", "INT32", (-1,)),
    _ragged("decoder_input_ids", "INT32", (-1,), NEUTRAL_EMPTY),
    _scalar("decoder_input_lengths", "INT32", NEUTRAL_ZERO),
    _ragged("draft_logits", "FP32", (-1, -1)),
    _scalar("draft_acceptance_threshold", "FP32", NEUTRAL_EMPTY),
    _scalar("end_id", "INT32"),
    _scalar("pad_id", "INT32"),
    _ragged("stop_words_list", "INT32", (2, -1)),
    _ragged("bad_words_list", "INT32", (2, -1)),
    _ragged("embedding_bias", "FP32", (-1,), NEUTRAL_ZERO),
    _scalar("beam_width", "INT32", 1),
    _scalar("temperature", "FP32"),
    _scalar("runtime_top_k", "INT32"),
    _scalar("runtime_top_p", "FP32"),
    _scalar("runtime_top_p_min", "FP32", NEUTRAL_EMPTY),
    _scalar("runtime_top_p_decay", "FP32", 1.0),
    _scalar("runtime_top_p_reset_ids", "INT32", NEUTRAL_EMPTY),
    # USED, but not as a length penalty: 1.2.x's backend passes it to SamplingConfig's promptIgnoreLength (the
    # prompt tokens presence and frequency penalties skip; contract.PROMPT_IGNORE_WIRE), early_stopping to
    # lengthPenalty: both beam-search knobs change nothing at beam width 1
    _scalar("len_penalty", "FP32"),
    _scalar("early_stopping", "BOOL", IGNORED),
    _scalar("repetition_penalty", "FP32"),
    _scalar("min_tokens", "INT32"),
    _scalar("beam_search_diversity_rate", "FP32", IGNORED),
    _scalar("presence_penalty", "FP32"),
    _scalar("frequency_penalty", "FP32"),
    _scalar("seed", "UINT64"),
    _scalar("return_log_probs", "BOOL"),
    _scalar("return_context_logits", "BOOL"),
    _scalar("return_generation_logits", "BOOL"),
    _scalar("return_perf_metrics", "BOOL"),
    _scalar("return_num_input_tokens", "BOOL"),
    _scalar("return_num_output_tokens", "BOOL"),
    _scalar("exclude_input_in_output", "BOOL"),
    _scalar("stop", "BOOL"),  # stops the calls with the same request id (handleStopRequest)
    _scalar("streaming", "BOOL"),
    _ragged("prompt_embedding_table", "FP16", (-1, -1), NEUTRAL_EMPTY),
    _ragged("prompt_table_extra_ids", "UINT64", (-1,), NEUTRAL_EMPTY),
    _scalar("prompt_vocab_size", "INT32", NEUTRAL_ZERO),
    _ragged("cross_attention_mask", "BOOL", (-1, -1), NEUTRAL_EMPTY),
    TensorSpec("mrope_rotary_cos_sin", "FP32", (-1,), support=NEUTRAL_EMPTY),
    TensorSpec("mrope_position_deltas", "INT64", (1,), support=NEUTRAL_EMPTY),
    _scalar("lora_task_id", "UINT64", NEUTRAL_ZERO),
    _ragged("lora_weights", "FP16", (-1, -1), NEUTRAL_EMPTY),
    _ragged("lora_config", "INT32", (-1, 3), NEUTRAL_EMPTY),
    _ragged("context_phase_params", "UINT8", (-1,), NEUTRAL_EMPTY),
    _ragged("skip_cross_attn_blocks", "BOOL", (1,), NEUTRAL_EMPTY),
    _ragged("retention_token_range_starts", "INT32", (-1,), IGNORED),
    _ragged("retention_token_range_ends", "INT32", (-1,), IGNORED),
    _ragged("retention_token_range_priorities", "INT32", (-1,), IGNORED),
    _ragged("retention_token_range_durations_ms", "INT32", (-1,), IGNORED),
    _ragged("retention_decode_priority", "INT32", (1,), IGNORED),
    _ragged("retention_decode_duration_ms", "INT32", (1,), IGNORED),
    _ragged("guided_decoding_guide_type", "STRING", (1,), NEUTRAL_EMPTY),
    _ragged("guided_decoding_guide", "STRING", (1,), NEUTRAL_EMPTY),
    _ragged("lookahead_window_size", "INT32", (1,), NEUTRAL_EMPTY),
    _ragged("lookahead_ngram_size", "INT32", (1,), NEUTRAL_EMPTY),
    _ragged("lookahead_verification_set_size", "INT32", (1,), NEUTRAL_EMPTY),
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
    TensorSpec("cum_log_probs", "FP32", (-1,)),
    TensorSpec("output_log_probs", "FP32", (-1, -1)),
    TensorSpec("context_logits", "FP32", (-1, -1)),
    TensorSpec("generation_logits", "FP32", (-1, -1, -1)),
    TensorSpec("batch_index", "INT32", (1,)),
    TensorSpec("sequence_index", "INT32", (1,)),
    TensorSpec("context_phase_params", "UINT8", (-1,)),
    *PERF_OUTPUTS,
    TensorSpec("num_input_tokens", "INT32", (1,)),
    TensorSpec("num_output_tokens", "INT32", (1,)),
)
ENGINE_OUTPUT_NAMES = tuple(t.name for t in ENGINE_OUTPUTS)
ENGINE_INPUT_NAMES = frozenset(t.name for t in ENGINE_INPUTS)


def _opt(name: str, dtype: str, dims: tuple[int, ...] = (1,), support: object = USED, **kw) -> TensorSpec:
    return TensorSpec(name, dtype, dims, support=support, **kw)


def _out(name: str, dtype: str, dims: tuple[int, ...], extension: bool = False) -> TensorSpec:
    return TensorSpec(name, dtype, dims, extension=extension)


# The outputs NVIDIA's ensemble and tensorrt_llm_bls return besides text_output: the tensorrt_llm outputs a client
# asks for with return_* flags.
RESULT_OUTPUTS = (
    _out("cum_log_probs", "FP32", (-1,)),
    _out("output_log_probs", "FP32", (-1, -1)),
    _out("context_logits", "FP32", (-1, -1)),
    _out("generation_logits", "FP32", (-1, -1, -1)),
    _out("batch_index", "INT32", (1,)),
    _out("sequence_index", "INT32", (1,)),
    *PERF_OUTPUTS,
    _out("num_input_tokens", "INT32", (1,)),
    _out("num_output_tokens", "INT32", (1,)),
)

# The values of the BLS's `speculation` input: auto (prompt lookup where the text repeats, the draft model elsewhere),
# one source alone, or none.
SPECULATION_METHODS = ("auto", "draft_model", "prompt_lookup", "none")

# ---- tensorrt_llm_bls (commit bff88ea886779f832686acb3f165e2b919c95b77) ---------------------------------------------
BLS_INPUTS = (
    _opt("text_input", "STRING", optional=False),
    _opt("decoder_text_input", "STRING", support=NEUTRAL_EMPTY),
    _opt("image_input", "FP16", (-1, 3, -1, -1), NEUTRAL_EMPTY),
    _opt("image_bytes_input", "UINT8", (-1, -1, -1, -1), NEUTRAL_EMPTY),
    _opt("image_url_input", "STRING", support=NEUTRAL_EMPTY),
    _opt("image_sizes_input", "INT64", (-1, 2), NEUTRAL_EMPTY),
    _opt("video_bytes_input", "UINT8", (-1, -1, -1, -1), NEUTRAL_EMPTY),
    _opt("max_tokens", "INT32", optional=False),
    _opt("bad_words", "STRING", (-1,)),
    _opt("stop_words", "STRING", (-1,)),
    _opt("exclude_input_in_output", "BOOL"),
    _opt("end_id", "INT32"),
    _opt("pad_id", "INT32"),
    _opt("top_k", "INT32"),
    _opt("top_p", "FP32"),
    _opt("temperature", "FP32"),
    _opt("length_penalty", "FP32", support=IGNORED),
    _opt("repetition_penalty", "FP32"),
    _opt("min_tokens", "INT32"),
    _opt("presence_penalty", "FP32"),
    _opt("frequency_penalty", "FP32"),
    _opt("seed", "UINT64"),
    _opt("return_log_probs", "BOOL", reshape=()),
    _opt("return_context_logits", "BOOL", reshape=()),
    _opt("return_generation_logits", "BOOL", reshape=()),
    _opt("num_return_sequences", "INT32", support=1, reshape=()),
    _opt("beam_width", "INT32", support=1),
    _opt("stream", "BOOL"),
    _opt("store", "BOOL", extension=True),  # false: never captured (`trtspec serve --capture`); OpenAI's `store`
    _opt("prompt_embedding_table", "FP16", (-1, -1), NEUTRAL_EMPTY),
    _opt("prompt_vocab_size", "INT32", support=NEUTRAL_ZERO),
    _opt("prompt_table_extra_id", "UINT64", support=NEUTRAL_ZERO),
    _opt("embedding_bias_words", "STRING", (-1,), NEUTRAL_EMPTY),
    _opt("embedding_bias_weights", "FP32", (-1,), NEUTRAL_ZERO),
    _opt("num_draft_tokens", "INT32"),
    _opt("use_draft_logits", "BOOL", reshape=()),
    _opt("lora_task_id", "UINT64", support=NEUTRAL_ZERO, reshape=()),
    _opt("lora_weights", "FP16", (-1, -1), NEUTRAL_EMPTY, ragged=True),
    _opt("lora_config", "INT32", (-1, 3), NEUTRAL_EMPTY, ragged=True),
    _opt("return_perf_metrics", "BOOL", reshape=()),
    _opt("return_num_input_tokens", "BOOL", reshape=()),
    _opt("return_num_output_tokens", "BOOL", reshape=()),
    _opt("guided_decoding_guide_type", "STRING", support=NEUTRAL_EMPTY),
    _opt("guided_decoding_guide", "STRING", support=NEUTRAL_EMPTY),
    # trtspec's own
    _opt("speculation", "STRING", extension=True),  # one of SPECULATION_METHODS
    _opt("adaptive_draft_length", "BOOL", extension=True),  # false: draft exactly num_draft_tokens every iteration
    _opt("timeout_ms", "INT32", extension=True),  # the request ends with an error past this many ms
    _opt("final_perf_metrics_only", "BOOL", extension=True),  # true: perf metrics with the final response only
    _opt("stream_interval", "INT32", extension=True),  # tokens per streamed response (0: as they come)
    _opt("prediction", "STRING", extension=True),  # the text the answer is expected to repeat: a draft source
    # the prompt's tokens presence_penalty and frequency_penalty skip (<= 0: none; more than the prompt: all of it,
    # so that they count the answer alone, as OpenAI's do); NVIDIA's BLS has it after 1.2.1 (PR #13633)
    _opt("prompt_ignore_length", "INT32", extension=True),
)
BLS_OUTPUTS = (
    _out("text_output", "STRING", (-1,)),
    *RESULT_OUTPUTS,
    # trtspec's own: the tokens and how speculation went
    _out("output_ids", "INT32", (-1,), True),  # the token ids of this response
    _out("num_iterations", "INT32", (1,), True),
    _out("draft_time_ms", "FP32", (1,), True),
    _out("verify_time_ms", "FP32", (1,), True),
    _out("accepted_per_position", "INT32", (-1,), True),
    _out("drafted_per_position", "INT32", (-1,), True),
    _out("finish_reason", "STRING", (1,), True),
    _out("fallbacks", "INT32", (1,), True),  # times speculation was switched off for this request
    _out("fallback_reasons", "STRING", (-1,), True),  # "reason:count" for each reason
    _out("draft_sources", "STRING", (-1,), True),  # "source:iterations" for each source that drafted (auto)
    # with a prediction, on the final response: its tokens that appear in the output, and the others (OpenAI's usage)
    _out("accepted_prediction_tokens", "INT32", (1,), True),
    _out("rejected_prediction_tokens", "INT32", (1,), True),
)

# ---- ensemble (commit 2a9abd9536aa62ad3e4b9314be9286b1b1be523b; NVIDIA declares kv_cache_alloc_total_blocks twice,
# once here) ------------------------------------------------------------------------------------------------------
ENSEMBLE_INPUTS = (
    _opt("text_input", "STRING", optional=False),
    _opt("decoder_text_input", "STRING", support=NEUTRAL_EMPTY),
    _opt("max_tokens", "INT32", optional=False),
    _opt("num_return_sequences", "INT32", support=1),
    _opt("bad_words", "STRING", (-1,)),
    _opt("stop_words", "STRING", (-1,)),
    _opt("exclude_input_in_output", "BOOL"),
    _opt("end_id", "INT32"),
    _opt("pad_id", "INT32"),
    _opt("top_k", "INT32"),
    _opt("top_p", "FP32"),
    _opt("temperature", "FP32"),
    _opt("length_penalty", "FP32", support=IGNORED),
    _opt("repetition_penalty", "FP32"),
    _opt("min_tokens", "INT32"),
    _opt("presence_penalty", "FP32"),
    _opt("frequency_penalty", "FP32"),
    _opt("seed", "UINT64"),
    _opt("return_log_probs", "BOOL"),
    _opt("return_context_logits", "BOOL"),
    _opt("return_generation_logits", "BOOL"),
    _opt("return_perf_metrics", "BOOL"),
    _opt("return_num_input_tokens", "BOOL"),
    _opt("return_num_output_tokens", "BOOL"),
    _opt("beam_width", "INT32", support=1),
    _opt("stream", "BOOL"),
    _opt("prompt_embedding_table", "FP16", (-1, -1), NEUTRAL_EMPTY),
    _opt("prompt_table_extra_id", "UINT64", support=NEUTRAL_ZERO),
    _opt("prompt_vocab_size", "INT32", support=NEUTRAL_ZERO),
    _opt("embedding_bias_words", "STRING", (-1,), NEUTRAL_EMPTY),
    _opt("embedding_bias_weights", "FP32", (-1,), NEUTRAL_ZERO),
    _opt("lora_task_id", "UINT64", support=NEUTRAL_ZERO),
    _opt("lora_weights", "FP16", (-1, -1), NEUTRAL_EMPTY, ragged=True),
    _opt("lora_config", "INT32", (-1, 3), NEUTRAL_EMPTY, ragged=True),
    _opt("guided_decoding_guide_type", "STRING", support=NEUTRAL_EMPTY, ragged=True),
    _opt("guided_decoding_guide", "STRING", support=NEUTRAL_EMPTY, ragged=True),
)
ENSEMBLE_OUTPUTS = (_out("text_output", "STRING", (-1,)), *RESULT_OUTPUTS)

# ---- preprocessing (commit 808059da341493bbf8deb9380aef745e4f546909) and postprocessing (89fd9b74ab7a) -------------
PREPROCESSING_INPUTS = (
    _opt("QUERY", "STRING", optional=False),
    _opt("DECODER_QUERY", "STRING", support=NEUTRAL_EMPTY),
    _opt("IMAGE_BYTES", "UINT8", (-1, -1, -1, -1), NEUTRAL_EMPTY),
    _opt("IMAGE_URL", "STRING", (-1,), NEUTRAL_EMPTY),
    _opt("IMAGE_SIZES", "INT64", (-1, 2), NEUTRAL_EMPTY),
    _opt("VIDEO_BYTES", "UINT8", (-1, -1, -1, -1), NEUTRAL_EMPTY),
    _opt("REQUEST_OUTPUT_LEN", "INT32", optional=False),
    _opt("BAD_WORDS_DICT", "STRING", (-1,)),
    _opt("STOP_WORDS_DICT", "STRING", (-1,)),
    _opt("EMBEDDING_BIAS_WORDS", "STRING", (-1,), NEUTRAL_EMPTY),
    _opt("EMBEDDING_BIAS_WEIGHTS", "FP32", (-1,), NEUTRAL_ZERO),
    _opt("END_ID", "INT32"),
    _opt("PAD_ID", "INT32"),
    _opt("PROMPT_TABLE_EXTRA_ID", "UINT64", support=NEUTRAL_ZERO),
)
PREPROCESSING_OUTPUTS = (
    _out("INPUT_ID", "INT32", (-1,)),
    _out("REQUEST_INPUT_LEN", "INT32", (1,)),
    _out("DECODER_INPUT_ID", "INT32", (-1,)),
    _out("REQUEST_DECODER_INPUT_LEN", "INT32", (1,)),
    _out("BAD_WORDS_IDS", "INT32", (2, -1)),
    _out("STOP_WORDS_IDS", "INT32", (2, -1)),
    _out("EMBEDDING_BIAS", "FP32", (-1,)),
    _out("REQUEST_OUTPUT_LEN", "INT32", (-1,)),
    _out("OUT_END_ID", "INT32", (1,)),
    _out("OUT_PAD_ID", "INT32", (1,)),
    _out("OUT_PROMPT_TABLE_EXTRA_IDS", "UINT64", (-1,)),
    _out("PIXEL_VALUES", "FP16", (-1, -1, -1, -1)),
    _out("ASPECT_RATIO_IDS", "INT64", (-1,)),
    _out("ASPECT_RATIO_MASK", "INT64", (-1, -1)),
    _out("CROSS_ATTENTION_MASK", "INT64", (-1, -1, -1)),
    _out("IMAGE_SIZES", "INT64", (-1, 2)),
    _out("IS_VIDEO_INPUT", "BOOL", (1,)),
    _out("ATTENTION_MASK", "INT64", (-1,)),
    _out("IMAGE_GRID_THW", "INT64", (3,)),
    _out("VISION_INPUT_ID", "INT32", (-1,)),
)
POSTPROCESSING_INPUTS = (
    _opt("TOKENS_BATCH", "INT32", (-1, -1), optional=False),
    _opt("SEQUENCE_LENGTH", "INT32", (-1,), optional=False),
)
POSTPROCESSING_OUTPUTS = (_out("OUTPUT", "STRING", (-1,)),)

# model name -> (inputs, outputs), for the configs and their checks
MODEL_TENSORS = {
    "preprocessing": (PREPROCESSING_INPUTS, PREPROCESSING_OUTPUTS),
    "postprocessing": (POSTPROCESSING_INPUTS, POSTPROCESSING_OUTPUTS),
    "tensorrt_llm": (ENGINE_INPUTS, ENGINE_OUTPUTS),
    "tensorrt_llm_draft": (ENGINE_INPUTS, ENGINE_OUTPUTS),
    "tensorrt_llm_bls": (BLS_INPUTS, BLS_OUTPUTS),
    "ensemble": (ENSEMBLE_INPUTS, ENSEMBLE_OUTPUTS),
}


def neutral_problem(spec: TensorSpec, value) -> str | None:
    """Why `value` of input `spec` cannot be served, or None when it can (see `support`)."""
    if spec.support in (USED, IGNORED):
        return None
    arr = np.asarray(value)
    if arr.size == 0:
        return None
    if arr.dtype == object or arr.dtype.kind in "SU":
        if all(not (v.decode() if isinstance(v, bytes) else str(v)) for v in arr.reshape(-1)):
            return None
        return "is not supported by this deployment; leave it out (or send it empty)"
    if spec.support == NEUTRAL_ZERO and not np.any(arr):
        return None
    if spec.support in (NEUTRAL_EMPTY, NEUTRAL_ZERO):
        return "is not supported by this deployment; leave it out (or send it empty)"
    if np.all(arr == spec.support):
        return None
    return (
        f"only {spec.support} is supported by this deployment, got {arr.reshape(-1).tolist()}; leave it out or "
        f"send {spec.support}"
    )
