"""The tensors of the models `trtspec deploy` writes, as NVIDIA declares them for the models of the same name.

Source: NVIDIA/TensorRT-LLM, `triton_backend/all_models/inflight_batcher_llm/<model>/config.pbtxt` at
commit 2a9abd9536aa62ad3e4b9314be9286b1b1be523b (the tensorrt_llm model; see SOURCE_COMMITS for each). Names,
dtypes, dims, optional flags, reshapes and ragged batching are NVIDIA's, so a client written against NVIDIA's
repository sends nothing a trtspec deployment refuses for its shape. trtspec's own additions (the BLS's
speculation statistics and controls) are marked `extension`.

What an input means to trtspec is its `support`:
- USED: it does what TensorRT-LLM does with it;
- IGNORED: accepted with any value, because it changes nothing at beam width 1 (beam-search knobs) or only
  which KV blocks a cache keeps (retention hints);
- a neutral value (NEUTRAL_EMPTY: absent or no elements; or a number): accepted at that value, refused with an
  error naming the input otherwise (beam search, LoRA, prompt tables, guided decoding, embedding bias, encoder
  and multimodal inputs, lookahead decoding).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

USED = "used"
IGNORED = "ignored"
NEUTRAL_EMPTY = "empty"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str             # Triton's TYPE_* name without the prefix
    dims: tuple[int, ...]  # without the batch dim
    optional: bool = True
    reshape: tuple[int, ...] | None = None  # `reshape: { shape: [...] }`
    ragged: bool = False   # allow_ragged_batch
    support: object = USED  # USED, IGNORED, NEUTRAL_EMPTY or the one neutral value (inputs only)
    extension: bool = False  # trtspec's own, not in NVIDIA's model

    @property
    def np_dtype(self):
        return NP_DTYPES[self.dtype]


NP_DTYPES = {"INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "UINT8": np.uint8, "FP16": np.float16,
             "FP32": np.float32, "BOOL": np.bool_, "STRING": np.object_}


def _scalar(name: str, dtype: str, support: object = USED, optional: bool = True) -> TensorSpec:
    """A per-request scalar as the tensorrt_llm model declares it: dims [1] reshaped to []."""
    return TensorSpec(name, dtype, (1,), optional=optional, reshape=(), support=support)


def _ragged(name: str, dtype: str, dims: tuple[int, ...], support: object = USED) -> TensorSpec:
    return TensorSpec(name, dtype, dims, ragged=True, support=support)


# ---- tensorrt_llm (and tensorrt_llm_draft, the same model on the draft engine) ---------------------------------
ENGINE_INPUTS = (
    _ragged("input_ids", "INT32", (-1,)),
    _ragged("encoder_input_features", "FP16", (-1, -1), NEUTRAL_EMPTY),
    _scalar("encoder_output_lengths", "INT32", NEUTRAL_EMPTY),
    _scalar("input_lengths", "INT32", optional=False),
    _scalar("request_output_len", "INT32", optional=False),
    _scalar("num_return_sequences", "INT32", 1),
    _ragged("draft_input_ids", "INT32", (-1,)),
    _ragged("decoder_input_ids", "INT32", (-1,), NEUTRAL_EMPTY),
    _scalar("decoder_input_lengths", "INT32", NEUTRAL_EMPTY),
    _ragged("draft_logits", "FP32", (-1, -1)),
    _scalar("draft_acceptance_threshold", "FP32", NEUTRAL_EMPTY),
    _scalar("end_id", "INT32"),
    _scalar("pad_id", "INT32"),
    _ragged("stop_words_list", "INT32", (2, -1)),
    _ragged("bad_words_list", "INT32", (2, -1)),
    _ragged("embedding_bias", "FP32", (-1,), NEUTRAL_EMPTY),
    _scalar("beam_width", "INT32", 1),
    _scalar("temperature", "FP32"),
    _scalar("runtime_top_k", "INT32"),
    _scalar("runtime_top_p", "FP32"),
    _scalar("runtime_top_p_min", "FP32", NEUTRAL_EMPTY),
    _scalar("runtime_top_p_decay", "FP32", 1.0),
    _scalar("runtime_top_p_reset_ids", "INT32", NEUTRAL_EMPTY),
    _scalar("len_penalty", "FP32", IGNORED),
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
    _scalar("stop", "BOOL", False),
    _scalar("streaming", "BOOL"),
    _ragged("prompt_embedding_table", "FP16", (-1, -1), NEUTRAL_EMPTY),
    _ragged("prompt_table_extra_ids", "UINT64", (-1,), NEUTRAL_EMPTY),
    _scalar("prompt_vocab_size", "INT32", NEUTRAL_EMPTY),
    _ragged("cross_attention_mask", "BOOL", (-1, -1), NEUTRAL_EMPTY),
    TensorSpec("mrope_rotary_cos_sin", "FP32", (-1,), support=NEUTRAL_EMPTY),
    TensorSpec("mrope_position_deltas", "INT64", (1,), support=NEUTRAL_EMPTY),
    _scalar("lora_task_id", "UINT64", NEUTRAL_EMPTY),
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
