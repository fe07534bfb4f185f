"""Triton entry point of an engine model (`tensorrt_llm`, `tensorrt_llm_draft`) on the embedded torch backend;
the code is in trtspec.triton.engine_model."""

from trtspec.triton.engine_model import TritonPythonModel  # noqa: F401
