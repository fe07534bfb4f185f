"""The floor of a BLS round trip: two Python-backend models that do nothing else.

`benchmarks/overhead.py` copies this file into two model dirs of its repository, beside their configs. As
`floor_echo` (decoupled,
as trtspec deploys its engine models) it answers each request with its input, one response with the final flag.
As `floor_caller` it calls `floor_echo` through BLS `rounds` times per shape and answers with the median round
trip in ms per shape: one int32 tensor each way, then as many input and output tensors as a verification call
carries. Whatever trtspec's own round trips cost above these figures is its own Python (tensor building and
reading on both sides); these figures are Triton's Python backend on this machine (shared-memory IPC between
the two stub processes and the server, and the server's scheduling).
"""

from __future__ import annotations

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

ECHO = "floor_echo"
# a verification's call: 10 inputs (input_ids, input_lengths, request_output_len, min_tokens, temperature,
# runtime_top_k, runtime_top_p, exclude_input_in_output, end_id, draft_input_ids) and 2 outputs without perf metrics
SHAPES = {"1 tensor each way": (1, 1), "10 in, 2 out": (10, 2)}  # floor_echo declares T0..T9 (overhead.py)


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]

    def execute(self, requests):
        if self.name == ECHO:
            final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            for request in requests:
                echoed = [pb_utils.Tensor(t.name(), t.as_numpy()) for t in request.inputs()]
                wanted = request.requested_output_names()
                request.get_response_sender().send(
                    pb_utils.InferenceResponse([t for t in echoed if t.name() in wanted]), flags=final
                )
            return None
        responses = []
        for request in requests:
            rounds = int(pb_utils.get_input_tensor_by_name(request, "rounds").as_numpy().reshape(-1)[0])
            medians = {label: self._median(rounds, n_in, n_out) for label, (n_in, n_out) in SHAPES.items()}
            payload = np.array([json.dumps(medians).encode()], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("round_trip_ms", payload)]))
        return responses

    def _median(self, rounds: int, n_in: int, n_out: int) -> float:
        kept, times = [], []
        for i in range(rounds + 3):  # the first three warm up
            started = time.perf_counter()
            inputs = [pb_utils.Tensor("T0", np.arange(256, dtype=np.int32))]
            inputs += [pb_utils.Tensor(f"T{j}", np.zeros(1, np.int32)) for j in range(1, n_in)]
            call = pb_utils.InferenceRequest(
                model_name=ECHO, inputs=inputs, requested_output_names=[f"T{j}" for j in range(n_out)]
            )
            responses = list(call.exec(decoupled=True))
            outputs = {t.name(): t.as_numpy().copy() for r in responses for t in r.output_tensors()}
            kept.append((call, responses))  # freed with the request, as trtspec's BLS keeps its calls
            if len(outputs) != n_out:
                raise RuntimeError(f"{ECHO} answered {len(outputs)} tensors, not {n_out}")
            if i >= 3:
                times.append(time.perf_counter() - started)
        return float(np.median(times) * 1e3)
