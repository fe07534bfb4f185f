"""An output head over part of the vocabulary whose logits still come out in the full vocabulary (FR-Spec).

A draft spends much of a step on its output head (a 49152 x 576 head is a fifth of a 135M target's step). A draft
that only ever proposes the N tokens its target emits most often needs only those N rows: the matmul is N x hidden,
and the N logits are scattered into a full-vocabulary row whose other entries are -inf. Token ids stay the
target's, greedy and sampled drafts never propose a token outside the set, and draft logits keep the contract's
[.., vocab] shape (a token outside the set has probability 0), so no other code needs to know.

A checkpoint asks for it with `trtspec_head_tokens: N` in its Hugging Face config; the head's state is
`lm_head.weight` [N, hidden] and `lm_head.token_ids` [N] (the target id of each row).
"""

from __future__ import annotations

import torch
from torch import nn

CONFIG_KEY = "trtspec_head_tokens"


class SubsetHead(nn.Module):
    def __init__(self, hidden_size: int, num_tokens: int, vocab_size: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_tokens, hidden_size, dtype=dtype))
        self.register_buffer("token_ids", torch.arange(num_tokens, dtype=torch.int64))
        self.vocab_size = vocab_size
        self.full_vocab = True  # False: return the N logits themselves (training computes its loss on those)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(hidden, self.weight)
        if not self.full_vocab:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.token_ids, logits)


def head_tokens(config) -> int | None:
    value = getattr(config, CONFIG_KEY, None)
    return int(value) if value else None


def install(model) -> None:
    """Give `model` a SubsetHead in place of its lm_head when its config asks for one (else leave it as it is)."""
    n = head_tokens(model.config)
    if n is None:
        return
    if getattr(model.config, "tie_word_embeddings", False):
        raise ValueError(f"{CONFIG_KEY} needs tie_word_embeddings: false (a subset head is not the input embedding)")
    old = model.get_output_embeddings()
    model.lm_head = SubsetHead(old.in_features, n, model.config.vocab_size, dtype=old.weight.dtype).to(
        old.weight.device
    )
