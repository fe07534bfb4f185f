"""Per-request records and per-cell statistics of a benchmark run, the comparison of each cell with the
target-only cell of its concurrency, and the speculative bound of a fixed-K cell."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from trtspec.bench.arithmetic import (
    _ratio,
    decode_speedup,
    distribution,
    estimate_alpha,
    expected_tokens_per_iteration,
    leviathan_speedup,
    predicted_speedup,
)

# ---- measurements -------------------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """One measured request of a cell (or a prefill probe)."""

    concurrency: int
    k: int
    round: int
    prompt: int
    adaptive: bool = False  # K was the upper bound of the deployment's adaptive draft length, not a fixed K
    tokens: int = 0
    seconds: float = 0.0
    ttft: float | None = None
    intervals: list[float] = field(default_factory=list)  # per token after the first response (streamed)
    accepted_draft_tokens: int = 0
    draft_tokens: int = 0
    iterations: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> times speculation was switched off
    sources: dict[str, int] = field(default_factory=dict)  # draft source -> iterations it drafted
    finish_reason: str | None = None
    output_digest: str | None = None  # a fingerprint of the token ids, when kept (Spec-Bench compares outputs)
    first_ms: float | None = None  # the prefill probe of this prompt (same round and concurrency)
    started_s: float | None = None  # when its block started, in seconds since the run started
    error: str | None = None


def record_from_completion(
    completion, *, concurrency: int, k: int, round: int, prompt: int, streamed: bool, adaptive: bool = False
) -> RequestRecord:
    """A RequestRecord from a client Completion (trtspec.generation)."""
    intervals: list[float] = []
    if streamed:
        with_tokens = [c for c in completion.chunks if c.token_ids]
        for before, chunk in zip(with_tokens, with_tokens[1:]):
            gap = chunk.seconds - before.seconds
            intervals += [gap / len(chunk.token_ids)] * len(chunk.token_ids)
    return RequestRecord(
        concurrency=concurrency,
        k=k,
        round=round,
        prompt=prompt,
        adaptive=adaptive,
        tokens=len(completion.token_ids),
        seconds=completion.seconds,
        ttft=completion.time_to_first_token if streamed else None,
        intervals=intervals,
        accepted_draft_tokens=completion.accepted_draft_tokens or 0,
        draft_tokens=completion.draft_tokens or 0,
        iterations=completion.iterations or 0,
        draft_ms=completion.draft_ms or 0.0,
        verify_ms=completion.verify_ms or 0.0,
        accepted_per_position=list(completion.accepted_per_position),
        drafted_per_position=list(completion.drafted_per_position),
        fallbacks=dict(completion.fallbacks),
        sources=dict(completion.sources),
        finish_reason=completion.finish_reason,
    )


def output_digest(token_ids) -> str:
    """A short fingerprint of an output's token ids, to compare outputs without keeping them."""
    return hashlib.sha1(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


def _sum_positions(rows: Iterable[Sequence[int]]) -> list[int]:
    total: list[int] = []
    for row in rows:
        if len(row) > len(total):
            total += [0] * (len(row) - len(total))
        for i, v in enumerate(row):
            total[i] += v
    return total


def summarize_cell(
    records: Sequence[RequestRecord], wall_seconds: float, *, concurrency: int, k: int, adaptive: bool = False
) -> dict:
    """The figures of one cell from its requests and the summed wall time of its blocks (formulas: module doc)."""
    ok = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in ok)
    accepted, drafted = sum(r.accepted_draft_tokens for r in ok), sum(r.draft_tokens for r in ok)
    iterations = sum(r.iterations for r in ok)
    draft_ms, verify_ms = sum(r.draft_ms for r in ok), sum(r.verify_ms for r in ok)
    e2e_ms = sum(r.seconds for r in ok) * 1e3
    acc_pos = _sum_positions(r.accepted_per_position for r in ok)
    drafted_pos = _sum_positions(r.drafted_per_position for r in ok)
    speculative = drafted_pos[0] if drafted_pos else 0
    ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    fallbacks: dict[str, int] = {}
    sources: dict[str, int] = {}
    for r in ok:
        for reason, n in r.fallbacks.items():
            fallbacks[reason] = fallbacks.get(reason, 0) + n
        for source, n in r.sources.items():
            sources[source] = sources.get(source, 0) + n
    return {
        "concurrency": concurrency,
        "k": k,
        "adaptive": adaptive,
        "requests": len(ok),
        "errors": len(records) - len(ok),
        "error_messages": sorted({r.error for r in records if r.error})[:5],
        "tokens": tokens,
        "wall_s": wall_seconds,
        "ttft_ms": distribution(ttfts) if ttfts else None,
        "itl_ms": distribution([x * 1e3 for r in ok for x in r.intervals]) if ttfts else None,
        "e2e_ms": distribution([r.seconds * 1e3 for r in ok]),
        "tokens_per_s": distribution([r.tokens / r.seconds for r in ok if r.seconds > 0]),
        "tokens_per_s_aggregate": tokens / wall_seconds if wall_seconds > 0 else None,
        "accepted_draft_tokens": accepted,
        "draft_tokens": drafted,
        "iterations": iterations,
        "speculative_iterations": speculative,
        "fallbacks": fallbacks,
        "requests_with_fallback": sum(bool(r.fallbacks) for r in ok),
        "sources": sources,
        "acceptance_rate": _ratio(accepted, drafted),
        "accepted_per_iteration": _ratio(accepted, speculative),
        "tokens_per_iteration": _ratio(accepted + speculative, speculative),  # per verification
        "mean_draft_length": _ratio(drafted, speculative),
        "accepted_per_position": acc_pos,
        "drafted_per_position": drafted_pos,
        "position_acceptance": [a / d if d else None for a, d in zip(acc_pos, drafted_pos)],
        "alpha": estimate_alpha(acc_pos, drafted_pos),
        "draft_ms": draft_ms,
        "verify_ms": verify_ms,
        "first_iteration_ms": sum(r.first_ms for r in ok if r.first_ms is not None),
        "first_iteration_measured": sum(r.first_ms is not None for r in ok),
        "time_split": {
            "draft": _ratio(draft_ms, e2e_ms),
            "verify": _ratio(verify_ms, e2e_ms),
            "other": _ratio(e2e_ms - draft_ms - verify_ms, e2e_ms),
        }
        if e2e_ms > 0
        else None,
    }


def target_step_ms(baseline: dict) -> float | None:
    """t₁ = (verify_ms - ΣF_r) / (tokens - n) of a K = 0 cell: one decoding step after the first token
    (verify_ms / tokens when the prefill probes are missing)."""
    n, tokens, verify = baseline.get("requests", 0), baseline.get("tokens", 0), baseline.get("verify_ms", 0.0)
    if baseline.get("first_iteration_measured") == n and tokens > n:
        step = (verify - baseline["first_iteration_ms"]) / (tokens - n)
        if step > 0:
            return step
    return verify / tokens if tokens and verify else None


def analyse(cells: Sequence[dict]) -> list[dict]:
    """Each cell with its speedup and time-to-first-token ratio against K = 0 at the same concurrency and, for a
    fixed K > 0, the bound (module doc; its i.i.d. model assumes K tokens drafted every iteration)."""
    baselines = {c["concurrency"]: c for c in cells if c["k"] == 0}
    out = []
    for cell in cells:
        cell = dict(cell)
        base = baselines.get(cell["concurrency"])
        p50 = (cell.get("tokens_per_s") or {}).get("p50")
        base_p50 = ((base or {}).get("tokens_per_s") or {}).get("p50")
        cell["speedup"] = _ratio(cell["tokens_per_s_aggregate"], (base or {}).get("tokens_per_s_aggregate"))
        cell["latency_speedup"] = _ratio(p50, base_p50)
        cell["ttft_ratio"] = _ratio(
            (cell.get("ttft_ms") or {}).get("p50"), ((base or {}).get("ttft_ms") or {}).get("p50")
        )
        step = target_step_ms(base) if base else None
        cell["bound"] = bound(cell, step) if cell["k"] > 0 and not cell.get("adaptive") else None
        out.append(cell)
    return out


def bound(cell: dict, step_ms: float | None) -> dict | None:
    """The cost model and the predicted speedups of a K > 0 cell, given the target step t₁ (module doc)."""
    n, spec, alpha, k = cell["requests"], cell["speculative_iterations"], cell["alpha"], cell["k"]
    if not (n and spec and step_ms and alpha is not None):
        return None
    first = cell["first_iteration_ms"] if cell["first_iteration_measured"] == n else 0.0
    plain_after_first = max(0, cell["iterations"] - spec - n)
    c = cell["draft_ms"] / (first + step_ms * cell["draft_tokens"])
    kbar = cell["draft_tokens"] / spec
    v = (cell["verify_ms"] - first - plain_after_first * step_ms) / spec / step_ms
    prefill, tokens = first / n / step_ms, cell["tokens"] / n
    predicted = predicted_speedup(alpha, k, c=c, mean_draft_length=kbar, verify_cost=v, prefill=prefill, tokens=tokens)
    return {
        "target_step_ms": step_ms,
        "alpha": alpha,
        "draft_cost_ratio": c,
        "mean_draft_length": kbar,
        "verify_cost": v,
        "prefill_steps": prefill,
        "expected_tokens_per_iteration": expected_tokens_per_iteration(alpha, k),
        "measured_tokens_per_iteration": cell["tokens_per_iteration"],
        "leviathan_speedup": leviathan_speedup(alpha, k, c),
        "decode_speedup": decode_speedup(alpha, k, kbar * c, v),
        "predicted_speedup": predicted,
        "achieved_speedup": cell["speedup"],
        "efficiency": _ratio(cell["speedup"], predicted),
    }
