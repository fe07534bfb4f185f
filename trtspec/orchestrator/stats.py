"""Per-request speculation statistics: plain counters, with the derived figures as properties.

acceptance_rate       = num_accepted_tokens / num_draft_tokens
tokens_per_iteration  = generated_tokens / iterations   (mean accepted length + 1 when every iteration verifies)
position_acceptance_i = accepted_per_position[i] / drafted_per_position[i]
                        (the chance that draft position i is accepted, given it was drafted)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class RequestStats:
    iterations: int = 0
    num_drafts: int = 0  # iterations that verified a draft
    num_draft_tokens: int = 0  # draft tokens proposed
    num_accepted_tokens: int = 0  # of those, accepted by the target
    generated_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    finish_reason: str | None = None
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> times speculation was switched off
    fallback_iterations: dict[str, int] = field(default_factory=dict)  # reason -> plain iterations it cost
    sources: dict[str, int] = field(default_factory=dict)  # draft source -> iterations it drafted (auto)
    source_tokens: dict[str, int] = field(default_factory=dict)  # draft source -> draft tokens it proposed
    recoveries: int = 0  # times the request waited for its target to come back and went on
    wasted_steps: int = 0  # target steps whose token the engine dropped: a streamed stretch stopped to draft

    def record(
        self,
        *,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        emitted: int,
        draft_seconds: float,
        verify_seconds: float,
        fallback: str | None = None,
        source: str | None = None,
        wasted_steps: int = 0,
    ) -> None:
        self.iterations += 1
        self.wasted_steps += wasted_steps
        if source and num_draft_tokens:
            self.sources[source] = self.sources.get(source, 0) + 1
            self.source_tokens[source] = self.source_tokens.get(source, 0) + num_draft_tokens
        if fallback:
            self.fallback_iterations[fallback] = self.fallback_iterations.get(fallback, 0) + 1
        self.num_drafts += num_draft_tokens > 0
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        self.generated_tokens += emitted
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        grow = num_draft_tokens - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(num_draft_tokens):
            self.drafted_per_position[i] += 1
            # a draft is accepted as a prefix: positions 0..num_accepted_tokens-1 were accepted
            self.accepted_per_position[i] += i < num_accepted_tokens

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_iteration(self) -> float:
        return self.generated_tokens / self.iterations if self.iterations else 0.0

    def position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]
