"""Triton entry point of the `tensorrt_llm_bls` model (the speculative-decoding orchestrator); the code is in
trtspec.triton.bls."""

from trtspec.triton.bls import TritonPythonModel  # noqa: F401
