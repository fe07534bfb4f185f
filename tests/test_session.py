"""The request's session without a server: the K precedence rules, the admission and governor caps, the control file's
force, and whole requests run by the session on in-process engines (real tiny models)."""

from __future__ import annotations

import time

import pytest
from support.tiny import make_checkpoint, make_perturbed_copy, write_config

from trtspec import control
from trtspec.calibration import Calibration
from trtspec.contract import SamplingParams
from trtspec.errors import DeadlineExceeded, EngineError, RequestError
from trtspec.orchestrator.adaptive import LOOKUP
from trtspec.orchestrator.loop import SpecRequest, speculate
from trtspec.orchestrator.session import Deployment, Request, draft_length
from trtspec.serving_settings import ServingSettings

BASE = {"tokenizer_dir": "/unused", "max_input_len": "64", "max_seq_len": "128", "max_draft_len": "8"}


def settings(**params) -> ServingSettings:
    return ServingSettings.from_parameters({**BASE, **{k: str(v) for k, v in params.items()}})


class Recorded:
    """The deployment's reports, kept (what the BLS logs and exports)."""

    def __init__(self):
        self.logs, self.changes, self.states, self.even = [], [], {}, {}

    def log(self, level, message):
        self.logs.append((level, message))

    def governed(self, load, old, new, reason, cap):
        self.changes.append((load, old, new, reason, cap))

    def governor_state(self, load, state, cap):
        self.states[load] = (state, cap)

    def break_even(self, loads, acceptance):
        self.even[loads] = acceptance

    def calibrated(self, calibration):
        self.calibration = calibration


def deployment(draft: bool = True, control_file=None, **params) -> Deployment:
    params.setdefault("tensorrt_llm_draft_model_name", "tensorrt_llm_draft" if draft else "")
    return Deployment(
        settings(**params),
        Recorded(),
        draft_name="tensorrt_llm_draft" if draft else None,
        control_file=control_file,
    )


PROMPT = [305, 70, 294, 280, 76, 272, 305, 70, 294]


def request(k: int = 4, method: str = "auto", tokens: int = 40, adaptive: bool = False) -> Request:
    spec = SpecRequest(list(PROMPT), tokens, num_draft_tokens=k, sampling=SamplingParams(), end_id=-1)
    return Request(spec, method, adaptive=adaptive)


# ---- the K precedence rules ----------------------------------------------------------------------------------------
def test_the_request_s_k_comes_first_then_the_method_s_then_the_default():
    s = settings(default_num_draft_tokens=2, speculation_num_draft_tokens=5, tensorrt_llm_draft_model_name="d")
    assert draft_length(s, None, None, has_draft_model=True) == ("draft_model", 2)
    assert draft_length(s, "draft_model", None, has_draft_model=True) == ("draft_model", 5)
    assert draft_length(s, "draft_model", 3, has_draft_model=True) == ("draft_model", 3)
    assert draft_length(s, None, 7, has_draft_model=True) == ("draft_model", 7)
    assert draft_length(s, None, 0, has_draft_model=True) == ("draft_model", 0)


def test_a_deployment_without_a_k_decodes_plainly_as_nvidia_s_bls():
    s = settings()  # default_num_draft_tokens 0, no draft model: default_speculation none
    assert draft_length(s, None, None, has_draft_model=False) == ("none", 0)
    # a named method with no K takes speculation_num_draft_tokens, 4 where the default K is 0
    assert draft_length(s, "auto", None, has_draft_model=False) == ("auto", 4)


def test_prompt_lookup_named_without_k_drafts_up_to_max_draft_len_and_none_drafts_nothing():
    s = settings(default_num_draft_tokens=2)
    assert draft_length(s, "prompt_lookup", None, has_draft_model=False) == ("prompt_lookup", 8)
    assert draft_length(s, "prompt_lookup", 3, has_draft_model=False) == ("prompt_lookup", 3)
    assert draft_length(s, "none", 5, has_draft_model=True) == ("none", 0)


@pytest.mark.parametrize(
    ("method", "k", "draft", "field", "words"),
    [
        (None, 9, True, "num_draft_tokens", "max_draft_len 8, got 9"),
        (None, -1, True, "num_draft_tokens", "between 0 and"),
        ("draft_model", 2, False, "speculation", "no draft model"),
        ("medusa", None, True, "speculation", "must be one of"),
    ],
)
def test_a_k_or_source_the_deployment_cannot_serve_is_refused_naming_the_field(method, k, draft, field, words):
    with pytest.raises(RequestError) as err:
        draft_length(settings(default_num_draft_tokens=2), method, k, has_draft_model=draft)
    assert err.value.field == field and words in str(err.value)


# ---- admission: the load limit and the governor's caps -------------------------------------------------------------
def test_above_max_speculative_concurrency_a_request_decodes_plainly_with_the_reason():
    d = deployment(default_num_draft_tokens=4, max_speculative_concurrency=2)
    assert d.admit(request(4), load=2).k == 4
    admitted = d.admit(request(4), load=3)
    assert admitted.k == 0 and admitted.fallbacks == {"load": 1}


def test_a_rolled_back_range_caps_every_source_and_a_forced_plain_admits_nothing_to_draft():
    d = deployment(default_num_draft_tokens=4)
    assert d.admit(request(4), load=1).cap is None
    d.governor.force("reduced", 60)
    reduced = d.admit(request(4), load=1)
    assert (reduced.k, reduced.cap, reduced.fallbacks) == (2, 2, {"governor": 1})
    assert d.lookup_k(reduced) == 2  # prompt lookup, which costs no draft call, is capped too
    assert d.admit(request(1), load=1).fallbacks == {}  # K already within the cap: no fallback
    d.governor.force("plain", 60)
    plain = d.admit(request(4), load=4)
    assert plain.k == 0 and plain.cap == 0 and not plain.probe


def test_a_plain_range_admits_one_request_in_probe_every_as_a_probe_at_the_reduced_length():
    d = deployment(default_num_draft_tokens=4)
    gov = d.governor.at(1)
    gov.judged = 2  # judged plain (as after low acceptance); no force, so it probes
    admitted = [d.admit(request(4), load=1) for _ in range(gov.probe_every)]
    probes = [a for a in admitted if a.probe]
    assert len(probes) == 1 and probes[0].k == gov.reduced_k
    assert all(a.k == 0 for a in admitted if not a.probe)


def test_the_control_file_s_force_reaches_admission_and_its_release_restores_it(tmp_path):
    path = tmp_path / "control.json"
    d = deployment(default_num_draft_tokens=4, control_file=str(path))
    d.control.interval = 0.0
    control.write(path, control.Force("plain", time.time() + 60, "maintenance", "operator"))
    assert d.admit(request(4), load=1).k == 0
    assert any("forced to plain" in message and "maintenance" in message for _, message in d.events.logs)
    assert d.events.changes[-1][2:4] == ("plain", "operator")
    control.write(path, None)
    time.sleep(0.01)  # a new stamp for the file's absence
    assert d.admit(request(4), load=1).k == 4


def test_the_deployment_reports_its_ranges_and_break_even_from_the_start():
    d = deployment(default_num_draft_tokens=4)
    assert d.events.states == {"1": ("speculating", 4)}
    assert 0.0 < d.events.even["1"] < 1.0


# ---- whole requests, run by the session on in-process engines -----------------------------------------------------
@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from trtspec.compile import run_build
    from trtspec.engine.runtime import Engine, InProcessClient

    root = tmp_path_factory.mktemp("session")
    target = make_checkpoint(root / "target", layers=3, seed=0)
    draft = make_perturbed_copy(target, root / "draft", noise=0.01)
    config = write_config(
        root / "build.yaml",
        target,
        draft,
        speculation={"max_draft_len": 8},
        engine={"max_input_len": 64, "max_seq_len": 128},
    )
    out = run_build(config, root / "engines")
    return InProcessClient(Engine.load(out / "target")), InProcessClient(Engine.load(out / "draft"))


def target_only(target, tokens: int = 40) -> list[int]:
    return [t for chunk in speculate(SpecRequest(list(PROMPT), tokens, end_id=-1), target, None) for t in chunk]


@pytest.mark.parametrize("method", ["auto", "draft_model", "prompt_lookup"])
def test_a_session_s_greedy_output_is_the_target_s_and_its_outcome_is_judged(engines, method):
    target, draft = engines
    d = deployment(default_num_draft_tokens=4)
    session = d.start(request(method=method), 1, target=target, draft=lambda: draft)
    tokens = [t for chunk in session.run() for t in chunk]
    session.finish()
    assert tokens == target_only(target)
    assert session.seconds_per_token > 0
    judged = d.governor.at(1).recent
    assert len(judged) == 1 and judged[0].speculative == (session.stats.num_drafts > 0)
    assert judged[0].num_draft_tokens == session.stats.num_draft_tokens
    if method == "prompt_lookup":  # the tiny model's text may repeat nothing: lookup drafts only where it does
        assert set(session.stats.sources) <= {LOOKUP}
    else:
        assert session.stats.num_drafts > 0


def test_a_session_run_beside_a_plain_range_decodes_plainly_after_its_first_token(engines):
    target, draft = engines
    d = deployment(default_num_draft_tokens=4)
    d.governor.at(4).force("plain", 60)  # only the range of 3-4 requests rolled back
    session = d.start(request(method="draft_model"), 1, target=target, draft=lambda: draft, peak_load=lambda: 4)
    tokens = [t for chunk in session.run() for t in chunk]
    assert tokens == target_only(target)
    assert session.stats.num_draft_tokens == 0 and session.stats.fallbacks == {"governor": 1}


def test_a_failure_counts_against_speculation_only_where_it_is_the_server_s(engines):
    target, draft = engines
    d = deployment(default_num_draft_tokens=4)
    for error in (RequestError("max_tokens", "is required"), EngineError("the target failed"), DeadlineExceeded("t")):
        d.start(request(), 1, target=target, draft=lambda: draft).finish(error)
    judged = d.governor.at(1).recent
    assert [o.failed for o in judged] == [True, True]


def test_a_request_that_does_not_draft_never_makes_a_draft_client(engines):
    target, _ = engines
    d = deployment(default_num_draft_tokens=4)

    def no_draft():
        raise AssertionError("a draft client was made for a plain request")

    session = d.start(request(k=0), 1, target=target, draft=no_draft)
    assert session.drafter is None and session.policy is None
    assert [t for chunk in session.run() for t in chunk] == target_only(target)


# ---- decisions for the batch, from the calibrated table ----------------------------------------------------------
def calibration(verify_4: dict[int, float], plain_4: float = 0.02) -> Calibration:
    """A synthetic table: a lone request's verification barely costs more than a plain step (a draft pays); at batch
    4, as `verify_4` says (seconds of a pass where each of 4 requests verifies k)."""
    return Calibration(
        plain_seconds={1: 0.010, 2: 0.012, 4: plain_4},
        verify_seconds={1: {1: 0.012, 4: 0.014}, 2: {1: 0.014, 4: 0.018}, 4: verify_4},
        draft_seconds={1: 0.001, 4: 0.002},
        round_trip_seconds=0.001,
    )


NOTHING_PAYS_AT_4 = {1: 0.05, 4: 0.2}  # a verifying pass of 4 requests costs 2.5-10 plain steps


def test_the_calibration_seeds_every_load_range_and_the_governors_plain_reference():
    d = deployment(default_num_draft_tokens=4)
    table = calibration(NOTHING_PAYS_AT_4)
    d.calibrate(table)
    for load in (1, 2, 4):
        assert d.costs.costs_at(load) == table.cost_model(load)
        assert d.governor.at(load).plain_tpot == table.plain_at(load)
    assert d.governor.at(8).plain_tpot == table.plain_at(4)  # a range made later, past the measured batches
    assert any("calibrated: at load 3-4 no draft pays" in message for _, message in d.events.logs)
    assert d.events.calibration is table  # what the adapter exports (trtspec_calibration_seconds)


def test_a_long_prompt_starts_from_the_costs_calibrated_at_its_length():
    from dataclasses import astuple, replace

    d = deployment(default_num_draft_tokens=4)
    table = replace(
        calibration(NOTHING_PAYS_AT_4),
        short_context_tokens=9,
        context_tokens=109,
        long_plain_seconds=0.012,
        long_verify_seconds={1: 0.016, 4: 0.026},
        long_draft_seconds={1: 0.0015, 4: 0.003},
    )
    d.calibrate(table)
    short, long = request(adaptive=True), request(adaptive=True)
    long.spec.prompt = list(PROMPT) * 12  # 108 tokens
    policies = [d.policy(r, d.admit(r, 1), 1) for r in (short, long)]
    assert astuple(policies[0].costs) == pytest.approx(astuple(table.cost_model(1)))
    assert astuple(policies[1].costs) == pytest.approx(astuple(table.cost_model(1, 108)))
    assert policies[1].step_seconds == pytest.approx(table.plain_at(1, 108))
    assert policies[1].costs.verify_cost_per_token > policies[0].costs.verify_cost_per_token
    assert d.context_cost(1, 9) is None and d.context_cost(1, 108).step_ratio > 1.0


def test_a_load_where_nothing_pays_decodes_plainly_from_the_first_request_and_says_so(engines):
    target, draft = engines
    d = deployment(default_num_draft_tokens=4)
    d.calibrate(calibration(NOTHING_PAYS_AT_4))
    session = d.start(request(method="draft_model", adaptive=True), 4, target=target, draft=lambda: draft)
    tokens = [t for chunk in session.run() for t in chunk]
    assert tokens == target_only(target)
    assert session.stats.num_draft_tokens == 0 and session.stats.fallbacks == {"calibration": 1}
    said = [m for level, m in d.events.logs if "at load 3-4 no draft length can pay" in m]
    d.start(request(method="draft_model", adaptive=True), 4, target=target, draft=lambda: draft)
    assert len(said) == 1 == len([m for _, m in d.events.logs if "at load 3-4 no draft length can pay" in m])
    # a fixed draft length is the client's to ask for: the batch's costs do not overrule it
    assert d.admit(request(method="draft_model"), 4).k == 4


def test_a_load_where_drafting_pays_speculates_from_the_first_request(engines):
    target, draft = engines
    d = deployment(default_num_draft_tokens=4)
    d.calibrate(calibration(NOTHING_PAYS_AT_4))
    session = d.start(request(method="draft_model", adaptive=True), 1, target=target, draft=lambda: draft)
    tokens = [t for chunk in session.run() for t in chunk]
    assert tokens == target_only(target)
    assert session.admission.k == 4 and session.stats.num_draft_tokens > 0
    assert "calibration" not in session.stats.fallbacks


def test_the_batch_s_costs_count_what_a_verification_costs_the_others_in_its_pass():
    d = deployment(default_num_draft_tokens=4)
    d.calibrate(calibration({1: 0.03, 4: 0.06}))  # at batch 4 each verified token adds a sixth of a plain pass
    assert d.shared_cost(1) == (0.0, 0.0)
    fixed, per_token = d.shared_cost(4)
    # the 3 others wait 1/4 of the extra pass each: 3/4 * (0.03 / 0.02 - 1) at k = 1, 3/4 * (0.06 / 0.02 - 1) at 4
    assert per_token == pytest.approx((0.75 * 2.0 - 0.75 * 0.5) / 3) and fixed == pytest.approx(0.0, abs=1e-9)
    alone = d.costs.policy(4, model_drafts=True, load=4)
    batch = d.costs.policy(4, model_drafts=True, load=4, shared=lambda: d.shared_cost(4))
    alone.prior_alpha = batch.prior_alpha = 0.9
    assert alone.decide(100).k > 0  # for itself, drafting pays at this acceptance
    decision = batch.decide(100)  # for the batch it does not: the others lose more than it gains
    assert decision.k == 0 and decision.reason == "low_acceptance"
    # and a lone request's policy, whose pass is its own, still drafts
    assert d.costs.policy(4, model_drafts=True, load=1, shared=lambda: d.shared_cost(1)).decide(100).k > 0
