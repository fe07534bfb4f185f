"""The engine models (`tensorrt_llm`, `tensorrt_llm_draft`) on the embedded torch backend.

Each request's tensors are those of TRT-LLM's `tensorrt_llm` model (trtspec.contract.ENGINE_INPUTS /
ENGINE_OUTPUTS); `Engine.serve` answers one request in that contract. A request of batch size B > 1 is served
row by row and its outputs are padded to a common length (`sequence_length` says where each row ends).
Parameters: `engine_dir`, `device` ("cpu" or "cuda[:N]"), `enable_kv_cache_reuse`.
"""

from __future__ import annotations

import numpy as np

from trtspec.contract import ENGINE_INPUTS
from trtspec.errors import EngineError, RequestError
from trtspec.triton.common import bool_parameter, model_parameters, optional_input, parameter, respond_each


class TritonPythonModel:
    def initialize(self, args):
        import torch

        from trtspec.engine.runtime import Engine

        params = model_parameters(args)
        self.name = args.get("model_name", "tensorrt_llm")
        device = parameter(params, "device", "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineError(f"{self.name}: device '{device}' is configured but no CUDA device is available; "
                              "regenerate the repository with `trtspec deploy --device cpu`")
        self.engine = Engine.load(parameter(params, "engine_dir"), device)
        if not bool_parameter(params, "enable_kv_cache_reuse", True):
            self.engine.cache.reuse = False  # nothing is kept: every request computes its whole sequence

    def execute(self, requests):
        return respond_each(requests, self._serve, self.name)

    def _serve(self, request) -> dict[str, np.ndarray]:
        tensors = engine_inputs(request)
        rows = split_rows(tensors)
        if len(rows) == 1:
            return self.engine.serve(rows[0])
        outputs = [self.engine.serve(row) for row in rows]
        return stack_rows(outputs, pad_values={"output_ids": self._pad_id(tensors)})

    def _pad_id(self, tensors) -> int:
        if "pad_id" in tensors:
            return int(np.asarray(tensors["pad_id"]).reshape(-1)[0])
        return self.engine.pad_token_id if self.engine.pad_token_id is not None else 0

    def finalize(self):
        self.engine = None


def engine_inputs(request) -> dict[str, np.ndarray]:
    """The `tensorrt_llm` inputs a request carries, by name."""
    tensors = {}
    for spec in ENGINE_INPUTS:
        value = optional_input(request, spec.name)
        if value is not None:
            tensors[spec.name] = value
    return tensors


def split_rows(tensors: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """A request's tensors [B, ...] -> B single-row requests [1, ...]."""
    sizes = {name: np.asarray(v).shape[0] if np.ndim(v) else 1 for name, v in tensors.items()}
    batch = max(sizes.values(), default=1)
    uneven = [name for name, size in sizes.items() if size != batch]
    if uneven:
        raise RequestError(uneven[0], f"has batch size {sizes[uneven[0]]}, other inputs have {batch}")
    if batch == 1:
        return [tensors]
    return [{name: np.asarray(v)[i : i + 1] for name, v in tensors.items()} for i in range(batch)]


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
