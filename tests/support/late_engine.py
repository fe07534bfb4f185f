"""A test engine model: the stand-in of TensorRT-LLM's backend (tensorrtllm_standin.py, copied beside this file) that
takes each call asking for more than SHORT tokens into its engine only LATE seconds (or what the file LATE beside this
file says) after the call arrived, while stop
requests (and short calls) are handled at once. So a stop sent when such a call was sent reaches the engine first, as a
stop can on a busy server where the two travel side by side: the backend's handleStopRequest then finds no call with
that id and answers it all the same (model_instance_state.cc at 0c8de69a), and the call, taken in afterwards, runs
unless another stop comes. Every call's budget and the tokens it returned go, one line per call, to the file CALLS
beside this file. Production code is not touched."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from trtspec.triton.common import error_response

SHORT = 8
LATE = 1.0  # unless the file LATE beside this file holds another number of seconds
CALLS = "CALLS"
_here = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("tensorrtllm_standin", _here / "tensorrtllm_standin.py")
_standin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_standin)


class _Counted:
    """A response sender that counts the tokens a call returns and writes them to CALLS with its last response."""

    def __init__(self, sender, budget: int):
        self.sender, self.budget, self.tokens = sender, budget, 0

    def send(self, response=None, flags=0):
        if response is not None and not response.has_error():
            for tensor in response.output_tensors():
                if tensor.name() == "sequence_length":
                    self.tokens += int(tensor.as_numpy().sum())
        self.sender.send(response, flags=flags)
        if flags & pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            with (_here / CALLS).open("a") as out:
                out.write(f"{self.budget} {self.tokens}\n")


class TritonPythonModel(_standin.TritonPythonModel):
    def _queue(self, tensors, sender, request_id):
        if "stop" in tensors and np.any(tensors["stop"]):
            return super()._queue(tensors, sender, request_id)
        budget = int(np.asarray(tensors["request_output_len"]).max())
        counted = _Counted(sender, budget)
        if budget <= SHORT:
            return super()._queue(tensors, counted, request_id)
        late = _here / "LATE"
        threading.Timer(
            float(late.read_text()) if late.exists() else LATE, self._take, (tensors, counted, request_id)
        ).start()

    def _take(self, tensors, sender, request_id):
        try:
            super()._queue(tensors, sender, request_id)
        except Exception as exc:  # what execute would have answered
            sender.send(error_response(exc, self.name), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
