"""Draft sources. A drafter is two methods (`propose`, `observe`); the registry maps a request's choice to one.

Each drafter lives in its own file and registers itself here by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


class DraftFailed(Exception):
    """A drafter could not propose (its model failed or is known to be down): the request goes on without drafts."""


@dataclass
class Draft:
    tokens: list[int]
    logits: np.ndarray | None = None  # [len(tokens), V], for modified rejection sampling
    source: str | None = None  # which source drafted it (auto has several)


class Drafter(Protocol):
    def propose(self, context: list[int], k: int) -> Draft:
        """Up to k tokens that may follow `context` (prompt + everything accepted so far)."""

    def observe(self, *, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """What the target made of the last proposal."""


def drafter_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def make_drafter(name: str, **options) -> Drafter:
    if name not in _REGISTRY:
        raise KeyError(f"unknown drafter {name!r}; choose one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name](**options)


def _registry() -> dict[str, type]:
    from trtspec.orchestrator.drafters.auto import AutoDrafter
    from trtspec.orchestrator.drafters.draft_model import DraftModelDrafter
    from trtspec.orchestrator.drafters.prompt_lookup import PromptLookupDrafter

    return {"draft_model": DraftModelDrafter, "prompt_lookup": PromptLookupDrafter, "auto": AutoDrafter}


_REGISTRY = _registry()
