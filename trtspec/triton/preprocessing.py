"""The `preprocessing` model: text -> token ids, with the stock tensorrtllm_backend tensor names.

QUERY [B, 1] -> INPUT_ID [B, L] (rows padded with the pad id), REQUEST_INPUT_LEN [B, 1]; REQUEST_OUTPUT_LEN
passes through; OUT_END_ID / OUT_PAD_ID are the request's END_ID / PAD_ID or the tokenizer's EOS / pad token.
"""

from __future__ import annotations

import numpy as np

from trtspec.errors import RequestError
from trtspec.triton.common import (
    bool_parameter, load_tokenizer, model_parameters, optional_input, parameter, required_input, respond_each,
)


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.tokenizer = load_tokenizer(parameter(params, "tokenizer_dir"))
        self.add_special_tokens = bool_parameter(params, "add_special_tokens", True)
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        self.end_id = -1 if eos is None else int(eos)  # -1: no end token
        self.pad_id = int(pad) if pad is not None else max(self.end_id, 0)

    def execute(self, requests):
        return respond_each(requests, self._preprocess, "preprocessing")

    def _preprocess(self, request) -> dict[str, np.ndarray]:
        query = required_input(request, "QUERY")
        batch = query.shape[0]
        texts = [_text(q) for q in query.reshape(batch, -1)[:, 0]]
        output_len = required_input(request, "REQUEST_OUTPUT_LEN").astype(np.int32).reshape(batch, 1)
        end_id = _per_row(optional_input(request, "END_ID"), self.end_id, batch, "END_ID")
        pad_id = _per_row(optional_input(request, "PAD_ID"), self.pad_id, batch, "PAD_ID")
        rows = [self.tokenizer.encode(t, add_special_tokens=self.add_special_tokens) for t in texts]
        width = max(len(r) for r in rows)
        ids = np.empty((batch, width), dtype=np.int32)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            ids[i, len(row):] = pad_id[i, 0]
        return {
            "INPUT_ID": ids,
            "REQUEST_INPUT_LEN": np.asarray([[len(r)] for r in rows], dtype=np.int32),
            "REQUEST_OUTPUT_LEN": output_len,
            "OUT_END_ID": end_id,
            "OUT_PAD_ID": pad_id,
        }


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _per_row(given: np.ndarray | None, default: int, batch: int, name: str) -> np.ndarray:
    if given is None:
        return np.full((batch, 1), default, dtype=np.int32)
    if given.size != batch:
        raise RequestError(name, f"expected one value per request row ({batch}), got {given.size}")
    return given.astype(np.int32).reshape(batch, 1)
