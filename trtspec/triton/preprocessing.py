"""The `preprocessing` model: text -> token ids, with the tensors of NVIDIA's preprocessing model.

QUERY [B, 1] -> INPUT_ID [B, L] (rows padded with the pad id), REQUEST_INPUT_LEN [B, 1]; REQUEST_OUTPUT_LEN
passes through; OUT_END_ID / OUT_PAD_ID are the request's END_ID / PAD_ID or the tokenizer's EOS / pad token;
BAD_WORDS_DICT / STOP_WORDS_DICT [B, N] -> BAD_WORDS_IDS / STOP_WORDS_IDS [B, 2, W] in TensorRT-LLM's word-list
layout (each string one word, tokenized without special tokens; ids padded with 0, end offsets with -1; [B, 2, 0]
when absent). The encoder-decoder, embedding-bias and prompt-table outputs go out empty, and the inputs that would
fill them are taken only empty (trtspec.interfaces); the multimodal outputs are declared and never written.
"""

from __future__ import annotations

import numpy as np

from trtspec.checkpoint import declared_end_ids
from trtspec.contract import check_neutral
from trtspec.errors import RequestError
from trtspec.interfaces import PREPROCESSING_INPUTS
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
        self.add_special_tokens = bool_parameter(params, "add_special_tokens", True)
        eos = self.tokenizer.eos_token_id
        pad = self.tokenizer.pad_token_id
        self.end_ids = declared_end_ids(parameter(params, "tokenizer_dir"), eos)
        self.end_id = self.end_ids[0] if self.end_ids else -1  # -1: no end token
        self.pad_id = int(pad) if pad is not None else max(self.end_id, 0)

    def execute(self, requests):
        return respond_each(requests, self._preprocess, "preprocessing")

    def _preprocess(self, request) -> dict[str, np.ndarray]:
        inputs = input_arrays(request)
        check_neutral(inputs, PREPROCESSING_INPUTS)
        query = required(inputs, "QUERY")
        batch = query.shape[0]
        texts = [_text(q) for q in query.reshape(batch, -1)[:, 0]]
        output_len = required(inputs, "REQUEST_OUTPUT_LEN").astype(np.int32).reshape(batch, 1)
        end_id = _per_row(inputs.get("END_ID"), self.end_id, batch, "END_ID")
        pad_id = _per_row(inputs.get("PAD_ID"), self.pad_id, batch, "PAD_ID")
        rows = [self.tokenizer.encode(t, add_special_tokens=self.add_special_tokens) for t in texts]
        width = max(len(r) for r in rows)
        ids = np.empty((batch, width), dtype=np.int32)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            ids[i, len(row) :] = pad_id[i, 0]
        return {
            "INPUT_ID": ids,
            "REQUEST_INPUT_LEN": np.asarray([[len(r)] for r in rows], dtype=np.int32),
            "DECODER_INPUT_ID": np.zeros((batch, 0), dtype=np.int32),
            "REQUEST_DECODER_INPUT_LEN": np.zeros((batch, 1), dtype=np.int32),
            "BAD_WORDS_IDS": self._word_lists(inputs.get("BAD_WORDS_DICT"), batch),
            # the model's other end tokens (generation_config.json) as stop words, unless the client named its end
            # id: the engine takes one END_ID; the ensemble's text then stops where the BLS's does
            "STOP_WORDS_IDS": self._word_lists(
                inputs.get("STOP_WORDS_DICT"),
                batch,
                extra=[] if "END_ID" in inputs else [[e] for e in self.end_ids[1:]],
            ),
            "EMBEDDING_BIAS": np.zeros((batch, 0), dtype=np.float32),
            "REQUEST_OUTPUT_LEN": output_len,
            "OUT_END_ID": end_id,
            "OUT_PAD_ID": pad_id,
            "OUT_PROMPT_TABLE_EXTRA_IDS": np.zeros((batch, 0), dtype=np.uint64),
        }

    def _word_lists(self, words: np.ndarray | None, batch: int, extra: list[list[int]] = ()) -> np.ndarray:
        """Each row's words (strings, tokenized) and then `extra` (token-id words), in TensorRT-LLM's layout."""
        rows = words.reshape(batch, -1) if words is not None else [[] for _ in range(batch)]
        per_row = []
        for row in rows:
            encoded = [self.tokenizer.encode(_text(w), add_special_tokens=False) for w in row]
            per_row.append([w for w in encoded if w] + list(extra))
        if not any(per_row):
            return np.zeros((batch, 2, 0), dtype=np.int32)
        width = max([1] + [max(sum(len(w) for w in ws), len(ws)) for ws in per_row])
        out = np.zeros((batch, 2, width), dtype=np.int32)
        out[:, 1, :] = -1
        for i, ws in enumerate(per_row):
            flat = [t for w in ws for t in w]
            out[i, 0, : len(flat)] = flat
            out[i, 1, : len(ws)] = np.cumsum([len(w) for w in ws])
        return out


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _per_row(given: np.ndarray | None, default: int, batch: int, name: str) -> np.ndarray:
    if given is None:
        return np.full((batch, 1), default, dtype=np.int32)
    if given.size != batch:
        raise RequestError(name, f"expected one value per request row ({batch}), got {given.size}")
    return given.astype(np.int32).reshape(batch, 1)
