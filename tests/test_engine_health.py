"""The liveness signal without a server: runs of engine-side failures, the rule that calls an engine dead, and the
reading of the BLS's gauges back from a Prometheus scrape."""

from __future__ import annotations

import time

from trtspec.engine_health import FAILURES, SINCE, EngineHealth, LivenessRule, Run, failing_from_scrape


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_run_counts_failures_since_the_last_answer_and_an_answer_ends_it():
    clock, heard = Clock(), []
    health = EngineHealth(lambda model, run: heard.append((model, run)), clock=clock)
    health.answered("tensorrt_llm")
    assert health.failing("tensorrt_llm") is None
    for _ in range(3):
        clock.now += 5
        health.failed("tensorrt_llm")
    assert health.failing("tensorrt_llm") == Run(3, 1005.0)
    assert health.failing("tensorrt_llm_draft") is None  # each model its own
    clock.now += 1
    health.answered("tensorrt_llm")
    assert health.failing("tensorrt_llm") is None
    assert heard[-1] == ("tensorrt_llm", None) and heard[-2] == ("tensorrt_llm", Run(3, 1005.0))
    clock.now += 1
    health.failed("tensorrt_llm")  # a new run, from this failure
    assert health.failing("tensorrt_llm") == Run(1, clock.now)


def test_an_answer_with_no_run_open_says_nothing():
    heard = []
    health = EngineHealth(lambda model, run: heard.append(run))
    health.answered("m")
    health.answered("m")
    assert heard == []


def test_the_rule_needs_both_enough_failures_and_enough_time_without_an_answer():
    rule = LivenessRule(seconds=60, failures=3)
    assert not rule.dead(None, 10_000)
    assert not rule.dead(Run(2, 0.0), 10_000)  # long ago, but two failures then silence: not proof
    assert not rule.dead(Run(50, 9_950.0), 10_000)  # many, but within the minute
    assert rule.dead(Run(3, 9_940.0), 10_000)
    assert "'tensorrt_llm' has failed every call for 60 s" in rule.describe("tensorrt_llm", Run(3, 9_940.0), 10_000)


def test_runs_are_read_back_from_a_scrape_for_one_bls_only():
    scrape = "\n".join(
        [
            f"# HELP {FAILURES} ...",
            f'{FAILURES}{{engine="tensorrt_llm",model="tensorrt_llm_bls"}} 4',
            f'{SINCE}{{engine="tensorrt_llm",model="tensorrt_llm_bls"}} 1.7952e+09',
            f'{FAILURES}{{engine="tensorrt_llm_draft",model="tensorrt_llm_bls"}} 0',
            f'{SINCE}{{engine="tensorrt_llm_draft",model="tensorrt_llm_bls"}} 0',
            f'{FAILURES}{{engine="tensorrt_llm",model="other_bls"}} 9',
            f'{SINCE}{{engine="tensorrt_llm",model="other_bls"}} 5',
        ]
    )
    assert failing_from_scrape(scrape, "tensorrt_llm_bls") == {"tensorrt_llm": Run(4, 1.7952e9)}
    assert failing_from_scrape(scrape, "other_bls") == {"tensorrt_llm": Run(9, 5.0)}
    assert failing_from_scrape("", "tensorrt_llm_bls") == {}


def test_models_unready_past_the_grace_are_a_reason_to_restart_and_ready_again_clears_it():
    import asyncio

    from trtspec.openai_api.liveness import Liveness

    liveness = Liveness(None, unready_grace=0.05)
    liveness.seen(False)
    assert asyncio.run(liveness.why_dead("tensorrt_llm_bls", "tensorrt_llm", ["'tensorrt_llm'"])) is None
    time.sleep(0.06)
    why = asyncio.run(liveness.why_dead("tensorrt_llm_bls", "tensorrt_llm", ["'tensorrt_llm'"]))
    assert why.startswith("'tensorrt_llm' not ready for more than 0.05 s")
    liveness.seen(True)
    assert asyncio.run(liveness.why_dead("tensorrt_llm_bls", "tensorrt_llm", [])) is None
    # no grace (a front beside a Triton it did not start): unready is never a reason to restart the front
    never = Liveness(None)
    never.seen(False)
    assert asyncio.run(never.why_dead("tensorrt_llm_bls", "tensorrt_llm", ["'tensorrt_llm'"])) is None
