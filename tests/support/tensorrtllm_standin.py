"""A strict stand-in for TensorRT-LLM's `tensorrtllm` Triton backend, served as a Python model in tests.

The embedded engine computes underneath; on top, the backend's own request and response rules, each cited to
the source it follows: NVIDIA/TensorRT-LLM at 1.2.0rc8 (commit 0c8de69a1ca6213eebb20a51873890ff128666c2),
`triton_backend/inflight_batcher_llm/src/model_instance_state.cc` unless another file is named. Its config is
the one `trtspec deploy` writes for TensorRT engines (tensorrt_llm_trtllm) with `backend: "python"`, so the
repository's parameters and declared outputs are checked as the real backend would check them.

Deliberately unkind: anything the real backend refuses, this refuses; anything it does silently (greedy for
top_k 0 with top_p 0), this does too, so that the BLS cannot pass here and fail on a GPU. Where the real backend
does something undefined, this refuses: `min_tokens` > 0 with no end id (end_id -1 or none given), which penalty
kernels without the guard of 3c44cb97 turn into a write to logits[-1] (the embedded engine's check refuses it, and
this inherits that check).
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from trtspec.errors import EngineBusy, EngineError
from trtspec.triton.engine_model import TritonPythonModel as EmbeddedEngineModel
from trtspec.triton.engine_model import engine_inputs

# getGuidedDecodingConfigFromParams, called unconditionally by getExecutorConfigFromParams, reads these three
# with GetParameter<std::string>, which throws "Cannot find parameter with name: <name>" (model_state.cc).
GUIDED_DECODING_PARAMETERS = ("tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend")
# getBatchingTypeFromParams: any other gpt_model_type throws "Invalid gpt_model_type".
BATCHING_TYPES = ("V1", "v1", "inflight_batching", "inflight_fused_batching")
# fillTritonResponse writes all of these when the request set return_perf_metrics, with no check that they are
# declared; Triton then refuses the response ("unexpected inference output").
PERF_OUTPUTS = (
    "kv_cache_alloc_new_blocks",
    "kv_cache_reused_blocks",
    "kv_cache_alloc_total_blocks",
    "arrival_time_ns",
    "first_scheduled_time_ns",
    "first_token_time_ns",
    "last_token_time_ns",
    "acceptance_rate",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
)
LOGITS_TYPES = {"TYPE_FP32": "float32", "TYPE_FP16": "float16"}


class TritonPythonModel(EmbeddedEngineModel):
    # One response per executor response, each sent as it comes: WaitForResponse sends every response
    # awaitResponses returns with its own TRITONBACKEND_ResponseSend (tensorrtllm_backend c2e65b8,
    # inflight_batcher_llm/src/model_instance_state.cc, WaitForResponse), and a streaming request gets one per step,
    # as the embedded engine model sends them too.

    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        for name in ("gpt_model_type", *GUIDED_DECODING_PARAMETERS):
            if name not in params:
                raise pb_utils.TritonModelException(
                    f"unexpected error when creating modelInstanceState: Cannot find parameter with name: {name}"
                )
        if params["gpt_model_type"] not in BATCHING_TYPES:
            raise pb_utils.TritonModelException(f"Invalid gpt_model_type {params['gpt_model_type']}")
        # the default of a request without the tensor: the constructor reads this with GetParameter<bool>, false
        # when absent (model_instance_state.cc at 0c8de69a)
        self.exclude_input = params.get("exclude_input_in_output", "").strip().lower() == "true"
        # the constructor: "Both encoder and decoder model paths are empty"
        if not params.get("gpt_model_path"):
            raise pb_utils.TritonModelException("Both encoder and decoder model paths are empty")
        # model_state.cc LoadParameters: the logits dtype is the data_type of the first output named
        # generation_logits or context_logits
        self.declared = {o["name"]: o["data_type"] for o in config.get("output", [])}
        self.logits_type = next(
            (self.declared[n] for n in self.declared if n in ("generation_logits", "context_logits")), None
        )
        args = dict(
            args,
            model_config=json.dumps(
                dict(
                    config,
                    parameters={
                        **config.get("parameters", {}),
                        "engine_dir": {"string_value": params["gpt_model_path"]},
                    },
                )
            ),
        )
        super().initialize(args)
        # A stopped call loses the tokens of the step in flight when the stop came: forwardSync ends a cancelled
        # request with clearGeneratedTokens() after that step (cpp/tensorrt_llm/batch_manager/
        # trtGptModelInflightBatching.cpp at b35ac1b6), so a stopped streaming call's last response holds no token
        # and a stopped unary call returns its prompt alone (LlmRequest::createResult, llmRequest.cpp 89fd9b74).
        self.engine.scheduler.clear_cancelled = True
        self.engine_logits = self.engine.info.raw.get("pretrained_config", {}).get("logits_dtype", "float32")

    def _submit(self, request, sender) -> None:
        requested = set(request.requested_output_names())
        for name in ("output_ids", "sequence_length"):
            # fillTritonResponse: TLLM_THROW("%s tensor must be present in list of output tensors")
            if requested and name not in requested:  # the backend's own words reach the client (INTERNAL)
                raise EngineError(f"{name} tensor must be present in list of output tensors")
        tensors = engine_inputs(request)
        if "exclude_input_in_output" not in tensors and "input_ids" in tensors:
            # createRequestsFromInputTensors (utils.cc at c8c6df08): the request's value, else the parameter's. With
            # it, output_ids holds the new tokens alone and sequence_length counts them (llmRequest.cpp createResult
            # at 89fd9b74: maxNbTokens - promptLen tokens; fillTritonResponse: sequence_length = their number)
            rows = np.asarray(tensors["input_ids"]).shape[0]
            tensors["exclude_input_in_output"] = np.full((rows, 1), self.exclude_input, np.bool_)
        self._queue(regularized(tensors), sender, request.request_id())

    def _submit_all(self, calls, request_id):
        """The queue bound as the backend applies it: max_queue_size from dynamic_batching.default_queue_policy
        (getExecutorConfigFromParams) into the executor, whose enqueueRequests refuses a request whose rows would
        take the queued ones past it (executorImpl.cpp: TLLM_THROW "Maximum queue size of %d has been reached,
        please try again later"); the backend's enqueue answers that exception with TRITONSERVER_ERROR_INTERNAL.
        The same id map as the embedded engine's (the latest request with an id is the one its stop cancels)."""
        try:
            super()._submit_all(calls, request_id)
        except EngineBusy:
            raise EngineError(
                f"Maximum queue size of {self.max_queue_size} has been reached, please try again later"
            ) from None

    def _response(self, call, outcome, batch_index=None):
        response = super()._response(call, outcome, batch_index)
        if response.has_error():
            return response
        outputs = {t.name(): t for t in response.output_tensors()}
        if "generation_logits" in outputs and LOGITS_TYPES.get(self.logits_type) != self.engine_logits:
            # fillTritonResponse: TLLM_CHECK(generationLogitsType == model_state_->getLogitsDataType())
            return pb_utils.InferenceResponse(
                output_tensors=[],
                error=pb_utils.TritonError(
                    f"Error encountered while populating response: logits of the engine are {self.engine_logits}, "
                    f"the config declares {self.logits_type}"
                ),
            )
        undeclared = [name for name in outputs if name not in self.declared]
        if undeclared:  # Triton core: InferenceResponse::AddOutput -> GetOutput fails for an undeclared name
            return pb_utils.InferenceResponse(
                output_tensors=[],
                error=pb_utils.TritonError(f"unexpected inference output '{undeclared[0]}' for model '{self.name}'"),
            )
        return response


def regularized(tensors: dict) -> dict:
    """The sampling inputs as TensorRT-LLM reads them: top_p <= 0 is dropped (utils.cc
    getSamplingConfigFromTensors); temperature absent is 1.0 and temperature 0 is top-k 1 (runtime SamplingConfig
    defaults and validate()); top_k 0 with top_p 0 is top-k 1, "equivalent to greedy search"
    (cpp/tensorrt_llm/kernels/samplingTopKKernels.h regularizeTopKTopP)."""
    batch = np.asarray(tensors["input_ids"]).shape[0]
    temperature = np.array(tensors.get("temperature", np.ones(batch)), dtype=np.float32).reshape(batch, 1)
    top_k = np.array(tensors.get("runtime_top_k", np.zeros(batch)), dtype=np.int32).reshape(batch, 1)
    top_p = np.array(tensors.get("runtime_top_p", np.zeros(batch)), dtype=np.float32).reshape(batch, 1)
    top_p[top_p <= 0] = 0.0
    top_k[(temperature <= 0) | ((top_k == 0) & (top_p == 0))] = 1
    temperature[temperature <= 0] = 1.0
    return dict(tensors, temperature=temperature, runtime_top_k=top_k, runtime_top_p=top_p)
