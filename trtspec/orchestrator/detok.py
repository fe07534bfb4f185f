"""Incremental detokenization for streaming: emit only text that can no longer change.

A token can end in the middle of a UTF-8 character, and some tokenizers render a token differently
depending on its neighbours, so each chunk is the difference between decoding a short window of recent
tokens with and without the new ones; text ending in U+FFFD (an incomplete character) is held back.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = 0  # tokens before this are already emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; return the text that is now final (possibly empty)."""
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """The rest of the text at the end of the generation (an incomplete character included)."""
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before) :]
