"""A trivial engine with the `tensorrt_llm` tensor contract: it answers at once and runs no model.

Every token it emits is one fixed token, read from `trivial.json` in its engine dir. Without draft tokens it
returns `request_output_len` of them; with draft tokens it accepts the whole draft and adds one token of its
own, as a target that agrees with its draft would. The same model serves as the draft engine, so every draft
is accepted and each speculative iteration yields K + 1 tokens. Decoupled (the default deployment), it streams
as TensorRT-LLM does with `streaming`: one response per token, each holding that token alone; a `stop` request
gets its empty final response (the calls end at once here, so there is nothing to stop).

Requests go through the same contract code as the embedded engine (trtspec.contract's tensors_to_request and
result_to_tensors, the perf outputs when asked for), so what a request costs with these engines is the orchestration
alone: BLS round trips, tensor packing, detokenization, the loop's bookkeeping and the response path.
`benchmarks/overhead.py` copies this file into its repository as the engine models' model.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from trtspec.contract import GenerationResult, result_to_tensors, tensors_to_request
from trtspec.triton.common import error_response, model_parameters, parameter, respond_each
from trtspec.triton.engine_model import engine_inputs, split_rows

SETTINGS_FILE = "trivial.json"


def answer(tensors: dict, token: int) -> dict:
    """One request's outputs: the draft accepted whole plus `token`, or `request_output_len` x `token`."""
    request = tensors_to_request(tensors)
    draft = list(request.draft_input_ids or [])
    new = draft + [token] if draft else [token] * request.request_output_len
    ids = new if request.exclude_input_in_output else request.input_ids + new
    result = GenerationResult(ids, new, num_draft_tokens=len(draft), num_accepted_tokens=len(draft))
    return result_to_tensors(result, with_logits=False, with_perf=request.return_perf_metrics)


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.name = args.get("model_name", "tensorrt_llm")
        settings = json.loads((Path(parameter(params, "engine_dir")) / SETTINGS_FILE).read_text())
        self.token = int(settings["token"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))

    def execute(self, requests):
        if not self.decoupled:
            return respond_each(requests, self._serve, self.name)
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        for request in requests:
            sender = request.get_response_sender()
            try:
                tensors = engine_inputs(request)
                if "stop" in tensors and np.any(tensors["stop"]):
                    sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=final)
                elif "streaming" in tensors and np.any(tensors["streaming"]) and "draft_input_ids" not in tensors:
                    n = tensors_to_request(tensors).request_output_len
                    for i in range(n):
                        out = {
                            "output_ids": np.full((1, 1, 1), self.token, np.int32),
                            "sequence_length": np.ones((1, 1), np.int32),
                        }
                        sender.send(
                            pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in out.items()]),
                            flags=final if i == n - 1 else 0,
                        )
                else:
                    out = self._serve(request)
                    sender.send(
                        pb_utils.InferenceResponse(
                            output_tensors=[pb_utils.Tensor(k, np.ascontiguousarray(v)) for k, v in out.items()]
                        ),
                        flags=final,
                    )
            except Exception as exc:  # the Triton edge: every failure becomes exactly one error response
                sender.send(error_response(exc, self.name), flags=final)
        return None

    def _serve(self, request) -> dict:
        tensors = engine_inputs(request)
        rows = split_rows(tensors)
        outputs = [answer(row, self.token) for row in rows]
        return outputs[0] if len(outputs) == 1 else stack_rows(outputs, pad_values={"output_ids": self.token})


def stack_rows(outputs: list[dict[str, np.ndarray]], pad_values: dict[str, int | float]) -> dict[str, np.ndarray]:
    """Single-row outputs -> one batch: each tensor padded to the largest shape (only names every row has)."""
    names = [name for name in outputs[0] if all(name in o for o in outputs)]
    stacked = {}
    for name in names:
        arrays = [np.asarray(o[name]) for o in outputs]
        shape = np.max([a.shape for a in arrays], axis=0)
        batch = np.full((len(arrays), *shape[1:]), pad_values.get(name, 0), dtype=arrays[0].dtype)
        for i, a in enumerate(arrays):
            batch[(i, *(slice(0, d) for d in a.shape[1:]))] = a[0]
        stacked[name] = batch
    return stacked
