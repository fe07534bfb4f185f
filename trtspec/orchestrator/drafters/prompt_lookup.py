"""Prompt lookup: draft by copying what followed the most recent earlier occurrence of the last n tokens.

No model call at all, so it suits copy-heavy work (editing or annotating given code, summarising, RAG) and
needs no draft model deployed; the target verifies the copy like any draft (`draft_input_ids`).

A request looks up after every token of a plain stretch (loop.py: a match ends the stretch), so the lookup keeps an
index of where each n-gram last started (`NgramIndex`) instead of scanning the sequence each time.
"""

from __future__ import annotations

from trtspec.orchestrator.drafters.base import Draft


class NgramIndex:
    """The most recent start of each n-gram (n = min_ngram..max_ngram) of a sequence that grows at its end, so a
    lookup costs a few dict reads whatever the sequence's length. A sequence that is not the indexed one grown is
    indexed anew."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._tokens: list[int] = []
        self._starts: dict[tuple[int, ...], int] = {}  # n-gram -> its latest start with a token after it

    def continuation(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the sequence's last n tokens, trying
        n from `max_ngram` down to `min_ngram`; [] when nothing matches.

        The continuation may run into the matched suffix itself (an overlapping match), which is what makes
        repetitive text such as `a b a b a b` draft well."""
        if k <= 0:
            return []
        self._grow(tokens)
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            start = self._starts.get(tuple(tokens[length - n :]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []

    def shortest(self, tokens: list[int], min_continuation: int = 1) -> list[list[int]]:
        """The n-grams of the shortest length followed by at least `min_continuation` tokens: once the sequence
        ends with one of them, `continuation` finds that much (every longer match ends with one)."""
        self._grow(tokens)
        n, length = self.min_ngram, len(tokens)
        return [list(g) for g, start in self._starts.items() if len(g) == n and length - start - n >= min_continuation]

    def _grow(self, tokens: list[int]) -> None:
        done = len(self._tokens)
        if len(tokens) < done or tokens[:done] != self._tokens:
            self._tokens, self._starts, done = [], {}, 0
        # an n-gram counts once a token follows it that is not the sequence's last: it ends at length - 2 at most,
        # so the suffix never matches itself
        for end in range(max(done - 1, 0), len(tokens) - 1):
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self._starts[tuple(tokens[end - n + 1 : end + 1])] = end - n + 1
        self._tokens += tokens[done:]


# The shortest match that drafts: a single token (a common word, a comma) is followed by something else more
# often than not, and each such draft costs a verification pass for nothing.
MIN_MATCHING_NGRAM_SIZE = 2


class PromptLookupDrafter:
    def __init__(self, *, max_matching_ngram_size: int = 3):
        if max_matching_ngram_size < 1:
            raise ValueError(f"max_matching_ngram_size must be >= 1, got {max_matching_ngram_size}")
        self.index = NgramIndex(max_matching_ngram_size, min(MIN_MATCHING_NGRAM_SIZE, max_matching_ngram_size))

    def propose(self, context: list[int], k: int) -> Draft:
        return Draft(self.index.continuation(context, k), source="prompt_lookup")

    def lookup_words(self, context: list[int], shortest: int = 1) -> list[list[int]]:
        """Where a plain stretch should end for this drafter to draft at least `shortest` tokens: the sequence
        ending with one of these (stop words to the engine)."""
        return self.index.shortest(context, shortest)

    def observe(self, *, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        pass
