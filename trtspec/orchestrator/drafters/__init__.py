"""Draft sources. A drafter is two methods (`propose`, `observe`); the registry maps a request's choice to one.

Each drafter lives in its own file and registers itself here by name.
"""

from __future__ import annotations

import functools
from typing import Protocol

# the types every drafter shares live in base.py, which the drafters import: the registry below imports the drafters,
# and none of them imports this package back
from trtspec.orchestrator.drafters.base import Draft, Drafter, DraftFailed

__all__ = ["Draft", "DraftFailed", "Drafter", "DraftSources", "SingleSource", "as_sources", "make_drafter"]


class DraftSources(Protocol):
    """The drafter the loop runs: one or several draft sources (auto: prompt lookup and the draft model), each offering
    what it can draft now so that the draft-length policy can pick one."""

    def offers(self, context: list[int], limit: int) -> dict[str, int] | None:
        """Source -> the longest draft it can give now, none longer than `limit`; None from a single source (the policy
        then has nothing to choose between)."""

    def propose(self, context: list[int], k: int, source: str | None = None) -> Draft:
        """Up to k tokens from `source` (None: the drafter's own choice)."""

    def observe(self, *, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """What the target made of the last proposal."""

    def lookup_words(self, context: list[int], shortest: int = 1) -> list[list[int]]:
        """The n-grams after which prompt lookup finds at least `shortest` tokens ([]: it has no prompt lookup)."""

    def offered(self) -> dict[str, list[int]]:
        """The drafts the sources that cost no draft call (prompt lookup, the prediction) offered at the last
        `offers`, so that those not verified can be scored against the target's tokens ({}: none)."""

    def without_model(self) -> DraftSources | None:
        """The drafter once its draft model failed: its other sources, or None where it has none."""


class SingleSource:
    """One drafter as DraftSources: nothing to choose between; `lookup`: the drafter itself where it is prompt
    lookup, whose matches end a plain call."""

    def __init__(self, drafter: Drafter, lookup=None):
        self.drafter, self.lookup = drafter, lookup

    def offers(self, context: list[int], limit: int) -> None:
        return None

    def offered(self) -> dict[str, list[int]]:
        return {}

    def propose(self, context: list[int], k: int, source: str | None = None) -> Draft:
        return self.drafter.propose(context, k)

    def observe(self, *, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.drafter.observe(num_draft_tokens=num_draft_tokens, num_accepted_tokens=num_accepted_tokens)

    def lookup_words(self, context: list[int], shortest: int = 1) -> list[list[int]]:
        return self.lookup.lookup_words(context, shortest) if self.lookup is not None else []

    def without_model(self) -> None:
        return None


def as_sources(drafter: Drafter | DraftSources | None) -> DraftSources | None:
    """The drafter as the loop runs it: auto as it is, any other drafter as its single source."""
    from trtspec.orchestrator.drafters.auto import AutoDrafter
    from trtspec.orchestrator.drafters.prompt_lookup import PromptLookupDrafter

    if drafter is None or isinstance(drafter, (AutoDrafter, SingleSource)):
        return drafter
    return SingleSource(drafter, lookup=drafter if isinstance(drafter, PromptLookupDrafter) else None)


def make_drafter(name: str, **options) -> Drafter:
    registry = _registry()
    if name not in registry:
        raise KeyError(f"unknown drafter {name!r}; choose one of {', '.join(registry)}")
    return registry[name](**options)


@functools.cache
def _registry() -> dict[str, type]:
    from trtspec.orchestrator.drafters.auto import AutoDrafter
    from trtspec.orchestrator.drafters.draft_model import DraftModelDrafter
    from trtspec.orchestrator.drafters.prompt_lookup import PromptLookupDrafter

    return {"draft_model": DraftModelDrafter, "prompt_lookup": PromptLookupDrafter, "auto": AutoDrafter}
