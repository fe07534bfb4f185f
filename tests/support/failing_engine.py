"""A test engine model: the stand-in of TensorRT-LLM's backend (tensorrtllm_standin.py, copied beside this file)
after a sticky CUDA error. While the file FAILING exists beside it, every call fails as TensorRT-LLM's executor then
fails it (`Executor::Impl::forwardAsync` catches the exception and `terminateActiveRequests` answers each request
with "Encountered an error in forwardAsync function: " and the exception's text; executorImpl.cpp, 1.2.0rc2
b35ac1b6), and the model stays READY, as the backend's does. A stop is still answered (the backend's
handleStopRequest does not go through the failing step). Production code is not touched."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from trtspec.errors import EngineError

FAILING = "FAILING"
_here = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("tensorrtllm_standin", _here / "tensorrtllm_standin.py")
_standin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_standin)

CUDA_ERROR = (
    "Encountered an error in forwardAsync function: [TensorRT-LLM][ERROR] CUDA runtime error in "
    "cudaMemcpyAsync(dst, src.data(), src.getSizeInBytes(), cudaMemcpyDefault, stream): an illegal memory access "
    "was encountered"
)


class TritonPythonModel(_standin.TritonPythonModel):
    def _submit(self, request, sender) -> None:
        stop = any(t.name() == "stop" and np.any(t.as_numpy()) for t in request.inputs())
        if (_here / FAILING).exists() and not stop:
            raise EngineError(CUDA_ERROR)
        super()._submit(request, sender)
