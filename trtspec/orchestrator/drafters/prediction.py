"""The client's prediction as a draft source: OpenAI's Predicted Outputs (`prediction: {"type": "content", ...}`).

A prediction is the text the answer is expected to mostly repeat (the file being edited, the paragraph being
rewritten). While the output follows it, the next prediction tokens are the draft. When the output leaves it (an
edit), drafting finds its place again by n-gram match, as prompt lookup does on the prompt: the output's last n tokens
(n = max_ngram down to min_ngram) are looked up in the prediction, nearest to where the output last followed it (an
edit moves forward through the file), and the prediction goes on from after the match. Where nothing matches, it
offers nothing and the request's other sources draft (auto).

It costs no model call, so the adaptive policy weighs it like prompt lookup, with an acceptance of its own: a wrong
prediction is drafted from a few times, found not to gain, and left (adaptive.py).

What the usage reports (OpenAI's `completion_tokens_details`) is read off the finished output, not the drafts, as
OpenAI defines it: accepted_prediction_tokens, the prediction's tokens that appear in the completion (in order:
the longest matching blocks); rejected_prediction_tokens, the prediction's other tokens.
"""

from __future__ import annotations

import bisect
import difflib

from trtspec.errors import RequestError
from trtspec.orchestrator.adaptive import PREDICTION
from trtspec.orchestrator.drafters.base import Draft

# A single token (a newline, a bracket) occurs all over a file: matching on one would jump to the wrong place more
# often than not. Two tokens find the place again one token after an edit's end.
MIN_NGRAM = 2
MAX_NGRAM = 4


class PredictionDrafter:
    """Drafts from `prediction` (token ids) for the request whose prompt is `prompt_len` tokens long: the context it
    is given is the prompt and the output so far, and the prediction stands for the output."""

    def __init__(
        self, prediction: list[int], prompt_len: int, *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM
    ):
        self.prediction, self.prompt_len = list(prediction), prompt_len
        self.min_ngram, self.max_ngram = min_ngram, max(min_ngram, max_ngram)
        # n-gram -> its starts in the prediction, ascending, where at least one token follows it
        self._starts: dict[tuple[int, ...], list[int]] = {}
        for n in range(self.min_ngram, self.max_ngram + 1):
            for start in range(len(self.prediction) - n):
                self._starts.setdefault(tuple(self.prediction[start : start + n]), []).append(start)
        self._at: tuple[int, int] | None = (0, 0)  # (output tokens, prediction position) where they last agreed
        self._near = 0  # where the output last followed the prediction: re-alignment looks from here on first

    def continuation(self, context: list[int], k: int) -> list[int]:
        """Up to k prediction tokens that would follow the output in `context` ([] where it has left the prediction
        and no n-gram finds it again, or the prediction is used up)."""
        if k <= 0:
            return []
        position = self._align(context[self.prompt_len :])
        return [] if position is None else self.prediction[position : position + k]

    def propose(self, context: list[int], k: int) -> Draft:
        return Draft(self.continuation(context, k), source=PREDICTION)

    def observe(self, *, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        pass

    def lookup_words(self, context: list[int], shortest: int = 1) -> list[list[int]]:
        """The n-grams of the shortest length after which the prediction goes on for at least `shortest` tokens: a
        plain call that ends on one can draft from the prediction again (loop.py: stop words of a plain call)."""
        n, length = self.min_ngram, len(self.prediction)
        return [list(g) for g, starts in self._starts.items() if len(g) == n and length - starts[-1] - n >= shortest]

    # ---- where the output is in the prediction ----
    def _align(self, output: list[int]) -> int | None:
        if self._at is not None:
            done, position = self._at
            new = output[done:]
            if len(output) >= done and self.prediction[position : position + len(new)] == new:
                self._at = (len(output), position + len(new))
                self._near = self._at[1]
                return self._at[1]
        position = self._match(output)
        self._at = None if position is None else (len(output), position)
        if position is not None:
            self._near = position
        return position

    def _match(self, output: list[int]) -> int | None:
        """The prediction position after the longest n-gram that ends the output, the first occurrence from where
        the output last followed the prediction on (else the last one before it); None where none occurs."""
        for n in range(min(self.max_ngram, len(output)), self.min_ngram - 1, -1):
            starts = self._starts.get(tuple(output[-n:]))
            if not starts:
                continue
            i = bisect.bisect_left(starts, self._near - n)
            start = starts[i] if i < len(starts) else starts[-1]
            return start + n
        return None


def prediction_usage(prediction: list[int], output: list[int]) -> tuple[int, int]:
    """(accepted_prediction_tokens, rejected_prediction_tokens) as OpenAI defines them: the prediction's tokens that
    appear in the completion, in order (the matching blocks of the two sequences), and those that do not."""
    if not prediction:
        return 0, 0
    matcher = difflib.SequenceMatcher(None, prediction, output, autojunk=False)
    accepted = sum(block.size for block in matcher.get_matching_blocks())
    return accepted, len(prediction) - accepted


def prediction_tokens(tokenizer, text: str, *, max_chars: int, max_tokens: int) -> list[int]:
    """The `prediction` input's token ids (without special tokens: it stands for output text), refused before the
    tokenizer past `max_chars` characters, and past `max_tokens` tokens (no answer could be longer)."""
    if len(text) > max_chars:
        raise RequestError(
            "prediction", f"is {len(text)} characters; this deployment takes at most {max_chars} (max_input_chars)"
        )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
    if len(ids) > max_tokens:
        raise RequestError(
            "prediction", f"is {len(ids)} tokens; no answer here is longer than max_seq_len {max_tokens}: shorten it"
        )
    return ids
