"""The `postprocessing` model: token ids -> text, with the stock tensorrtllm_backend tensor names.

TOKENS_BATCH [B, beams, L] and SEQUENCE_LENGTH [B, beams] -> OUTPUT [B x beams]: each row's first
SEQUENCE_LENGTH tokens, detokenized, one string per row, flat as NVIDIA's postprocessing returns them (its
clients read `OUTPUT[0]` as the text).
"""

from __future__ import annotations

import numpy as np

from trtspec.errors import RequestError
from trtspec.triton.common import (
    bool_parameter,
    input_arrays,
    load_tokenizer,
    model_parameters,
    parameter,
    required,
    respond_each,
)


class TritonPythonModel:
    def initialize(self, args):
        params = model_parameters(args)
        self.tokenizer = load_tokenizer(parameter(params, "tokenizer_dir"))
        self.skip_special_tokens = bool_parameter(params, "skip_special_tokens", True)

    def execute(self, requests):
        return respond_each(requests, self._postprocess, "postprocessing")

    def _postprocess(self, request) -> dict[str, np.ndarray]:
        inputs = input_arrays(request)
        tokens = required(inputs, "TOKENS_BATCH")
        lengths = required(inputs, "SEQUENCE_LENGTH")
        if tokens.ndim == 2:  # [B, L]: one beam
            tokens = tokens[:, None, :]
        if lengths.size != tokens.shape[0] * tokens.shape[1]:
            raise RequestError(
                "SEQUENCE_LENGTH", f"has {lengths.size} values for {tokens.shape[0]}x{tokens.shape[1]} token rows"
            )
        lengths = lengths.reshape(tokens.shape[:2])
        texts = np.empty(tokens.shape[0] * tokens.shape[1], dtype=np.object_)
        for i, (b, k) in enumerate(np.ndindex(*tokens.shape[:2])):
            row = tokens[b, k, : int(lengths[b, k])].tolist()
            texts[i] = self.tokenizer.decode(row, skip_special_tokens=self.skip_special_tokens).encode("utf-8")
        return {"OUTPUT": texts}
