"""The pure arithmetic of `trtspec bench` (see the package docstring for the formulas): percentiles, the
expected tokens per iteration, the speculative bounds, the acceptance estimate, the verification-cost fit, the best
K and the speculation limit. No server, no client."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

# ---- arithmetic (pure) --------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between closest ranks (numpy's default):
    rank r = q/100 · (n-1); value = x[⌊r⌋] + (r - ⌊r⌋)·(x[⌊r⌋+1] - x[⌊r⌋]). None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    rank = q / 100.0 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (rank - lo) * (xs[hi] - xs[lo])


def distribution(values: Sequence[float]) -> dict[str, float | int | None]:
    """p50, p90, p99, mean and count of `values`."""
    values = list(values)
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values) if values else None,
        "n": len(values),
    }


def expected_tokens_per_iteration(alpha: float, k: int) -> float:
    """Leviathan et al. Eq. 1: E = (1 - α^(K+1)) / (1 - α) = Σ_{i=0..K} α^i (K + 1 when α = 1)."""
    return sum(alpha**i for i in range(k + 1))


def leviathan_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al. Thm 3.8: S = (1 - α^(K+1)) / ((1 - α)(K·c + 1)), verification costing one target step."""
    return expected_tokens_per_iteration(alpha, k) / (k * c + 1.0)


def decode_speedup(alpha: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """S = E(α, K) / (d + v): d and v, the measured draft and verify costs of one iteration in target steps."""
    return expected_tokens_per_iteration(alpha, k) / (draft_cost + verify_cost)


def predicted_speedup(
    alpha: float, k: int, *, c: float, mean_draft_length: float, verify_cost: float, prefill: float, tokens: float
) -> float:
    """End to end, for a request of `tokens` tokens whose prefill costs `prefill` target steps:

        S = (F + N - 1) / (F·(1 + c) + (N - 1)·(k̄·c + v) / E(α, K))

    target-only: the prefill (which gives the first token) and N - 1 steps; speculative: the same prefill plus
    the draft model's (c·F), then (N - 1) / E iterations of k̄ draft steps and one verification each."""
    expected = expected_tokens_per_iteration(alpha, k)
    plain = prefill + tokens - 1.0
    speculative = prefill * (1.0 + c) + (tokens - 1.0) * (mean_draft_length * c + verify_cost) / expected
    return plain / speculative if speculative > 0 else float("nan")


def estimate_alpha(accepted_per_position: Sequence[int], drafted_per_position: Sequence[int]) -> float | None:
    """Leviathan's α (acceptance of a draft token, i.i.d. per position), maximum likelihood from per-position counts:

        α̂ = Σ_i a_i / Σ_i t_i,   t_0 = d_0,   t_i = a_{i-1} · d_i / d_{i-1}

    a_i, d_i: accepted and drafted counts at draft position i; t_i: times position i was reached (drafted with all
    earlier positions accepted; the factor d_i / d_{i-1} removes the iterations that drafted fewer positions).
    None when nothing was drafted."""
    reached = accepted = 0.0
    for i, (a, d) in enumerate(zip(accepted_per_position, drafted_per_position)):
        if i == 0:
            t = float(d)
        else:
            prev_d = drafted_per_position[i - 1]
            t = accepted_per_position[i - 1] * d / prev_d if prev_d else 0.0
        reached += t
        accepted += a
    return accepted / reached if reached > 0 else None


def fit_verify_cost(points: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """(v0, b) of the least-squares line v = 1 + v0 + b·k through (k, v) points (k > 0), both at least 0.

    v is the cost of one verification of k draft tokens in target steps: one step, plus v0 for any pass with
    draft tokens, plus b per draft token. With a single k, or when the free fit gives v0 < 0, the line goes
    through v0 = 0: b = Σ k(v - 1) / Σ k²; when it gives b < 0, v0 is the mean of v - 1. None without points."""
    points = [(k, v - 1.0) for k, v in points if k > 0]
    if not points:
        return None
    if len({k for k, _ in points}) > 1:
        mean_k = sum(k for k, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        slope = sum((k - mean_k) * (y - mean_y) for k, y in points) / sum((k - mean_k) ** 2 for k, _ in points)
        if slope < 0:
            return max(0.0, mean_y), 0.0
        if mean_y - slope * mean_k >= 0:
            return mean_y - slope * mean_k, slope
    return 0.0, max(0.0, sum(k * y for k, y in points) / sum(k * k for k, _ in points))


def best_k(speedups: Mapping[int, float | None]) -> int | None:
    """The K with the largest speedup (K = 0 is 1.0 by definition); ties go to the smaller K."""
    scored = {k: (1.0 if k == 0 else s) for k, s in speedups.items()}
    scored = {k: s for k, s in scored.items() if s is not None}
    if not scored:
        return None
    top = max(scored.values())
    return min(k for k, s in scored.items() if s == top)


def speculation_limit(best_by_concurrency: Mapping[int, int | None]) -> int:
    """max_speculative_concurrency: when K = 0 wins at the highest measured concurrency, the highest concurrency
    at which some K > 0 still wins, or 1 when none does (a request alone may still speculate: its adaptive draft
    length decides); when speculation wins at the highest, 0 (no limit)."""
    measured = {c: k for c, k in best_by_concurrency.items() if k is not None}
    if not measured or measured[max(measured)] > 0:
        return 0
    winning = [c for c, k in measured.items() if k > 0]
    return max(winning) if winning else 1


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
