"""The two models of `benchmarks/stream_floor.py`: the least a streamed token can cost in Triton's Python backend.

`stream_floor.py` copies this file into both model dirs of its repository. As `floor_source` (decoupled, as trtspec
deploys its engine models) it answers a request for `n` tokens as a streaming engine call does: one response per
token holding `output_ids` [1, 1, 1] and `sequence_length` [1, 1], the last with the final flag; or, without
`streaming`, one response holding all `n`. As `floor_relay` (decoupled, as the BLS) it makes that call through BLS
and sends each response on to its client as `text_output` (one byte) and `output_ids`, the tensors a streamed
BLS response carries; unstreamed, it sends one response with every token. Nothing else runs: no tokenizer, no
loop, no engine; what a token costs here is Triton's and the Python backend's alone.
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils

SOURCE = "floor_source"
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _scalar(request, name: str, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0]


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        self.kept = []  # calls and their responses outlive the request, as trtspec's BLS keeps them (Triton 2.51)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            n, streaming = int(_scalar(request, "n", 1)), bool(_scalar(request, "streaming", False))
            if self.name == SOURCE:
                self._source(sender, n, streaming)
            else:
                self._relay(sender, n, streaming)
        return None

    @staticmethod
    def _source(sender, n: int, streaming: bool) -> None:
        if not streaming:
            ids = np.arange(n, dtype=np.int32)[None, None]
            sender.send(_engine_response(ids), flags=FINAL)
            return
        for i in range(n):
            sender.send(_engine_response(np.full((1, 1, 1), i, np.int32)), flags=FINAL if i == n - 1 else 0)

    def _relay(self, sender, n: int, streaming: bool) -> None:
        inputs = [
            pb_utils.Tensor("n", np.asarray([n], np.int32)),
            pb_utils.Tensor("streaming", np.asarray([streaming])),
        ]
        call = pb_utils.InferenceRequest(
            model_name=SOURCE, inputs=inputs, requested_output_names=["output_ids", "sequence_length"]
        )
        responses = call.exec(decoupled=True)
        kept, ids = [], []
        self.kept.append((call, kept))
        for response in responses:
            kept.append(response)
            if response.has_error():
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=response.error()), flags=FINAL)
                return
            tensors = {t.name(): t.as_numpy().copy() for t in response.output_tensors()}
            if "output_ids" not in tensors:
                continue  # a final response without tokens
            new = tensors["output_ids"].reshape(-1).tolist()
            if streaming:
                sender.send(_bls_response(new))
            else:
                ids += new
        sender.send(_bls_response(ids) if not streaming else None, flags=FINAL)


def _engine_response(ids: np.ndarray):
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor("output_ids", ids),
            pb_utils.Tensor("sequence_length", np.asarray([[ids.shape[-1]]], np.int32)),
        ]
    )


def _bls_response(ids: list[int]):
    return pb_utils.InferenceResponse(
        output_tensors=[
            pb_utils.Tensor("text_output", np.asarray([b"x" * len(ids)], dtype=np.object_)),
            pb_utils.Tensor("output_ids", np.asarray(ids, np.int32)),
        ]
    )
