"""Triton entry point of the `postprocessing` model; the code is in trtspec.triton.postprocessing."""

from trtspec.triton.postprocessing import TritonPythonModel  # noqa: F401
