"""Triton entry point of the `preprocessing` model; the code is in trtspec.triton.preprocessing."""

from trtspec.triton.preprocessing import TritonPythonModel  # noqa: F401
