"""`trtspec bench`: the report's arithmetic on synthetic measurements, the prompt sets, and one small run against
the real tritonserver with tiny models."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from rich.console import Console

from trtspec import bench as b

# ---- percentiles and the bound -------------------------------------------------------------------------------


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_is_numpys_linear_interpolation(q):
    values = [random.Random(q).uniform(0, 100) for _ in range(37)]
    assert b.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_distribution_of_nothing_and_of_one_value():
    assert b.distribution([]) == {"p50": None, "p90": None, "p99": None, "mean": None, "n": 0}
    assert b.distribution([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0, "mean": 7.0, "n": 1}
    assert b.distribution([1, 2, 3, 4])["p50"] == 2.5


@pytest.mark.parametrize(
    "alpha, k, c, tokens, speedup",
    [
        # worked values of Leviathan et al.'s formulas (reference table, §2.1)
        (0.6, 4, 0.05, 2.31, 1.92),
        (0.8, 4, 0.05, 3.36, 2.80),
        (0.8, 5, 0.10, 3.69, 2.46),
        (0.9, 7, 0.05, 5.70, 4.22),
    ],
)
def test_leviathan_expectation_and_speedup(alpha, k, c, tokens, speedup):
    assert b.expected_tokens_per_iteration(alpha, k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))
    assert b.expected_tokens_per_iteration(alpha, k) == pytest.approx(tokens, abs=0.005)
    assert b.leviathan_speedup(alpha, k, c) == pytest.approx(speedup, abs=0.005)


def test_expectation_at_full_acceptance_is_k_plus_one():
    assert b.expected_tokens_per_iteration(1.0, 4) == 5.0
    assert b.expected_tokens_per_iteration(0.0, 4) == 1.0


def test_predicted_speedup_is_the_ratio_of_model_work():
    # prefill 5 steps, 10 tokens, E = 3 (α = 1, K = 2), c = 0.5, verify 1.2 steps:
    # target only 5 + 9 = 14 steps; speculative 5·1.5 + 9·(2·0.5 + 1.2)/3 = 14.1 steps
    s = b.predicted_speedup(1.0, 2, c=0.5, mean_draft_length=2, verify_cost=1.2, prefill=5, tokens=10)
    assert s == pytest.approx(14 / 14.1)
    # without prefill and with free verification the decode-phase formula of Leviathan et al. remains
    assert b.predicted_speedup(
        0.8, 4, c=0.05, mean_draft_length=4, verify_cost=1.0, prefill=0, tokens=1e9
    ) == pytest.approx(b.leviathan_speedup(0.8, 4, 0.05), rel=1e-6)


def _simulate(alpha: float, k: int, iterations: int, seed: int = 0) -> tuple[list[int], list[int], int, int]:
    """Per-position counts of `iterations` drafts of k tokens, each accepted i.i.d. with probability alpha."""
    rng = random.Random(seed)
    acc, dra = [0] * k, [0] * k
    accepted = rejections = 0
    for _ in range(iterations):
        n = 0
        while n < k and rng.random() < alpha:
            n += 1
        rejections += n < k
        accepted += n
        for i in range(k):
            dra[i] += 1
            acc[i] += i < n
    return acc, dra, accepted, rejections


def test_alpha_estimate_is_accepted_over_accepted_plus_rejections():
    acc, dra, accepted, rejections = _simulate(0.7, 4, 500, seed=1)
    assert b.estimate_alpha(acc, dra) == pytest.approx(accepted / (accepted + rejections))


def test_alpha_estimate_recovers_alpha_where_the_acceptance_rate_does_not():
    acc, dra, _, _ = _simulate(0.7, 6, 20000, seed=2)
    assert b.estimate_alpha(acc, dra) == pytest.approx(0.7, abs=0.01)
    rate = sum(acc) / sum(dra)
    assert rate == pytest.approx(0.7 * (1 - 0.7**6) / (6 * 0.3), abs=0.01)  # the rate is lower than α


def test_alpha_estimate_with_shorter_drafts_and_nothing_drafted():
    # 10 iterations of K = 2 all accepted, plus 10 of K = 1 all accepted: α = 1
    assert b.estimate_alpha([20, 10], [20, 10]) == pytest.approx(1.0)
    assert b.estimate_alpha([], []) is None
    assert b.estimate_alpha([0], [0]) is None


def test_verify_cost_fit():
    assert b.fit_verify_cost([(2, 1.2), (4, 1.4)]) == pytest.approx((0.0, 0.1))
    assert b.fit_verify_cost([(2, 1.9), (4, 2.1), (8, 2.5)]) == pytest.approx((0.7, 0.1))  # a CPU: any pass costs more
    assert b.fit_verify_cost([(2, 1.2)]) == pytest.approx((0.0, 0.1))  # one k: through v0 = 0
    assert b.fit_verify_cost([(2, 2.0), (4, 1.8)]) == pytest.approx((0.9, 0.0))  # falling: flat at the mean
    assert b.fit_verify_cost([(1, 1.0), (4, 2.5)]) == pytest.approx((0.0, 6 / 17))  # v0 < 0: through 0
    assert b.fit_verify_cost([(2, 0.8)]) == (0.0, 0.0)  # never negative
    assert b.fit_verify_cost([]) is None


def test_best_k_and_the_speculation_limit():
    assert b.best_k({0: None, 2: 1.3, 4: 1.5, 6: 1.5}) == 4  # ties go to the smaller K
    assert b.best_k({0: None, 2: 0.8, 4: 0.9}) == 0  # K = 0 counts as 1.0
    assert b.best_k({0: None, 2: None}) == 0
    assert b.speculation_limit({1: 4, 4: 2, 8: 0}) == 4  # spec wins up to 4, loses at 8
    assert b.speculation_limit({1: 4, 4: 2, 8: 2}) == 0  # wins at the highest: no limit
    assert b.speculation_limit({1: 0, 4: 0}) == 1  # wins nowhere: only a request alone
    assert b.speculation_limit({1: 2, 4: 0, 8: 2}) == 0


# ---- cells from synthetic measurements ---------------------------------------------------------------------


def _record(
    k,
    prompt,
    *,
    tokens,
    seconds,
    verify_ms,
    draft_ms=0.0,
    accepted=0,
    drafted=0,
    iterations=1,
    first_ms=50.0,
    positions=None,
    ttft=None,
    intervals=(),
):
    return b.RequestRecord(
        concurrency=1,
        k=k,
        round=prompt,
        prompt=prompt,
        tokens=tokens,
        seconds=seconds,
        ttft=ttft,
        intervals=list(intervals),
        accepted_draft_tokens=accepted,
        draft_tokens=drafted,
        iterations=iterations,
        draft_ms=draft_ms,
        verify_ms=verify_ms,
        accepted_per_position=list(positions or []),
        drafted_per_position=list(positions or []),
        first_ms=first_ms,
    )


def _synthetic_cells():
    """C = 1: target step 10 ms, prefill 50 ms, 10 tokens a request. K = 2: every draft accepted (α = 1, E = 3), a
    first plain iteration then 3 speculative ones; c = 0.5, verification 1.2 steps."""
    base = [
        _record(0, p, tokens=10, seconds=0.15, verify_ms=50 + 9 * 10, ttft=0.05, intervals=[0.01] * 9) for p in range(2)
    ]
    spec = [
        _record(
            2,
            p,
            tokens=10,
            seconds=0.12,
            verify_ms=50 + 3 * 12,
            draft_ms=0.5 * (50 + 10 * 6),
            accepted=6,
            drafted=6,
            iterations=4,
            positions=[3, 3],
        )
        for p in range(2)
    ]
    cells = [b.summarize_cell(base, 0.30, concurrency=1, k=0), b.summarize_cell(spec, 0.24, concurrency=1, k=2)]
    return b.analyse(cells)


def test_cell_figures():
    base, spec = _synthetic_cells()
    assert base["tokens"] == 20 and base["tokens_per_s_aggregate"] == pytest.approx(20 / 0.30)
    assert base["e2e_ms"]["p50"] == pytest.approx(150.0)
    assert base["ttft_ms"]["p50"] == pytest.approx(50.0) and base["itl_ms"]["p99"] == pytest.approx(10.0)
    assert b.target_step_ms(base) == pytest.approx(10.0)
    assert spec["acceptance_rate"] == 1.0 and spec["alpha"] == 1.0
    assert spec["speculative_iterations"] == 6 and spec["accepted_per_iteration"] == 2.0
    assert spec["tokens_per_iteration"] == 3.0  # (12 accepted + 6 verifications) / 6
    assert spec["position_acceptance"] == [1.0, 1.0]
    assert spec["ttft_ms"] is None and spec["itl_ms"] is None  # not streamed
    assert spec["time_split"]["draft"] == pytest.approx(110 / 240)


def test_speedup_bound_and_efficiency():
    _, spec = _synthetic_cells()
    assert spec["speedup"] == pytest.approx(1.25)  # 0.30 s vs 0.24 s for the same tokens
    bound = spec["bound"]
    assert bound["target_step_ms"] == pytest.approx(10.0)
    assert bound["draft_cost_ratio"] == pytest.approx(0.5)
    assert bound["verify_cost"] == pytest.approx(1.2)
    assert bound["prefill_steps"] == pytest.approx(5.0)
    assert bound["expected_tokens_per_iteration"] == pytest.approx(3.0)
    assert bound["leviathan_speedup"] == pytest.approx(3 / 2)
    assert bound["decode_speedup"] == pytest.approx(3 / 2.2)
    assert bound["predicted_speedup"] == pytest.approx(140 / 141)  # model work: 140 ms target only, 55 + 86 ms
    assert bound["efficiency"] == pytest.approx(1.25 / (140 / 141))


def test_tuning_from_cells():
    cells = _synthetic_cells()
    tuning = b.tune(cells)
    assert tuning["best_k"] == {"1": 2} and tuning["default_num_draft_tokens"] == 2
    assert tuning["max_speculative_concurrency"] == 0
    assert tuning["draft_cost_ratio"] == pytest.approx(0.5)
    assert tuning["verify_cost_per_token"] == pytest.approx(0.1)  # v = 1.2 at k = 2 (one k: v0 = 0)
    assert tuning["verify_cost_fixed"] == 0.0
    assert b.tuned_values(tuning, max_draft_len=8) == {
        "default_num_draft_tokens": "2",
        "max_speculative_concurrency": "0",
        "draft_cost_ratio": "0.5",
        "verify_cost_fixed": "0",
        "verify_cost_per_token": "0.1",
    }


def test_adaptive_cells_compare_ttft_and_count_fallbacks():
    base = [_record(0, p, tokens=10, seconds=0.15, verify_ms=140, ttft=0.050) for p in range(2)]
    adaptive = [
        _record(
            4,
            p,
            tokens=10,
            seconds=0.16,
            verify_ms=150,
            draft_ms=5,
            accepted=0,
            drafted=2,
            iterations=4,
            positions=[1, 1],
            ttft=0.055,
        )
        for p in range(2)
    ]
    adaptive[0].fallbacks = {"low_acceptance": 2}
    adaptive[1].fallbacks = {"low_acceptance": 1, "load": 1}
    base_cell, cell = b.analyse(
        [
            b.summarize_cell(base, 0.30, concurrency=1, k=0),
            b.summarize_cell(adaptive, 0.32, concurrency=1, k=4, adaptive=True),
        ]
    )
    assert cell["adaptive"] and cell["ttft_ratio"] == pytest.approx(1.1) and base_cell["ttft_ratio"] == 1.0
    assert cell["fallbacks"] == {"low_acceptance": 3, "load": 1} and cell["requests_with_fallback"] == 2
    assert cell["bound"] is None and cell["speedup"] == pytest.approx(0.30 / 0.32)
    assert b.tune([base_cell, cell])["best_k"] == {"1": 0}  # tuning reads fixed-K cells only


def test_summary_row_and_why_it_paid():
    cells = _synthetic_cells()
    report = {"cells": cells, "settings": {"speculation": "draft_model"}}
    (row,) = b.summary_rows(report, "chat", identical={1: True})
    assert b.summary_rows(report, "chat", identical={4: True})[0]["identical"] is None  # checked at another concurrency
    assert row["workload"] == "chat" and row["concurrency"] == 1 and row["k"] == 2 and row["identical"] is True
    assert row["target_only_tokens_per_s"] == pytest.approx(20 / 0.30) and row["speedup"] == pytest.approx(1.25)
    assert row["acceptance"] == 1.0 and row["tokens_per_verification"] == 3.0
    assert row["bound"] == pytest.approx(140 / 141)
    # 6 of 8 calls drafted (each request's first is the prefill); a call: 1.2 steps to verify + 2 x 0.5 to draft
    assert row["why"] == (
        "C=1, K=2: 6 of 8 target calls verified drafts; 100% of drafted tokens accepted gave 3.00 "
        "tokens per verification, and each cost 2.20 target steps (1.20 to verify, 1.00 to draft), so it "
        "paid: 1.25x of a bound of 0.99x."
    )
    # a cell where the deployment decoded plainly says so, and why, in words
    plain = dict(cells[1], speedup=0.99, draft_tokens=0, fallbacks={"load": 2}, iterations=4)
    why = b.summary_rows({"cells": [cells[0], plain], "settings": {}}, "x")[0]["why"]
    assert why == (
        "C=1, K=2: the deployment decoded plainly (4 target calls, none verified a draft): more requests were in "
        "flight than the deployment's speculation limit (max_speculative_concurrency); 0.99x."
    )
    calibrated = dict(plain, fallbacks={"calibration": 4})
    why = b.summary_rows({"cells": [cells[0], calibrated], "settings": {}}, "x")[0]["why"]
    assert "decoded plainly" in why and "no draft length can pay on this machine's costs measured at start" in why
    nothing = dict(cells[1], speedup=0.8, draft_tokens=0, fallbacks={})
    assert (
        "nothing was there to draft from"
        in b.summary_rows({"cells": [cells[0], nothing], "settings": {}}, "x")[0]["why"]
    )
    console = Console(record=True, width=140)
    b.render_summary([row], console)
    text = console.export_text()
    assert "chat" in text and "draft model" in text and "1.25x" in text and "yes" in text and row["why"][:40] in text


def test_failed_requests_are_counted_not_measured():
    records = [
        _record(0, 0, tokens=10, seconds=0.1, verify_ms=100),
        b.RequestRecord(1, 0, 0, 1, error="tensorrt_llm_bls: max_tokens ..."),
    ]
    cell = b.summarize_cell(records, 0.1, concurrency=1, k=0)
    assert cell["requests"] == 1 and cell["errors"] == 1 and cell["tokens"] == 10
    assert cell["error_messages"] == ["tensorrt_llm_bls: max_tokens ..."]


# ---- the plan -----------------------------------------------------------------------------------------------


def test_schedule_interleaves_every_cell_with_the_same_prompts_per_round():
    blocks = b.schedule([1, 4], b.variants([0, 2, 4]), requests=6, num_prompts=5, seed=3)
    cells = {}
    for block in blocks:
        cells.setdefault((block.concurrency, block.k), []).append(block)
    assert set(cells) == {(c, k) for c in (1, 4) for k in (0, 2, 4, b.PROBE)}
    assert all(len(v) == 6 for (c, _), v in cells.items() if c == 1)  # 6 rounds of one request
    assert all(len(v) == 2 for (c, _), v in cells.items() if c == 4)  # 6 rounded up to 8 = 2 rounds of 4
    for c in (1, 4):
        for r in range(6 if c == 1 else 2):
            prompts = {blk.prompts for blk in blocks if blk.concurrency == c and blk.round == r}
            assert len(prompts) == 1 and len(next(iter(prompts))) == c
    rounds = [blk.round for blk in blocks]
    assert rounds == sorted(rounds)  # a round ends before the next begins
    first_round = [(blk.concurrency, blk.k) for blk in blocks if blk.round == 0]
    assert first_round != sorted(first_round)  # shuffled within the round
    assert blocks == b.schedule([1, 4], b.variants([0, 2, 4]), requests=6, num_prompts=5, seed=3)
    assert b.PROBE not in {blk.k for blk in b.schedule([1], b.variants([0, 2]), 2, 3, probes=False)}
    both = b.schedule([1], b.variants([0, 2], "both"), 1, 1, probes=False)
    assert sorted((blk.k, blk.adaptive) for blk in both) == [(0, False), (2, False), (2, True)]


def test_variants():
    assert b.variants([4, 0, 2]) == [(0, False), (2, False), (4, False)]
    assert b.variants([0, 4], "adaptive") == [(0, False), (4, True)]
    assert b.variants([0, 4], "both") == [(0, False), (4, False), (4, True)]
    with pytest.raises(b.BenchError, match="--draft-length"):
        b.variants([0], "sometimes")
    assert b.cell_label(4, True) == "≤4 adaptive" and b.cell_label(4) == "4"


def test_int_lists():
    assert b.parse_int_list("4, 1,1,8", "--concurrency", minimum=1) == [1, 4, 8]
    with pytest.raises(b.BenchError, match="--concurrency"):
        b.parse_int_list("0", "--concurrency", minimum=1)
    with pytest.raises(b.BenchError, match="not an integer"):
        b.parse_int_list("1,x", "--ks", minimum=0)


# ---- prompts ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", b.PROMPT_SETS)
def test_builtin_prompt_sets(name):
    prompts = b.load_prompt_set(f"builtin:{name}")
    assert 20 <= len(prompts) <= 40
    assert len(set(prompts)) == len(prompts) and all(p.strip() for p in prompts)
    if name == "code-edit":
        for prompt in prompts:
            code = prompt.split("```")[1]
            assert 10 <= len(code.strip("\n").splitlines()) - 1 <= 30, prompt[:60]


def test_prompt_file_and_unknown_set(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "one"}\n\n{"prompt": "two\\nlines"}\n')
    assert b.load_prompt_set(str(path)) == ["one", "two\nlines"]
    (tmp_path / "plain.txt").write_text("first\nsecond\n")
    assert b.load_prompt_set(str(tmp_path / "plain.txt")) == ["first", "second"]
    with pytest.raises(b.BenchError, match="builtin:chat"):
        b.load_prompt_set("builtin:poetry")
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(b.BenchError, match="prompt"):
        b.load_prompt_set(str(tmp_path / "bad.jsonl"))


def test_prompts_numbered_and_templated(tmp_path):
    from support.tiny import make_tokenizer
    from transformers import AutoTokenizer

    plain = b.Prompts(["Why?"], numbered=True)
    assert plain.text(0, 7) == "#7 Why?" and b.Prompts(["Why?"], numbered=False).text(0, 7) == "Why?"
    make_tokenizer(tmp_path / "tok")
    with pytest.raises(b.BenchError, match="no chat template"):
        b.Prompts(["Why?"], tokenizer_dir=tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    tok.save_pretrained(str(tmp_path / "tok"))
    assert b.Prompts(["Why?"], tokenizer_dir=tmp_path / "tok").text(0, 3) == "<user>#3 Why?<assistant>"


def test_random_token_prompts(tmp_path):
    from support.tiny import make_tokenizer
    from transformers import AutoTokenizer

    with pytest.raises(b.BenchError, match="--chat-template"):
        b.load_prompt_set("builtin:random")
    make_tokenizer(tmp_path / "tok")
    prompts = b.load_prompt_set("builtin:random", tmp_path / "tok")
    assert len(prompts) == 16 and len(set(prompts)) == 16
    assert prompts == b.load_prompt_set("builtin:random", tmp_path / "tok")  # a fixed seed: runs compare
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    special = set(tok.all_special_ids)
    for prompt in prompts:
        ids = tok.encode(prompt, add_special_tokens=False)
        assert 16 <= len(ids) <= 48 and not special & set(ids) and "\ufffd" not in prompt


# ---- applying the tuning --------------------------------------------------------------------------------------

CONFIG = """name: "tensorrt_llm_bls"
parameters: { key: "default_num_draft_tokens" value: { string_value: "0" } }
parameters { key: "draft_cost_ratio" value { string_value: "0.3" } }
parameters: { key: "max_draft_len" value: { string_value: "8" } }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


def test_set_parameters_replaces_in_place_and_adds_what_is_missing():
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    text, changes = b.set_parameters(
        CONFIG, {"default_num_draft_tokens": "4", "draft_cost_ratio": "0.3", "max_speculative_concurrency": "4"}
    )
    assert changes == [
        b.Change("default_num_draft_tokens", "0", "4"),
        b.Change("max_speculative_concurrency", None, "4"),
    ]
    lines = text.splitlines()
    assert lines[1].endswith('string_value: "4" } }') and lines[2] == CONFIG.splitlines()[2]
    assert lines[4].startswith('parameters: { key: "max_speculative_concurrency"')  # after the last parameter
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    assert {k: v.string_value for k, v in config.parameters.items()} == {
        "default_num_draft_tokens": "4",
        "draft_cost_ratio": "0.3",
        "max_draft_len": "8",
        "max_speculative_concurrency": "4",
    }
    assert b.set_parameters(text, {"default_num_draft_tokens": "4"}) == (text, [])


# ---- end to end -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bench_server(model_repository, tmp_path_factory):
    """The tiny FP8 pair's repository (a copy, which the test edits) with the BLS and both engines served."""
    from conftest import free_ports

    from trtspec.server import TritonServer

    repo = tmp_path_factory.mktemp("bench") / "model_repository"
    shutil.copytree(model_repository, repo)
    http, grpc, metrics = free_ports(3)
    server = TritonServer(
        repo,
        http_port=http,
        grpc_port=grpc,
        metrics_port=metrics,
        model_control_explicit_models=("tensorrt_llm", "tensorrt_llm_draft", "tensorrt_llm_bls"),
    )
    with server:
        yield server


def test_bench_end_to_end(bench_server, tmp_path):
    from trtspec.cli import cli
    from trtspec.deploy.checks import validate_repository

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": p}) + "\n" for p in ["The quick brown fox", "def add(a, b):", "Triton serves models"]
        )
    )
    report, plot = tmp_path / "report.json", tmp_path / "report.png"
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "--url",
            bench_server.grpc_url,
            "--protocol",
            "grpc",
            "--prompts",
            str(prompts),
            "--concurrency",
            "1,2",
            "--ks",
            "2,9",
            "--draft-length",
            "both",
            "--max-tokens",
            "8",
            "--requests",
            "2",
            "--stream",
            "--output",
            str(report),
            "--plot",
            str(plot),
            "--apply",
            str(bench_server.repo),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "skipping K=9" in result.output and "default_num_draft_tokens" in result.output
    assert "speculative vs target-only" in result.output and "target calls verified drafts" in result.output
    assert "restart" in result.output

    data = json.loads(report.read_text())
    assert {"command", "settings", "environment", "deployment", "cells", "tuning"} <= set(data)
    assert data["command"].startswith("trtspec bench") and data["settings"]["num_draft_tokens"] == [0, 2]
    assert data["settings"]["draft_length"] == "both"
    assert sorted((c["concurrency"], c["k"], c["adaptive"]) for c in data["cells"]) == [
        (1, 0, False),
        (1, 2, False),
        (1, 2, True),
        (2, 0, False),
        (2, 2, False),
        (2, 2, True),
    ]
    for cell in data["cells"]:
        assert cell["requests"] == 2 and cell["errors"] == 0, cell["error_messages"]
        # 2 requests of at most 8 tokens (the tiny random target may end one early with its eos, even at once: a
        # request without tokens has no first token to time)
        assert 2 <= cell["tokens"] <= 16 and 1 <= cell["ttft_ms"]["n"] <= 2 and cell["e2e_ms"]["p99"] > 0
        assert cell["first_iteration_measured"] == 2 and len(cell["request_records"]) == 2
        if cell["k"] == 0:
            assert cell["speedup"] == 1.0 and cell["bound"] is None and cell["draft_tokens"] == 0
            assert cell["ttft_ratio"] == 1.0
        elif cell["adaptive"]:  # the bound's model is for a fixed K
            assert cell["bound"] is None and cell["ttft_ratio"] > 0 and cell["iterations"] > 0
        else:
            assert (
                cell["draft_tokens"] > 0 and 0 <= cell["acceptance_rate"] <= 1 and len(cell["position_acceptance"]) == 2
            )
            bound = cell["bound"]
            assert bound["predicted_speedup"] > 0 and bound["efficiency"] > 0 and bound["draft_cost_ratio"] > 0
    tuning = data["tuning"]
    assert set(tuning["best_k"]) == {"1", "2"} and tuning["default_num_draft_tokens"] in (0, 2)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    config = (bench_server.repo / "tensorrt_llm_bls" / "config.pbtxt").read_text()
    assert (
        f'key: "default_num_draft_tokens" value: {{ string_value: "{tuning["default_num_draft_tokens"]}" }}' in config
    )
    assert 'key: "verify_cost_per_token"' in config
    assert validate_repository(bench_server.repo) == []


@pytest.mark.parametrize("speculation", ["draft_model", "prompt_lookup"])
def test_validate_outputs_with_each_draft_source(bench_server, tmp_path, speculation):
    from trtspec.cli import cli

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ["one two one two one two", "def f(x): return x"])
    )
    result = CliRunner().invoke(
        cli,
        [
            "validate",
            "outputs",
            "--url",
            bench_server.grpc_url,
            "--protocol",
            "grpc",
            "--prompts",
            str(prompts),
            "--ks",
            "2",
            "--max-tokens",
            "8",
            "--speculation",
            speculation,
        ],
    )
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output


# ---- Spec-Bench -------------------------------------------------------------------------------------------------

SPEC_BENCH = [  # Spec-Bench's format (question_id, category, turns), a few short questions per task
    {"question_id": 81, "category": "writing", "turns": ["A haiku on the sea.", "Now in French."]},
    {"question_id": 101, "category": "reasoning", "turns": ["What is three?", "And four?"]},
    {"question_id": 161, "category": "translation", "turns": ["Translate: Guten Morgen."]},
    {"question_id": 162, "category": "translation", "turns": ["Translate: Das Haus."]},
    {"question_id": 241, "category": "summarization", "turns": ["Summarize: the fox ran."]},
    {"question_id": 321, "category": "qa", "turns": ["Who wrote Hamlet?"]},
    {"question_id": 401, "category": "math_reasoning", "turns": ["Tom has 3 apples."]},
    {"question_id": 481, "category": "rag", "turns": ["Triton serves models. Why?"]},
    {"question_id": 482, "category": "rag", "turns": ["Context: " + "very long text " * 400 + "Question: why?"]},
]


def write_spec_bench(path):
    path.write_text("".join(json.dumps(q) + "\n" for q in SPEC_BENCH))
    return path


def test_spec_bench_reader(tmp_path):
    from trtspec.bench import specbench as sb

    questions = sb.load_questions(write_spec_bench(tmp_path / "question.jsonl"))
    assert [q.task for q in questions][:3] == ["multi-turn conversation", "multi-turn conversation", "translation"]
    assert questions[0].text == "A haiku on the sea." and questions[0].id == "81"
    assert {q.task for q in questions} == set(sb.TASKS)
    one_each = sb.select(questions, 1)  # the tasks in turn, the first question of each
    assert [q.id for q in one_each] == ["81", "161", "241", "321", "401", "481"]
    assert [q.id for q in sb.select(questions, None)][:7] == ["81", "161", "241", "321", "401", "481", "101"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(SPEC_BENCH[0]) + "\n" + json.dumps({"question_id": 2, "turns": "not a list"}) + "\n")
    with pytest.raises(b.BenchError, match="line 2: not a Spec-Bench question"):
        sb.load_questions(bad)
    with pytest.raises(b.BenchError, match="question.jsonl"):
        sb.load_questions(tmp_path / "missing.jsonl")


def _bls_requests(server) -> float:
    """The inference requests the server's BLS has answered, from Triton's metrics."""
    from trtspec.client import fetch_metrics

    samples = fetch_metrics(server.metrics_url, "nv_inference_request_success")
    return sum(v for key, v in samples.items() if 'model="tensorrt_llm_bls"' in key)


def test_spec_bench_through_trtspec_bench(bench_server, tmp_path):
    """Every draft source against target-only on each task, greedy outputs compared, the long question skipped;
    each block of questions sent once more first, untimed, to fill the prefix cache for every method alike."""
    from support.tiny import chat_tokenizer

    from trtspec.cli import cli

    questions, report = write_spec_bench(tmp_path / "question.jsonl"), tmp_path / "spec.json"
    tokenizer = chat_tokenizer(bench_server.repo, tmp_path / "tokenizer")
    before = _bls_requests(bench_server)
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "--url",
            bench_server.grpc_url,
            "--protocol",
            "grpc",
            "--prompts",
            f"spec-bench:{questions}",
            "--chat-template",
            str(tokenizer),
            "--concurrency",
            "1,2",
            "--max-tokens",
            "8",
            "--output",
            str(report),
            "--draft-length",
            "fixed",
        ],
    )  # every iteration drafts (the adaptive policy may judge drafting not to pay)
    assert result.exit_code == 0, result.output
    assert "Spec-Bench, C=1" in result.output and "Spec-Bench, C=2" in result.output and "1 skipped" in result.output
    data = json.loads(report.read_text())
    assert data["settings"]["skipped"] == {"rag": 1} and data["settings"]["questions"] == 8
    assert data["settings"]["methods"] == ["none", "draft_model", "prompt_lookup", "auto"]
    assert data["settings"]["adaptive_draft_length"] is False
    for entry in data["summary"]:
        assert entry["errors"] == 0 and entry["requests"] == 8
        assert entry["identical"] == entry["compared"] == 8  # greedy: every method's output is the target's
        assert set(entry["tasks"]) == set(SPEC_BENCH_TASKS) | {"overall"}
        overall = entry["tasks"]["overall"]
        if entry["method"] == "none":
            assert overall["speedup"] == 1.0 and overall["mean_accepted_tokens"] == 1.0
        else:
            assert overall["speedup"] > 0 and overall["mean_accepted_tokens"] >= 1.0
    drafted = {e["method"]: e["sources"] for e in data["summary"] if e["concurrency"] == 1}
    assert set(drafted["draft_model"]) == {"draft_model"} and set(drafted["prompt_lookup"]) <= {"prompt_lookup"}
    assert drafted["auto"]
    assert len(data["requests"]) == 2 * 4 * 8
    assert _bls_requests(bench_server) - before == 2 * (4 + 1) * 8  # each concurrency: 4 methods and the warm-up


SPEC_BENCH_TASKS = ("multi-turn conversation", "translation", "summarization", "qa", "math_reasoning", "rag")


def test_measured_requests_ask_for_perf_metrics_once_where_the_deployment_can():
    # a streamed plain stretch would pay 19 perf tensors a token, a speculative iteration once for all its tokens
    both = ["text_input", "adaptive_draft_length", "final_perf_metrics_only"]
    assert b.request_options(both, adaptive=True) == {"adaptive_draft_length": True, "final_perf_metrics_only": True}
    assert b.request_options(["text_input", "stream"]) == {}  # NVIDIA's BLS: neither input
