"""The calibration table: its cost model at a load, its file, and the watch the BLS reads it through."""

from __future__ import annotations

import os

import pytest

from trtspec.calibration import CALIBRATION_ENV, Calibration, CalibrationError, CalibrationWatch
from trtspec.orchestrator.adaptive import CostModel


def table(**changes) -> Calibration:
    # a machine where a pass's time grows with its rows: plain 10 ms at batch 1, 16 at 2, 28 at 4;
    # a verification costs a plain step plus 2 ms a row at batch 1, more under load; a draft step 3 ms + 1 ms
    fields = dict(
        plain_seconds={1: 0.010, 2: 0.016, 4: 0.028},
        verify_seconds={
            1: {1: 0.012, 2: 0.014, 4: 0.018},
            2: {1: 0.022, 2: 0.028, 4: 0.040},
            4: {1: 0.044, 2: 0.060, 4: 0.092},
        },
        draft_seconds={1: 0.003, 2: 0.006, 4: 0.012},
        round_trip_seconds=0.001,
        machine="m",
        engines="e",
    )
    fields.update(changes)
    return Calibration(**fields)


def test_cost_model_at_a_lone_request_is_fitted_in_plain_steps():
    costs = table().cost_model(1)
    assert isinstance(costs, CostModel)
    # verification + round trip over plain (10 ms): 1.3, 1.5, 1.9 at k = 1, 2, 4: a line 1.1 + 0.2 k
    assert costs.verify_cost_per_token == pytest.approx(0.2)
    assert costs.verify_cost_fixed == pytest.approx(0.1)
    # draft + round trip (4, 7, 13 ms) through the origin in plain steps
    assert costs.draft_cost_ratio == pytest.approx((1 * 0.4 + 2 * 0.7 + 4 * 1.3) / 21)
    assert costs.cost(2) == pytest.approx(1 + 0.1 + 2 * (0.2 + costs.draft_cost_ratio))


def test_verification_costs_more_plain_steps_under_load_and_clamps_beyond_the_table():
    cal = table()
    per_row = [cal.cost_model(load).verify_cost_per_token for load in (1, 2, 3, 4)]
    assert per_row == sorted(per_row) and per_row[0] < per_row[-1]
    assert cal.plain_at(3) == pytest.approx(0.022)  # between batch 2 and 4
    assert cal.cost_model(64) == cal.cost_model(4)  # beyond the engine's batch: the largest measured
    # a load where a verified token costs more than it can earn: no acceptance breaks even
    heavy = table(verify_seconds={1: {1: 0.012, 2: 0.014}, 4: {1: 0.060, 2: 0.095}}, plain_seconds={1: 0.01, 4: 0.028})
    assert heavy.cost_model(1).break_even(2) < 1.0
    assert heavy.cost_model(4).break_even(2) == 1.0


def test_verify_and_draft_beyond_the_measured_k_follow_the_line():
    cal = table()
    assert cal.verify_at(1, 3) == pytest.approx(0.016)
    assert cal.verify_at(1, 6) == pytest.approx(0.022)
    assert cal.draft_at(8) == pytest.approx(0.024)
    assert table(draft_seconds={}).draft_at(3) == 0.0
    assert table(draft_seconds={}).cost_model(1).draft_cost_ratio == 0.0


def test_round_trip_through_json_and_a_file(tmp_path):
    cal = table(measured_at=1234.5, took_seconds=3.25)
    again = Calibration.from_json(cal.to_json())
    assert again == cal
    path = cal.save(tmp_path / "sub" / "calibration.json")
    assert Calibration.load(path) == cal
    assert not (tmp_path / "sub" / "calibration.json.tmp").exists()
    assert cal.matches("e", "m") and not cal.matches("other", "m") and not cal.matches("e", "elsewhere")
    rows = cal.table()
    assert rows[0][:2] == ["batch", "plain ms"] and [r[0] for r in rows[1:]] == ["1", "2", "4"]


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("not json", "not JSON"),
        ('{"format": 99}', "format"),
        ('{"format": 1, "verify_seconds": {"1": {"1": 0.1}}}', "plain_seconds"),
        ('{"format": 1, "plain_seconds": {"1": 0.1}, "verify_seconds": {}}', "verify_seconds"),
        ('{"format": 1, "plain_seconds": {"1": -1}, "verify_seconds": {"1": {"1": 0.1}}}', "plain_seconds[1]"),
        ('{"format": 1, "plain_seconds": {"x": 1}, "verify_seconds": {"1": {"1": 0.1}}}', "ValueError"),
    ],
)
def test_a_bad_file_is_refused_naming_the_field(tmp_path, text, names):
    path = tmp_path / "calibration.json"
    path.write_text(text)
    with pytest.raises(CalibrationError, match=names.replace("[", r"\[").replace("]", r"\]")):
        Calibration.load(path)


def test_the_watch_reads_the_file_the_environment_names_when_it_changes(tmp_path, monkeypatch):
    path = tmp_path / "calibration.json"
    monkeypatch.setenv(CALIBRATION_ENV, str(path))
    watch = CalibrationWatch(interval=0.0)
    assert watch.poll() is None  # no file yet
    table().save(path)
    assert watch.poll() == table()
    assert watch.poll() is None  # unchanged
    changed = table(round_trip_seconds=0.002)
    changed.save(path)
    os.utime(path, ns=(1, 1))  # a new stamp even where the clock's resolution is coarse
    assert watch.poll() == changed
    path.write_text("{broken")
    assert watch.poll() is None and "not JSON" in watch.error
    assert CalibrationWatch(path=None, interval=0.0).path == path
    monkeypatch.delenv(CALIBRATION_ENV)
    assert CalibrationWatch(interval=0.0).poll() is None
