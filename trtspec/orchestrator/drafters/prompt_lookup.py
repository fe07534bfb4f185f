"""Prompt lookup: draft by copying what followed the most recent earlier occurrence of the last n tokens.

No model call at all, so it suits copy-heavy work (editing or annotating given code, summarising, RAG) and
needs no draft model deployed; the target verifies the copy like any draft (`draft_input_ids`).
"""

from __future__ import annotations

from trtspec.orchestrator.drafters import Draft


def find_continuation(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the sequence's last n tokens,
    trying n from `max_ngram` down to `min_ngram`; [] when nothing matches.

    The continuation may run into the matched suffix itself (an overlapping match), which is what makes
    repetitive text such as `a b a b a b` draft well.
    """
    length = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        pattern = tokens[length - n :]
        # the most recent occurrence that ends before the suffix itself and has something after it
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == pattern:
                follow = start + n
                return tokens[follow : follow + k]
    return []


class PromptLookupDrafter:
    def __init__(self, *, max_matching_ngram_size: int = 3):
        if max_matching_ngram_size < 1:
            raise ValueError(f"max_matching_ngram_size must be >= 1, got {max_matching_ngram_size}")
        self.max_ngram = max_matching_ngram_size

    def propose(self, context: list[int], k: int) -> Draft:
        return Draft(find_continuation(context, k, self.max_ngram), source="prompt_lookup")

    def observe(self, *, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        pass
