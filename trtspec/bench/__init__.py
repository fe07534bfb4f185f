"""`trtspec bench`: latency, throughput, acceptance and the speculative bound of a deployment, per (concurrency, K).

The parts: prompts.py (what is sent), run.py (the interleaved schedule and the clients that send it), cells.py
(per-request records and per-cell statistics), arithmetic.py (the bound, the cost fits: pure functions), tuning.py
(the best K, the limit, the costs, and `--apply`), report.py (tables, JSON, the plot).

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
    tokens_per_iteration       (accepted + I) / I   tokens per verification: its accepted draft tokens and the
                               target's own (a plain call, which may decode a stretch of tokens, is not one)
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
the highest measured concurrency (1 when it wins at none), else 0 (no limit). The cost model for the adaptive
controller comes from the
lowest concurrency: `draft_cost_ratio` = c over its K > 0 cells, and `verify_cost_fixed` = v0 and
`verify_cost_per_token` = b of the least-squares line v = 1 + v0 + b·k̄ through its K > 0 cells (verifying k
draft tokens costs 1 + v0 + b·k target steps; `fit_verify_cost`).
"""

from __future__ import annotations

from trtspec.bench.arithmetic import (
    best_k,
    decode_speedup,
    distribution,
    estimate_alpha,
    expected_tokens_per_iteration,
    fit_verify_cost,
    leviathan_speedup,
    percentile,
    predicted_speedup,
    speculation_limit,
)
from trtspec.bench.cells import RequestRecord, analyse, bound, record_from_completion, summarize_cell, target_step_ms
from trtspec.bench.prompts import (
    BUILTIN,
    PROMPT_SETS,
    RANDOM,
    Prompts,
    builtin_prompt_path,
    load_prompt_set,
    parse_int_list,
    random_token_prompts,
)
from trtspec.bench.report import (
    cell_label,
    render,
    render_summary,
    summary_rows,
    table_console,
    write_plot,
    write_report,
)
from trtspec.bench.run import (
    BLS_MODEL,
    DRAFT_LENGTHS,
    PROBE,
    BenchSettings,
    Block,
    command_line,
    deployment_info,
    environment,
    finish_environment,
    request_options,
    run_bench,
    run_block,
    schedule,
    variants,
)
from trtspec.bench.tuning import Applied, Change, apply_tuning, set_parameters, tune, tuned_values
from trtspec.errors import BenchError

__all__ = [
    "Applied",
    "BLS_MODEL",
    "BUILTIN",
    "BenchError",
    "BenchSettings",
    "Block",
    "Change",
    "DRAFT_LENGTHS",
    "PROBE",
    "PROMPT_SETS",
    "Prompts",
    "RANDOM",
    "RequestRecord",
    "analyse",
    "apply_tuning",
    "best_k",
    "bound",
    "builtin_prompt_path",
    "cell_label",
    "command_line",
    "decode_speedup",
    "deployment_info",
    "distribution",
    "environment",
    "estimate_alpha",
    "expected_tokens_per_iteration",
    "finish_environment",
    "fit_verify_cost",
    "leviathan_speedup",
    "load_prompt_set",
    "parse_int_list",
    "percentile",
    "predicted_speedup",
    "random_token_prompts",
    "record_from_completion",
    "render",
    "render_summary",
    "request_options",
    "run_bench",
    "run_block",
    "schedule",
    "set_parameters",
    "speculation_limit",
    "summarize_cell",
    "summary_rows",
    "table_console",
    "target_step_ms",
    "tune",
    "tuned_values",
    "variants",
    "write_plot",
    "write_report",
]
