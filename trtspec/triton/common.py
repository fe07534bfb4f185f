"""What the Triton adapters share: model parameters, the tokenizer, and turning failures into error responses.

Like every module in trtspec.triton, this one imports `triton_python_backend_utils`, which exists only inside
the Python backend's stub process.
"""

from __future__ import annotations

import json
import threading
import traceback
import uuid
from collections.abc import Callable

import numpy as np
import triton_python_backend_utils as pb_utils

from trtspec.errors import EngineBusy, EngineUnavailable, RequestError, TrtspecError

# how every Triton model reads its parameters (re-exported: the BLS reads its own as trtspec.serving_settings)
from trtspec.serving_settings import bool_parameter, parameter  # noqa: F401

# Every custom-metric call of this stub process (a Metric made, incremented, set or observed) holds this lock. Triton
# 2.51's Python backend sends an update by rewriting the Metric's own shared-memory message with the GIL released
# (python_backend r24.10 metric.cc, Metric::SendIncrementRequest and SaveToSharedMemory): two threads updating one
# Metric free the message the server is reading, and tritonserver dies (SIGSEGV in PbString::LoadFromSharedMemory
# under StubToParentMQMonitor, then boost::interprocess::lock_exception).
METRIC_CALLS = threading.RLock()


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters` of the model's config.pbtxt as plain strings."""
    config = json.loads(args["model_config"])
    return {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()}


def load_tokenizer(tokenizer_dir: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as exc:  # transformers raises OSError, ValueError, ... for a dir without a tokenizer
        raise TrtspecError(f"cannot load a tokenizer from {tokenizer_dir}: {exc}") from exc


def input_arrays(request) -> dict[str, np.ndarray]:
    """A request's input tensors by name, read once: `pb_utils.get_input_tensor_by_name` converts every input of the
    request on each lookup, which over the contract's ~60 optional names cost more than the call's IPC."""
    return {tensor.name(): tensor.as_numpy() for tensor in request.inputs()}


def required(inputs: dict[str, np.ndarray], name: str) -> np.ndarray:
    value = inputs.get(name)
    if value is None:
        raise RequestError(name, "is required")
    return value


def error_response(exc: BaseException, model: str) -> pb_utils.InferenceResponse:
    """A request's failure as its error response: the request's own fault (INVALID_ARG: HTTP 400), an engine
    that cannot answer now (UNAVAILABLE: 503, worth a retry) or an internal one (INTERNAL: 500). trtspec's own
    errors are written for the client and go out as they are; any other exception's text may hold paths, code or
    another request's data, so it stays in the server log with its traceback and the client gets an id to find it."""
    if isinstance(exc, RequestError):
        code = pb_utils.TritonError.INVALID_ARG
    elif isinstance(exc, (EngineUnavailable, EngineBusy)):
        code = pb_utils.TritonError.UNAVAILABLE
    else:
        code = pb_utils.TritonError.INTERNAL
    if isinstance(exc, TrtspecError):
        message = f"{model}: {exc}"
    else:
        error_id = internal_error_id()
        pb_utils.Logger.log_error(
            f"{model}: request failed (error {error_id}):\n{''.join(traceback.format_exception(exc))}"
        )
        message = f"{model}: internal error {error_id}; the server log has its details under that id"
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def internal_error_id() -> str:
    """A short id that ties an internal error's generic answer to its traceback in the server log."""
    return uuid.uuid4().hex[:12]


def respond_each(requests, handle: Callable[[object], dict[str, np.ndarray]], model: str) -> list:
    """One response per request: `handle`'s output tensors, or the error it raised (the model keeps serving)."""
    responses = []
    for request in requests:
        try:
            outputs = handle(request)
            tensors = [pb_utils.Tensor(name, np.ascontiguousarray(value)) for name, value in outputs.items()]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        except Exception as exc:  # the Triton edge: every failure becomes exactly one error response
            responses.append(error_response(exc, model))
    return responses
