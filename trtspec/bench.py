"""`trtspec bench`: latency, throughput, acceptance and the speculative bound of a deployment, per (concurrency, K).

Every (concurrency C, draft length K) pair is a cell; K = 0 is the target-only baseline of its concurrency. A
K > 0 cell either keeps K fixed, or (`--draft-length adaptive`, or `both` for the two side by side) lets the
deployment's adaptive draft length choose each iteration's k in 1..K and fall back to plain decoding. The
cells run in ONE run, interleaved: the run is a sequence of rounds, and each round runs one block of every cell
in a shuffled order. A block of cell (C, K) is C requests sent at once by C clients (one per thread); within a
round every K of a concurrency gets the same prompts, so the prompts' lengths and difficulty, and the machine's
noise, fall on all the cells alike. Each round also has a prefill probe block per concurrency: the same prompts
with K = 0 and max_tokens = 1, whose verify time is the cost of a request's first iteration (the target's
prefill and first token), which the cost model below keeps apart from the decoding steps.

Every request's prompt starts with its own number ("#4817203 ", from a random start), so that no request finds
another's prompt in the engines' prefix KV cache (the same prompt runs once per K, and runs repeat); what real
traffic shares (e.g. a chat template's system prompt) is still reused. `--reuse-prompts` sends the prompts as they are.

Per request (`RequestRecord`): tokens, end-to-end seconds, time to first token, the token intervals of a stream,
and the BLS's perf fields (accepted / drafted tokens, iterations, draft and verify milliseconds, acceptance per
draft position). Per cell (`summarize_cell`), with percentiles by linear interpolation (`percentile`):

    ttft                       time to the first response carrying tokens (streamed requests only)
    ttft_ratio                 p50 ttft / p50 ttft of the K = 0 cell of the same concurrency
    itl                        inter-token latency: each streamed response after the first contributes its gap
                               to the response before, divided by its token count, once per token
    e2e                        request end to end
    tokens_per_s (request)     tokens / e2e, per request
    tokens_per_s_aggregate     sum of tokens / sum of the cell's block wall times
    I                          speculative iterations = drafted_per_position[0] (iterations that drafted)
    acceptance_rate            accepted / drafted
    accepted_per_iteration     accepted / I                  (the mean accepted length)
    tokens_per_iteration       (tokens - plain iterations) / I   (a plain iteration adds one token)
    position_acceptance_i      accepted_per_position[i] / drafted_per_position[i]
    time split                 draft_ms, verify_ms and the rest (client, transport, tokenization, BLS bookkeeping)
                               as fractions of the summed end-to-end time
    fallbacks                  reason -> times speculation was switched off (low_acceptance, load), summed

Against the K = 0 cell of the same concurrency (`analyse`):

    speedup                    tokens_per_s_aggregate(K) / tokens_per_s_aggregate(0)
    latency_speedup            p50 per-request tokens/s (K) / p50 per-request tokens/s (0)

The bound (Leviathan et al. 2023, §3): with α the chance that a draft token is accepted (i.i.d. per position),
c the cost of one draft step and v the cost of verifying K draft tokens, both in target steps,

    E(α, K)        = (1 - α^(K+1)) / (1 - α) = Σ_{i=0..K} α^i     tokens per speculative iteration   (Eq. 1)
    S_leviathan    = E / (K·c + 1)                                verification as one target step    (Thm 3.8)
    S_decode       = E / (k̄·c + v)                                the decoding phase, measured costs
    S_predicted    = (F + N - 1) / (F·(1 + c) + (N - 1)·(k̄·c + v) / E)                 end to end

measured (sums over a cell's requests; F_r: the prefill probe of request r's prompt, same round and concurrency;
n requests, `plain` = iterations - I - n plain iterations after the first) as

    t₁  target step = (verify_ms - ΣF_r) / (tokens - n)         of the K = 0 cell of the same concurrency
    c   = draft_ms / (ΣF_r + t₁·drafted)     one draft step / one target step; the draft model's own prefill of
                                              the prompt is taken to cost c times the target's
    k̄   = drafted / I                        the mean draft length
    v   = (verify_ms - ΣF_r - plain·t₁) / I / t₁               one verification, in target steps
    F   = ΣF_r / n / t₁,   N = tokens / n    a request's prefill (in target steps) and length
    α̂   = Σ_i a_i / Σ_i t_i,  t_0 = d_0,  t_i = a_{i-1} · d_i / d_{i-1}          (`estimate_alpha`)

α̂ is the maximum-likelihood α of the i.i.d. model (t_i counts the times position i was reached: drafted with
every earlier position accepted); with a constant K it is accepted / (accepted + rejections). It is not the
acceptance rate: under the model, acceptance_rate = α(1 - α^K) / (K(1 - α)) < α.

    orchestration efficiency   = speedup / S_predicted

is the share of the speed-up that the engines' measured work allows which the whole path (client, Triton, BLS
round trips, detokenization, bookkeeping) keeps.

The bound and the tuning use the fixed-K cells only.

Tuning (`tune`): the best K of each concurrency is the K with the largest speedup (K = 0 counts, at 1.0; ties go
to the smaller K). The deployment's `default_num_draft_tokens` is the best K of the lowest concurrency;
`max_speculative_concurrency` is the highest concurrency at which speculation still wins when K = 0 wins at
the highest measured concurrency (1 when it wins at none), else 0 (no limit). The cost model for the adaptive controller comes from the
lowest concurrency: `draft_cost_ratio` = c over its K > 0 cells, and `verify_cost_fixed` = v0 and
`verify_cost_per_token` = b of the least-squares line v = 1 + v0 + b·k̄ through its K > 0 cells (verifying k
draft tokens costs 1 + v0 + b·k target steps; `fit_verify_cost`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import random
import re
import shlex
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from trtspec import __version__
from trtspec.errors import TrtspecError

BUILTIN = "builtin:"
PROMPT_SETS = ("chat", "code-edit", "summarize")
RANDOM = "random"  # made from the deployment's tokenizer, not shipped
BLS_MODEL = "tensorrt_llm_bls"


class BenchError(TrtspecError):
    """A benchmark that cannot run: bad options, unreadable prompts, an unreachable deployment."""


# ---- prompts ------------------------------------------------------------------------------------------------

def builtin_prompt_path(name: str) -> Path:
    """The JSONL file of a prompt set shipped with trtspec (trtspec/data/prompts/NAME.jsonl)."""
    if name not in PROMPT_SETS:
        raise BenchError(f"unknown prompt set '{BUILTIN}{name}'; choose one of "
                         + ", ".join(BUILTIN + n for n in (*PROMPT_SETS, RANDOM)) + ", or give a JSONL file")
    return Path(str(resources.files("trtspec") / "data" / "prompts" / f"{name}.jsonl"))


def load_prompt_set(source: str, tokenizer_dir: str | os.PathLike | None = None) -> list[str]:
    """Prompts from `builtin:NAME` or a file: JSONL with {"prompt": ...} per line, or one prompt per line.
    `builtin:random` is made from the tokenizer in `tokenizer_dir` (see random_token_prompts)."""
    from trtspec.validate import ValidationError, load_prompts

    if source == BUILTIN + RANDOM:
        if tokenizer_dir is None:
            raise BenchError(f"{BUILTIN}{RANDOM} draws its prompts from a tokenizer's vocabulary: give --tokenizer "
                             "(e.g. the target engine dir)")
        return random_token_prompts(_load_tokenizer(tokenizer_dir))
    path = builtin_prompt_path(source[len(BUILTIN):]) if source.startswith(BUILTIN) else Path(source)
    try:
        return load_prompts(path)
    except ValidationError as exc:
        raise BenchError(str(exc)) from exc


def random_token_prompts(tokenizer, count: int = 16, length: int = 32, seed: int = 0) -> list[str]:
    """`count` prompts of `length` tokens drawn uniformly from the tokenizer's ordinary tokens (no special tokens,
    none that decode to a broken character), with a fixed seed: the adversarial case for any draft, whose text
    neither a draft model nor prompt lookup can predict."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    pieces = tokenizer.batch_decode([[i] for i in ids])
    usable = [i for i, piece in zip(ids, pieces) if piece.strip() and "\ufffd" not in piece]
    rng = random.Random(seed)
    return [tokenizer.decode([rng.choice(usable) for _ in range(length)]) for _ in range(count)]


def _load_tokenizer(tokenizer_dir: str | os.PathLike):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot load a tokenizer from {tokenizer_dir}: {exc}") from exc


class Prompts:
    """The texts a run sends: raw prompts, optionally as the user turn of a chat template, optionally numbered.

    `text(i, number)`: prompt i, starting with "#number " when numbering is on (see the module doc), inside the
    tokenizer's chat template when one was given. The BLS tokenizes text as given, so the template is applied
    here, client side, with the target's tokenizer (`trtspec build` copies it into the target engine dir)."""

    def __init__(self, texts: Sequence[str], *, tokenizer_dir: str | os.PathLike | None = None, numbered: bool = True):
        if not texts:
            raise BenchError("no prompts to send")
        self.texts = list(texts)
        self.numbered = numbered
        self.tokenizer = None
        if tokenizer_dir is not None:
            self.tokenizer = _load_tokenizer(tokenizer_dir)
            if not getattr(self.tokenizer, "chat_template", None):
                raise BenchError(f"the tokenizer in {tokenizer_dir} has no chat template; leave --tokenizer out to "
                                 "send the prompts as they are")

    def __len__(self) -> int:
        return len(self.texts)

    def text(self, index: int, number: int | None = None) -> str:
        content = self.texts[index]
        if self.numbered and number is not None:
            content = f"#{number} {content}"
        if self.tokenizer is None:
            return content
        return self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                  add_generation_prompt=True)


def parse_int_list(text: str, option: str, *, minimum: int) -> list[int]:
    """"1,4,8" -> [1, 4, 8]: integers >= minimum, unique, sorted."""
    values: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            value = int(part)
        except ValueError:
            raise BenchError(f"{option}: '{part}' is not an integer (give e.g. 1,4,8)") from None
        if value < minimum:
            raise BenchError(f"{option}: {value} is below {minimum}")
        values.add(value)
    if not values:
        raise BenchError(f"{option}: give at least one value")
    return sorted(values)


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
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "mean": sum(values) / len(values) if values else None, "n": len(values)}


def expected_tokens_per_iteration(alpha: float, k: int) -> float:
    """Leviathan et al. Eq. 1: E = (1 - α^(K+1)) / (1 - α) = Σ_{i=0..K} α^i (K + 1 when α = 1)."""
    return sum(alpha ** i for i in range(k + 1))


def leviathan_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al. Thm 3.8: S = (1 - α^(K+1)) / ((1 - α)(K·c + 1)), verification costing one target step."""
    return expected_tokens_per_iteration(alpha, k) / (k * c + 1.0)


def decode_speedup(alpha: float, k: int, draft_cost: float, verify_cost: float) -> float:
    """S = E(α, K) / (d + v): d and v, the measured draft and verify costs of one iteration in target steps."""
    return expected_tokens_per_iteration(alpha, k) / (draft_cost + verify_cost)


def predicted_speedup(alpha: float, k: int, *, c: float, mean_draft_length: float, verify_cost: float,
                      prefill: float, tokens: float) -> float:
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
        slope = (sum((k - mean_k) * (y - mean_y) for k, y in points)
                 / sum((k - mean_k) ** 2 for k, _ in points))
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
    accepted: int = 0
    drafted: int = 0
    iterations: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> times speculation was switched off
    finish_reason: str | None = None
    first_ms: float | None = None   # the prefill probe of this prompt (same round and concurrency)
    started_s: float | None = None  # when its block started, in seconds since the run started
    error: str | None = None


def record_from_completion(completion, *, concurrency: int, k: int, round: int, prompt: int, streamed: bool,
                           adaptive: bool = False) -> RequestRecord:
    """A RequestRecord from a client Completion (trtspec.client)."""
    intervals: list[float] = []
    if streamed:
        with_tokens = [c for c in completion.chunks if c.token_ids]
        for before, chunk in zip(with_tokens, with_tokens[1:]):
            gap = chunk.seconds - before.seconds
            intervals += [gap / len(chunk.token_ids)] * len(chunk.token_ids)
    return RequestRecord(
        concurrency=concurrency, k=k, round=round, prompt=prompt, adaptive=adaptive, tokens=len(completion.token_ids),
        seconds=completion.seconds, ttft=completion.time_to_first_token if streamed else None, intervals=intervals,
        accepted=completion.accepted or 0, drafted=completion.drafted or 0, iterations=completion.iterations or 0,
        draft_ms=completion.draft_ms or 0.0, verify_ms=completion.verify_ms or 0.0,
        accepted_per_position=list(completion.accepted_per_position),
        drafted_per_position=list(completion.drafted_per_position), fallbacks=dict(completion.fallbacks),
        finish_reason=completion.finish_reason)


def _sum_positions(rows: Iterable[Sequence[int]]) -> list[int]:
    total: list[int] = []
    for row in rows:
        if len(row) > len(total):
            total += [0] * (len(row) - len(total))
        for i, v in enumerate(row):
            total[i] += v
    return total


def summarize_cell(records: Sequence[RequestRecord], wall_seconds: float, *, concurrency: int, k: int,
                   adaptive: bool = False) -> dict:
    """The figures of one cell from its requests and the summed wall time of its blocks (formulas: module doc)."""
    ok = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in ok)
    accepted, drafted = sum(r.accepted for r in ok), sum(r.drafted for r in ok)
    iterations = sum(r.iterations for r in ok)
    draft_ms, verify_ms = sum(r.draft_ms for r in ok), sum(r.verify_ms for r in ok)
    e2e_ms = sum(r.seconds for r in ok) * 1e3
    acc_pos = _sum_positions(r.accepted_per_position for r in ok)
    drafted_pos = _sum_positions(r.drafted_per_position for r in ok)
    speculative = drafted_pos[0] if drafted_pos else 0
    plain = iterations - speculative
    ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    fallbacks: dict[str, int] = {}
    for r in ok:
        for reason, n in r.fallbacks.items():
            fallbacks[reason] = fallbacks.get(reason, 0) + n
    return {
        "concurrency": concurrency, "k": k, "adaptive": adaptive,
        "requests": len(ok), "errors": len(records) - len(ok),
        "error_messages": sorted({r.error for r in records if r.error})[:5],
        "tokens": tokens, "wall_s": wall_seconds,
        "ttft_ms": distribution(ttfts) if ttfts else None,
        "itl_ms": distribution([x * 1e3 for r in ok for x in r.intervals]) if ttfts else None,
        "e2e_ms": distribution([r.seconds * 1e3 for r in ok]),
        "tokens_per_s": distribution([r.tokens / r.seconds for r in ok if r.seconds > 0]),
        "tokens_per_s_aggregate": tokens / wall_seconds if wall_seconds > 0 else None,
        "accepted": accepted, "drafted": drafted, "iterations": iterations, "speculative_iterations": speculative,
        "fallbacks": fallbacks, "requests_with_fallback": sum(bool(r.fallbacks) for r in ok),
        "acceptance_rate": _ratio(accepted, drafted),
        "accepted_per_iteration": _ratio(accepted, speculative),
        "tokens_per_iteration": _ratio(tokens - plain, speculative),
        "mean_draft_length": _ratio(drafted, speculative),
        "accepted_per_position": acc_pos, "drafted_per_position": drafted_pos,
        "position_acceptance": [a / d if d else None for a, d in zip(acc_pos, drafted_pos)],
        "alpha": estimate_alpha(acc_pos, drafted_pos),
        "draft_ms": draft_ms, "verify_ms": verify_ms,
        "first_iteration_ms": sum(r.first_ms for r in ok if r.first_ms is not None),
        "first_iteration_measured": sum(r.first_ms is not None for r in ok),
        "time_split": {"draft": _ratio(draft_ms, e2e_ms), "verify": _ratio(verify_ms, e2e_ms),
                       "other": _ratio(e2e_ms - draft_ms - verify_ms, e2e_ms)} if e2e_ms > 0 else None,
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
        cell["ttft_ratio"] = _ratio((cell.get("ttft_ms") or {}).get("p50"), ((base or {}).get("ttft_ms") or {}).get("p50"))
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
    c = cell["draft_ms"] / (first + step_ms * cell["drafted"])
    kbar = cell["drafted"] / spec
    v = (cell["verify_ms"] - first - plain_after_first * step_ms) / spec / step_ms
    prefill, tokens = first / n / step_ms, cell["tokens"] / n
    predicted = predicted_speedup(alpha, k, c=c, mean_draft_length=kbar, verify_cost=v, prefill=prefill, tokens=tokens)
    return {
        "target_step_ms": step_ms, "alpha": alpha, "draft_cost_ratio": c, "mean_draft_length": kbar,
        "verify_cost": v, "prefill_steps": prefill, "expected_tokens_per_iteration": expected_tokens_per_iteration(alpha, k),
        "measured_tokens_per_iteration": cell["tokens_per_iteration"],
        "leviathan_speedup": leviathan_speedup(alpha, k, c),
        "decode_speedup": decode_speedup(alpha, k, kbar * c, v),
        "predicted_speedup": predicted, "achieved_speedup": cell["speedup"],
        "efficiency": _ratio(cell["speedup"], predicted),
    }


def tune(cells: Sequence[dict]) -> dict:
    """Best K per concurrency, the deployment defaults they imply, and the cost model (module doc); from the cells
    with a fixed K only."""
    cells = [c for c in cells if not c.get("adaptive")]
    concurrencies = sorted({c["concurrency"] for c in cells})
    best = {}
    for conc in concurrencies:
        row = {c["k"]: c["speedup"] for c in cells if c["concurrency"] == conc and (c["requests"] or c["k"] == 0)}
        best[conc] = best_k(row)
    lowest = concurrencies[0] if concurrencies else None
    low = [c for c in cells if c["concurrency"] == lowest and c["k"] > 0 and c.get("bound")]
    draft_ms = sum(c["draft_ms"] for c in low)
    draft_steps = sum(c["draft_ms"] / c["bound"]["draft_cost_ratio"] for c in low if c["bound"]["draft_cost_ratio"])
    verify = fit_verify_cost((c["bound"]["mean_draft_length"], c["bound"]["verify_cost"]) for c in low)
    return {
        "best_k": {str(c): k for c, k in best.items()},
        "default_num_draft_tokens": best.get(lowest) if lowest is not None else None,
        "max_speculative_concurrency": speculation_limit(best),
        "from_concurrency": lowest,
        "draft_cost_ratio": draft_ms / draft_steps if draft_steps else None,
        "verify_cost_fixed": verify[0] if verify else None,
        "verify_cost_per_token": verify[1] if verify else None,
    }


# ---- the run ------------------------------------------------------------------------------------------------

PROBE = -1  # the K of a prefill probe block (K = 0, max_tokens = 1)


DRAFT_LENGTHS = ("fixed", "adaptive", "both")


def variants(ks: Sequence[int], draft_length: str = "fixed") -> list[tuple[int, bool]]:
    """The (K, adaptive) cells of each concurrency: K = 0 once, and each K > 0 with a fixed draft length, with the
    deployment's adaptive draft length bounded by K, or both."""
    if draft_length not in DRAFT_LENGTHS:
        raise BenchError(f"--draft-length must be one of {', '.join(DRAFT_LENGTHS)}, got '{draft_length}'")
    modes = {"fixed": (False,), "adaptive": (True,), "both": (False, True)}[draft_length]
    return [(k, adaptive) for k in sorted(set(ks)) for adaptive in ((False,) if k == 0 else modes)]


@dataclass(frozen=True)
class Block:
    """`concurrency` requests of cell (concurrency, k, adaptive) sent at once, with these prompts (indices);
    k = PROBE: the round's prefill probes of those prompts."""

    round: int
    concurrency: int
    k: int
    prompts: tuple[int, ...]
    adaptive: bool = False


def schedule(concurrencies: Sequence[int], cells: Sequence[tuple[int, bool]], requests: int, num_prompts: int,
             seed: int = 0, *, probes: bool = True) -> list[Block]:
    """The interleaved plan: round r holds one block of every (K, adaptive) cell of each concurrency C that has
    more than r rounds (ceil(requests / C) rounds, so each cell gets `requests` rounded up to a multiple of C)
    and, with `probes`, a prefill probe block per concurrency, in an order shuffled with `seed` + r. Within a
    round every cell of a concurrency gets the same prompts."""
    rounds = {c: max(1, math.ceil(requests / c)) for c in concurrencies}
    blocks = []
    for r in range(max(rounds.values(), default=0)):
        this_round = []
        for c in concurrencies:
            if r >= rounds[c]:
                continue
            prompts = tuple((r * c + j) % num_prompts for j in range(c))
            this_round += [Block(r, c, k, prompts, adaptive) for k, adaptive in cells]
            this_round += [Block(r, c, PROBE, prompts)] if probes else []
        random.Random(seed + r).shuffle(this_round)
        blocks += this_round
    return blocks


@dataclass
class BenchSettings:
    url: str | None
    protocol: str = "http"
    model: str = BLS_MODEL
    prompts_source: str = BUILTIN + "chat"
    tokenizer: str | None = None
    concurrencies: tuple[int, ...] = (1, 4, 8)
    ks: tuple[int, ...] = (0, 2, 4, 6, 8)
    draft_length: str = "fixed"       # K > 0 cells: "fixed" K, "adaptive" with K as its bound, or "both"
    max_tokens: int = 64
    requests: int = 8
    stream: bool = False
    speculation: str | None = None    # the draft source of K > 0 cells; None: the deployment's default
    numbered: bool = True
    seed: int = 0
    timeout: float = 600.0
    warmup: bool = True


class _Clients:
    """One SpecClient per concurrent slot, made on first use and closed at the end."""

    def __init__(self, settings: BenchSettings):
        self.settings = settings
        self._clients: list = []

    def get(self, i: int):
        from trtspec.client import SpecClient

        while len(self._clients) <= i:
            s = self.settings
            self._clients.append(SpecClient(s.url, protocol=s.protocol, model=s.model, timeout=s.timeout))
        return self._clients[i]

    def close(self) -> None:
        for client in self._clients:
            client.close()


class _Numbers:
    """A thread-safe counter: each request's own prompt number. It starts at a random number, so that a run does not
    find the prompts of an earlier run on the same server in its prefix cache either."""

    def __init__(self, start: int | None = None):
        self._next = random.SystemRandom().randrange(10_000, 100_000) * 100 if start is None else start
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            self._next += 1
            return self._next


def run_block(clients: _Clients, block: Block, prompts: Prompts, settings: BenchSettings, *, numbers: _Numbers,
              request_fields: Mapping[str, object] | None = None,
              on_done: Callable[[RequestRecord], None] | None = None) -> tuple[list[RequestRecord], float]:
    """Send the block's requests at once (one thread and client each); return their records and the wall time."""
    from trtspec.client import ClientError

    probe = block.k == PROBE
    k = 0 if probe else block.k
    texts = [prompts.text(i, numbers.take()) for i in block.prompts]  # made before the clock starts
    fields = dict(request_fields or {})
    if "adaptive_draft_length" in fields:
        fields["adaptive_draft_length"] = block.adaptive
    if k > 0 and settings.speculation:
        fields["speculation"] = settings.speculation
    stream = settings.stream and not probe

    def one(slot: int) -> RequestRecord:
        index = block.prompts[slot]
        try:
            completion = clients.get(slot).generate(
                texts[slot], max_tokens=1 if probe else settings.max_tokens, num_draft_tokens=k, stream=stream,
                return_perf_metrics=True, **fields)
            rec = record_from_completion(completion, concurrency=block.concurrency, k=block.k, round=block.round,
                                         prompt=index, streamed=stream, adaptive=block.adaptive)
        except ClientError as exc:
            rec = RequestRecord(block.concurrency, block.k, block.round, index, block.adaptive, error=str(exc))
        if on_done is not None:
            on_done(rec)
        return rec

    for slot in range(block.concurrency):
        clients.get(slot)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=block.concurrency, thread_name_prefix="bench") as pool:
        records = list(pool.map(one, range(block.concurrency)))
    return records, time.perf_counter() - start


def deployment_info(client) -> dict:
    """What the deployment says about itself: the BLS's inputs and parameters, the server's version (best effort)."""
    from trtspec.client import ClientError

    info: dict = {}
    try:
        config = client.model_config(client.model)
        info["inputs"] = [i.get("name") for i in config.get("input", [])]
        info["parameters"] = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()
                              if k != "tokenizer_dir"}
    except (ClientError, AttributeError) as exc:
        info["config_error"] = str(exc)
    try:
        meta = client._triton().get_server_metadata(**({"as_json": True} if client.protocol == "grpc" else {}))
        info["server"] = {"name": meta.get("name"), "version": meta.get("version")}
    except Exception as exc:  # metadata is a nicety: a server that refuses it still gets measured
        info["server_error"] = str(exc)
    return info


def environment() -> dict:
    import numpy

    env = {
        "trtspec": __version__, "python": platform.python_version(), "platform": platform.platform(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "numpy": numpy.__version__,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        from importlib.metadata import version

        env["tritonclient"] = version("tritonclient")
    except Exception:  # not installed from a distribution: leave it out
        pass
    if hasattr(os, "getloadavg"):
        env["load_average_start"] = list(os.getloadavg())
    return env


def finish_environment(env: dict, started: float) -> dict:
    """`environment()` completed at the end of a run that began at time.perf_counter() `started`."""
    if hasattr(os, "getloadavg"):
        env["load_average_end"] = list(os.getloadavg())
    env["seconds"] = time.perf_counter() - started
    return env


def run_bench(settings: BenchSettings, prompts: Prompts, *, progress=None, command: Sequence[str] | None = None) -> dict:
    """Measure every cell, interleaved (see `schedule`), and return the report (a JSON-able dict).

    `progress`: a rich Progress (or None); a task on it advances by one per finished request."""
    if 0 not in settings.ks:
        raise BenchError("the draft lengths must include 0, the target-only baseline")
    env = environment()
    clients = _Clients(settings)
    numbers = _Numbers()
    cell_kinds = variants(settings.ks, settings.draft_length)
    blocks = schedule(settings.concurrencies, cell_kinds, settings.requests, len(prompts), settings.seed)
    keys = [(c, k, adaptive) for c in settings.concurrencies for k, adaptive in cell_kinds]
    records: dict[tuple[int, int, bool], list[RequestRecord]] = {key: [] for key in keys}
    walls: dict[tuple[int, int, bool], float] = {key: 0.0 for key in keys}
    probes: dict[tuple[int, int, int], float] = {}  # (concurrency, round, prompt) -> first-iteration ms
    started = time.perf_counter()
    try:
        info = deployment_info(clients.get(0))
        inputs = info.get("inputs") or []
        if settings.speculation and inputs and "speculation" not in inputs:
            raise BenchError(f"{settings.model} has no `speculation` input: this deployment cannot choose the draft source")
        # Each cell says whether K is fixed or the bound of an adaptive draft length; a deployment without that
        # input (NVIDIA's BLS) always keeps K fixed.
        adaptive_input = "adaptive_draft_length" in inputs
        if not adaptive_input and inputs and any(adaptive for _, adaptive in cell_kinds):
            raise BenchError(f"{settings.model} has no `adaptive_draft_length` input: measure it with --draft-length fixed")
        fields = {"adaptive_draft_length": False} if adaptive_input else {}
        if settings.warmup:  # the first requests of a fresh server pay for its warm-up: keep them out
            for k, adaptive in cell_kinds:
                block = Block(-1, 1, k, (0,), adaptive)
                recs, _ = run_block(clients, block, prompts, dataclasses.replace(settings, max_tokens=min(settings.max_tokens, 8)),
                                    numbers=numbers, request_fields=fields)
                if recs[0].error:
                    raise BenchError(f"warm-up request of cell {cell_label(k, adaptive)} failed: {recs[0].error}")
        total = sum(b.concurrency for b in blocks)
        task = progress.add_task("measuring", total=total) if progress is not None else None
        lock = threading.Lock()

        def done(_rec: RequestRecord) -> None:
            if progress is not None:
                with lock:
                    progress.advance(task)

        for block in blocks:
            if progress is not None:
                what = "prefill probes" if block.k == PROBE else f"K={block.k}"
                progress.update(task, description=f"round {block.round + 1}: C={block.concurrency} {what}")
            block_start = time.perf_counter() - started
            recs, wall = run_block(clients, block, prompts, settings, numbers=numbers, request_fields=fields, on_done=done)
            for rec in recs:
                rec.started_s = block_start
            if block.k == PROBE:
                probes.update({(r.concurrency, r.round, r.prompt): r.verify_ms for r in recs if r.error is None})
                continue
            records[(block.concurrency, block.k, block.adaptive)] += recs
            walls[(block.concurrency, block.k, block.adaptive)] += wall
    finally:
        clients.close()
    for recs in records.values():
        for r in recs:
            r.first_ms = probes.get((r.concurrency, r.round, r.prompt))
    finish_environment(env, started)
    cells = analyse([summarize_cell(records[key], walls[key], concurrency=key[0], k=key[1], adaptive=key[2])
                     for key in keys])
    for cell in cells:
        cell["request_records"] = [_record_json(r) for r in records[(cell["concurrency"], cell["k"], cell["adaptive"])]]
    s = settings
    return {
        "command": shlex.join(command) if command else None,
        "settings": {"url": s.url, "protocol": s.protocol, "model": s.model, "prompts": s.prompts_source,
                     "num_prompts": len(prompts), "chat_template_from": s.tokenizer, "numbered_prompts": s.numbered,
                     "concurrency": list(s.concurrencies), "num_draft_tokens": list(s.ks), "max_tokens": s.max_tokens,
                     "draft_length": s.draft_length, "requests": s.requests, "stream": s.stream,
                     "speculation": s.speculation, "seed": s.seed,
                     "order": "interleaved rounds with prefill probes (trtspec.bench.schedule)"},
        "environment": env,
        "deployment": info,
        "cells": cells,
        "tuning": tune(cells),
    }


def _record_json(r: RequestRecord) -> dict:
    d = asdict(r)
    intervals = d.pop("intervals")
    d["itl_ms_mean"] = sum(intervals) / len(intervals) * 1e3 if intervals else None
    for key in ("concurrency", "k", "adaptive"):
        d.pop(key)
    return d


def table_console():
    """A rich console for a report's wide tables: the terminal itself, or 132 columns when the output goes to a
    file or a pipe (where rich would wrap them at 80)."""
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=max(out.width, 132))


def write_report(report: dict, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


# ---- output -------------------------------------------------------------------------------------------------

def _fmt(value, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _p(dist: dict | None, key: str, spec: str = ".0f") -> str:
    return _fmt((dist or {}).get(key), spec)


def cell_label(k: int, adaptive: bool = False) -> str:
    """How a cell's K reads in tables: "4", or "≤4 adaptive" for the adaptive draft length bounded by 4."""
    return f"≤{k} adaptive" if adaptive else str(k)


def _fallback_text(cell: dict) -> str:
    reasons = cell.get("fallbacks") or {}
    if not reasons:
        return "-"
    return f"{cell['requests_with_fallback']}/{cell['requests']} req: " + ", ".join(
        f"{reason} {n}" for reason, n in sorted(reasons.items()))


def render(report: dict, console) -> None:
    """The report's tables on a rich console: latency and throughput, speculation, the bound, tuning."""
    from rich.table import Table

    s = report["settings"]
    cells = sorted(report["cells"], key=lambda c: (c["concurrency"], c["k"], c.get("adaptive", False)))
    title = (f"{s['num_prompts']} prompts ({s['prompts']}), {s['max_tokens']} tokens, "
             f"{'streamed' if s['stream'] else 'not streamed'}, {s['protocol']}")
    perf = Table(title=f"latency and throughput: {title}")
    for col in ("C", "K", "req", "TTFT ms p50/p99", "TTFT vs K=0", "ITL ms p50/p99", "e2e ms p50/p90/p99",
                "tok/s req p50", "tok/s all", "speedup"):
        perf.add_column(col, justify="right")
    spec = Table(title="speculation (per speculative iteration)")
    for col in ("C", "K", "accept", "α", "accepted/iter", "tokens/iter", "draft/verify/other", "accepted by position",
                "fell back to plain"):
        spec.add_column(col, justify="right")
    model = Table(title="the bound, fixed K: E = (1-α^(K+1))/(1-α) (Leviathan et al.)")
    for col in ("C", "K", "E", "c", "verify", "S Leviathan", "S predicted", "S achieved", "efficiency"):
        model.add_column(col, justify="right")
    last = None
    for c in cells:
        if last is not None and c["concurrency"] != last:
            for table in (perf, spec, model):
                table.add_section()
        last = c["concurrency"]
        req = f"{c['requests']}" + (f" [red]({c['errors']} failed)[/]" if c["errors"] else "")
        speed = _fmt(c["speedup"], ".2f", "x") if c["k"] else "1.00x"
        label = cell_label(c["k"], c.get("adaptive", False))
        perf.add_row(str(c["concurrency"]), label, req,
                     f"{_p(c['ttft_ms'], 'p50')}/{_p(c['ttft_ms'], 'p99')}",
                     _fmt(c.get("ttft_ratio"), ".2f", "x") if c["k"] else "-",
                     f"{_p(c['itl_ms'], 'p50')}/{_p(c['itl_ms'], 'p99')}",
                     f"{_p(c['e2e_ms'], 'p50')}/{_p(c['e2e_ms'], 'p90')}/{_p(c['e2e_ms'], 'p99')}",
                     _p(c["tokens_per_s"], "p50", ".1f"), _fmt(c["tokens_per_s_aggregate"]), speed)
        split = c.get("time_split") or {}
        split_text = "/".join(_fmt(split.get(x), ".0%") for x in ("draft", "verify", "other"))
        positions = " ".join(_fmt(p, ".0%") for p in c["position_acceptance"][:8])
        spec.add_row(str(c["concurrency"]), label, _fmt(c["acceptance_rate"], ".0%"), _fmt(c["alpha"], ".2f"),
                     _fmt(c["accepted_per_iteration"], ".2f"), _fmt(c["tokens_per_iteration"], ".2f"), split_text,
                     positions or "-", _fallback_text(c))
        if c["k"] and not c.get("adaptive"):
            b = c.get("bound") or {}
            model.add_row(str(c["concurrency"]), label, _fmt(b.get("expected_tokens_per_iteration"), ".2f"),
                          _fmt(b.get("draft_cost_ratio"), ".2f"), _fmt(b.get("verify_cost"), ".2f"),
                          _fmt(b.get("leviathan_speedup"), ".2f", "x"), _fmt(b.get("predicted_speedup"), ".2f", "x"),
                          speed, _fmt(b.get("efficiency"), ".0%"))
    console.print(perf)
    console.print(spec)
    console.print(model)
    console.print("α: per-token acceptance (i.i.d. model). c: one draft step / one target step; verify: one verification "
                  "/ one target step (a target step: one decoding step at K=0, same concurrency). S Leviathan = E/(K·c+1); "
                  "S predicted: end to end from α, c, verify and the measured prefill; efficiency = achieved / predicted.",
                  style="dim", highlight=False)
    t = report["tuning"]
    tuning = Table(title="tuning", show_header=False)
    tuning.add_column(justify="left")
    tuning.add_column(justify="left")
    tuning.add_row("best K", ", ".join(f"C={c}: K={_fmt(k, 'd')}" for c, k in t["best_k"].items()))
    tuning.add_row("default_num_draft_tokens", _fmt(t["default_num_draft_tokens"], "d"))
    limit = t["max_speculative_concurrency"]
    tuning.add_row("max_speculative_concurrency", f"{limit}" + (" (no limit)" if limit == 0 else ""))
    tuning.add_row("draft_cost_ratio", _fmt(t["draft_cost_ratio"], ".3f"))
    tuning.add_row("verify_cost_fixed", _fmt(t.get("verify_cost_fixed"), ".3f"))
    tuning.add_row("verify_cost_per_token", _fmt(t["verify_cost_per_token"], ".3f"))
    console.print(tuning)


def write_plot(report: dict, path: str | os.PathLike) -> Path:
    """PNG: speedup vs K per concurrency (achieved, and predicted dashed), and acceptance per draft position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for conc in sorted({c["concurrency"] for c in cells}):
        row = sorted((c for c in cells if c["concurrency"] == conc and not c.get("adaptive")), key=lambda c: c["k"])
        ks = [c["k"] for c in row if c["speedup"] is not None]
        line, = left.plot(ks, [c["speedup"] for c in row if c["speedup"] is not None], marker="o", label=f"C={conc}")
        adaptive = [(c["k"], c["speedup"]) for c in cells
                    if c["concurrency"] == conc and c.get("adaptive") and c["speedup"] is not None]
        if adaptive:  # the adaptive draft length at its bound K, as separate points
            left.plot(*zip(*sorted(adaptive)), linestyle="none", marker="D", color=line.get_color(),
                      label=f"C={conc} adaptive (≤K)")
        predicted = [(c["k"], c["bound"]["predicted_speedup"]) for c in row if c.get("bound")]
        if predicted:
            left.plot(*zip((0, 1.0), *predicted), linestyle="--", marker="x", color=line.get_color(), alpha=0.6,
                      label=f"C={conc} predicted")
        for c in (c for c in cells if c["concurrency"] == conc):
            if c["k"] > 0 and c["position_acceptance"]:
                right.plot(range(1, len(c["position_acceptance"]) + 1),
                           [p if p is not None else float("nan") for p in c["position_acceptance"]],
                           marker=".", label=f"C={conc} K={cell_label(c['k'], c.get('adaptive', False))}")
    left.axhline(1.0, color="grey", linewidth=0.8)
    left.set_xticks(sorted({c["k"] for c in cells}))
    right.xaxis.get_major_locator().set_params(integer=True)
    left.set(xlabel="draft tokens K", ylabel="speedup vs K=0 (output tokens/s)", title="speedup")
    left.legend(fontsize=8)
    right.set(xlabel="draft position", ylabel="accepted / drafted", title="acceptance by draft position", ylim=(0, 1.05))
    if right.lines:
        right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- applying the tuning to a deployed repository -----------------------------------------------------------

_PARAM = r'\{\s*key\s*:\s*"%s"\s*value\s*:?\s*\{\s*string_value\s*:\s*"((?:[^"\\]|\\.)*)"\s*\}\s*\}'
_ANY_PARAM_LINE = re.compile(r'^\s*parameters\s*:?\s*\{\s*key\s*:.*$', re.MULTILINE)


@dataclass(frozen=True)
class Change:
    parameter: str
    old: str | None   # None: the parameter was not there
    new: str


def set_parameters(text: str, values: Mapping[str, str]) -> tuple[str, list[Change]]:
    """A config.pbtxt's text with the string parameters `values` set: an existing entry's value is replaced in
    place, a missing one is added after the last `parameters` line (or at the end). Returns (text, changes)."""
    changes = []
    for name, value in values.items():
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        pattern = re.compile(_PARAM % re.escape(name))
        match = pattern.search(text)
        if match:
            old = match.group(1)
            if old != escaped:
                text = text[:match.start(1)] + escaped + text[match.end(1):]
                changes.append(Change(name, old, value))
            continue
        line = f'parameters: {{ key: "{name}" value: {{ string_value: "{escaped}" }} }}'
        last = None
        for last in _ANY_PARAM_LINE.finditer(text):
            pass
        if last is not None:
            text = text[:last.end()] + "\n" + line + text[last.end():]
        else:
            text = text.rstrip("\n") + "\n" + line + "\n"
        changes.append(Change(name, None, value))
    return text, changes


def tuned_values(tuning: Mapping, max_draft_len: int | None = None) -> dict[str, str]:
    """The BLS parameters to write from a report's tuning (those it could measure)."""
    values = {}
    k = tuning.get("default_num_draft_tokens")
    if k is not None:
        values["default_num_draft_tokens"] = str(min(k, max_draft_len) if max_draft_len else k)
    values["max_speculative_concurrency"] = str(int(tuning.get("max_speculative_concurrency") or 0))
    for name in ("draft_cost_ratio", "verify_cost_fixed", "verify_cost_per_token"):
        if tuning.get(name) is not None:
            values[name] = f"{tuning[name]:.4g}"
    return values


@dataclass
class Applied:
    changes: list[Change]
    problems: list          # the repository's problems that were there before the edit (the edit added none)


def apply_tuning(repo: str | os.PathLike, tuning: Mapping) -> Applied:
    """Write the tuning into a deployed repository's BLS config.pbtxt, in place, and check the repository.

    The file is replaced atomically. If the parsed config does not hold the new values, or the edited repository
    has a problem (trtspec.repository.validate_repository) it did not have before, the old file is put back and
    BenchError says why. A running server keeps its loaded config until it is restarted or the model reloaded."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from trtspec.repository import validate_repository

    path = Path(repo) / BLS_MODEL / "config.pbtxt"
    if not path.is_file():
        raise BenchError(f"{path} does not exist: --apply takes a model repository written by `trtspec deploy`")
    old_text = path.read_text()
    try:
        parsed = text_format.Parse(old_text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise BenchError(f"{path} does not parse as a Triton model config: {exc}") from exc
    longest = parsed.parameters["max_draft_len"].string_value if "max_draft_len" in parsed.parameters else ""
    values = tuned_values(tuning, int(longest) if longest.isdigit() else None)
    new_text, changes = set_parameters(old_text, values)
    before = {str(p) for p in validate_repository(repo)}
    if not changes:
        return Applied([], sorted(before))
    _write_atomic(path, new_text)
    try:
        check = text_format.Parse(new_text, model_config_pb2.ModelConfig())
        wrong = [n for n, v in values.items() if check.parameters[n].string_value != v]
        if wrong:
            raise BenchError(f"the edited {path} does not hold the new value of {', '.join(wrong)}")
        after = [p for p in validate_repository(repo) if str(p) not in before]
        if after:
            raise BenchError(f"the edited repository {repo} does not validate; it was left as it was:\n"
                             + "\n".join(f"  - {p}" for p in after))
    except BaseException:
        _write_atomic(path, old_text)
        raise
    return Applied(changes, sorted(before))


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def command_line(ctx) -> list[str]:
    """The command as given: `trtspec`, the subcommand and each option that did not come from its default (click context)."""
    from click.core import ParameterSource

    names, node = [], ctx
    while node.parent is not None:  # the root's own name depends on how the program was started
        names.insert(0, node.info_name)
        node = node.parent
    words = ["trtspec", *names]
    for param in ctx.command.params:
        if ctx.get_parameter_source(param.name) in (ParameterSource.DEFAULT, None) or not param.opts:
            continue
        value = ctx.params[param.name]
        if getattr(param, "is_flag", False):
            words.append(param.opts[0] if value else (param.secondary_opts or [param.opts[0]])[0])
        else:
            words += [param.opts[0], str(value)]
    return words
