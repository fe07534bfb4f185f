"""What every draft source shares: the Draft it proposes, the Drafter protocol and the failure it raises. The
drafters import these from here, never from the package itself, so the package's registry (drafters/__init__.py)
imports the drafters without a circle. The sources' names stay with the policy that tells them apart (adaptive.py)."""

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
