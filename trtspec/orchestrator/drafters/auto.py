"""`speculation: auto`: prompt lookup where the text repeats earlier text, the draft model elsewhere, and the client's
prediction where the request has one (OpenAI's Predicted Outputs: drafters/prediction.py).

Each iteration the drafter offers what each source can draft now (`offers`): prompt lookup the continuation it
found (none when the recent tokens match nothing earlier), up to `lookup_k`; the draft model up to `model_k`.
Prompt lookup costs no draft call, so its bound is the engine's (max_draft_len) where the draft model keeps the
request's K. The adaptive policy picks the source and k by expected tokens per unit of cost (adaptive.py); a fixed
draft length leaves the choice here, and here a found continuation wins. If the draft model fails, the request
keeps drafting from prompt lookup (`without_model`). A prediction drafts as far as prompt lookup, for the same reason;
where both found something and the policy does not choose (a fixed draft length), the prediction goes first: the
client said the answer follows it.
"""

from __future__ import annotations

from trtspec.orchestrator.adaptive import LOOKUP, PREDICTION
from trtspec.orchestrator.drafters.base import Draft, Drafter
from trtspec.orchestrator.drafters.prediction import PredictionDrafter
from trtspec.orchestrator.drafters.prompt_lookup import PromptLookupDrafter

MODEL = "draft_model"


class AutoDrafter:
    def __init__(
        self,
        model: Drafter | None,
        lookup: PromptLookupDrafter | None,
        *,
        model_k: int | None = None,
        lookup_k: int | None = None,
        prediction: PredictionDrafter | None = None,
    ):
        self.model, self.lookup, self.prediction = model, lookup, prediction
        self.model_k, self.lookup_k = model_k, lookup_k  # None: whatever the caller asks
        self._found: tuple[int, int, list[int]] | None = None  # (len(context), cap, continuation) of the last lookup
        self._offered: dict[str, list[int]] = {}  # the free sources' drafts at the last `offers`

    def _continuation(self, context: list[int], k: int) -> list[int]:
        # where the match is does not depend on k: look once per sequence, as far as either caller may ask
        if self.lookup is None:
            return []
        length = len(context)
        if self._found is None or self._found[0] != length or k > self._found[1]:
            cap = max(k, self.lookup_k or 0)
            self._found = (length, cap, self.lookup.index.continuation(context, cap))
        return self._found[2][:k]

    def offers(self, context: list[int], limit: int) -> dict[str, int]:
        """Source -> the longest draft it can give now, none longer than `limit`."""
        free = limit if self.lookup_k is None else min(self.lookup_k, limit)
        self._offered = {}
        if self.prediction is not None:  # first: where sources gain alike, the policy keeps the first offered
            self._offered[PREDICTION] = self.prediction.continuation(context, free)
        if self.lookup is not None:
            self._offered[LOOKUP] = self._continuation(context, free)
        offers = {source: len(tokens) for source, tokens in self._offered.items()}
        if self.model is not None:
            offers[MODEL] = min(self.model_k or limit, limit)
        return offers

    def offered(self) -> dict[str, list[int]]:
        return self._offered

    def propose(self, context: list[int], k: int, source: str | None = None) -> Draft:
        if source == PREDICTION or (source is None and self.prediction is not None):
            predicted = self.prediction.propose(context, k)
            if predicted.tokens or source == PREDICTION or (self.lookup is None and self.model is None):
                return predicted
        found = self._continuation(context, k)
        if source is None:
            source = LOOKUP if found or self.model is None else MODEL
        if source == LOOKUP:
            return Draft(found, source=LOOKUP)
        return self.model.propose(context, k)

    def lookup_words(self, context: list[int], shortest: int = 1) -> list[list[int]]:
        """Where a plain call should end for prompt lookup, or the prediction, to draft again."""
        words = self.lookup.lookup_words(context, shortest) if self.lookup is not None else []
        if self.prediction is not None:
            seen = {tuple(w) for w in words}
            words += [w for w in self.prediction.lookup_words(context, shortest) if tuple(w) not in seen]
        return words

    def without_model(self) -> AutoDrafter:
        """The same request's drafter once its draft model failed: prompt lookup (and the prediction) alone."""
        self.model = None
        return self

    def observe(self, *, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if self.model is not None:
            self.model.observe(num_draft_tokens=num_draft_tokens, num_accepted_tokens=num_accepted_tokens)
