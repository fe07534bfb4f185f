"""The calibration table: its cost model at a load, its file, and the watch the BLS reads it through."""

from __future__ import annotations

import os
import urllib.request

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
    # draft + round trip (4, 7, 13 ms): 0.4, 0.7, 1.3 plain steps at k = 1, 2, 4, a line 0.1 + 0.3 k: a call's fixed
    # part d0 and its cost a token c, so a one-token draft costs 0.4, not the 0.29 a line through the origin gave it
    assert costs.draft_cost_ratio == pytest.approx(0.3)
    assert costs.draft_cost_fixed == pytest.approx(0.1)
    assert costs.cost(1) == pytest.approx(1 + 0.1 + 0.1 + 0.2 + 0.3)
    assert costs.cost(2) == pytest.approx(1 + 0.1 + 0.1 + 2 * (0.2 + 0.3))
    # prompt lookup makes no draft call: neither part
    assert costs.without_draft().cost(2) == pytest.approx(1 + 0.1 + 2 * 0.2)
    # one draft length alone, or draft calls that fall on a line below zero, say nothing of the split: through the
    # origin then
    one = table(draft_seconds={2: 0.006}).cost_model(1)
    assert (one.draft_cost_fixed, one.draft_cost_ratio) == (0.0, pytest.approx(0.35))
    falling = table(draft_seconds={1: 0.001, 2: 0.004, 4: 0.012}, round_trip_seconds=0.0).cost_model(1)
    assert falling.draft_cost_fixed == 0.0
    assert falling.draft_cost_ratio == pytest.approx((1 * 0.1 + 2 * 0.4 + 4 * 1.2) / 21)


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


def with_long_context(**changes) -> Calibration:
    # the table above measured on 48 tokens; at 1048 a plain step takes 12 ms and each verified row 2 ms more than on
    # the short sequence (attention over 1000 more cached tokens), a draft call 0.5 ms a token more
    fields = dict(
        short_context_tokens=48,
        context_tokens=1048,
        long_plain_seconds=0.012,
        long_verify_seconds={1: 0.016, 2: 0.020, 4: 0.028},
        long_draft_seconds={1: 0.0035, 2: 0.007, 4: 0.014},
    )
    return table(**{**fields, **changes})


def test_a_long_sequence_costs_its_request_more_plain_steps_per_verified_token():
    cal = with_long_context()
    assert cal.cost_model(1, 0) == cal.cost_model(1, 48) == table().cost_model(1)  # as short as the table's
    assert cal.plain_at(1, 1048) == pytest.approx(0.012) and cal.plain_at(1, 548) == pytest.approx(0.011)
    long = cal.cost_model(1, 1048)
    # verification + round trip over the long plain step (12 ms): 17, 21, 29 ms at k = 1, 2, 4: 13/12 + 4/12 k
    assert long.verify_cost_per_token == pytest.approx(4 / 12)
    assert long.verify_cost_fixed == pytest.approx(13 / 12 - 1)
    assert long.verify_cost_per_token > table().cost_model(1).verify_cost_per_token
    # linear in the context, beyond the long measurement too (attention grows with it)
    assert cal.plain_at(1, 2048) == pytest.approx(0.014)
    # each verified token: 2 ms on the short sequence and 2 ms per 1000 tokens of context, over a 14 ms step
    assert cal.cost_model(1, 2048).verify_cost_per_token == pytest.approx(6 / 14)
    # under load the request's own rows add the same seconds, the others' rows as measured
    assert cal.cost_model(4, 1048).verify_cost_per_token > cal.cost_model(4).verify_cost_per_token
    # no long measurement: the table as it is at any length
    assert table().cost_model(1, 5000) == table().cost_model(1)


def ordered(cal: Calibration) -> bool:
    """Whether the table keeps the order the work sets (Calibration.monotone)."""
    batches, ks = sorted(cal.plain_seconds), sorted(cal.verify_seconds[min(cal.verify_seconds)])
    plain = [cal.plain_seconds[b] for b in batches]
    rows = [[cal.verify_seconds[b][k] for k in ks] for b in batches]
    drafts = [cal.draft_seconds[k] for k in sorted(cal.draft_seconds)]
    return (
        plain == sorted(plain)
        and drafts == sorted(drafts)
        and all(row == sorted(row) for row in rows)
        and all(list(col) == sorted(col) for col in zip(*rows))
        and all(min(row) >= p for row, p in zip(rows, plain))
    )


def test_a_noisy_table_is_put_in_the_works_order_moving_each_cell_least():
    cal = table()
    assert ordered(cal) and cal.monotone() == cal  # a table already in order is left as it is
    noisy = table(
        plain_seconds={1: 0.012, 2: 0.011, 4: 0.028},  # batch 2 measured faster than batch 1
        verify_seconds={
            1: {1: 0.011, 2: 0.014, 4: 0.013},  # k=1 below the plain step beside it, k=4 below k=2
            2: {1: 0.022, 2: 0.028, 4: 0.040},
            4: {1: 0.020, 2: 0.060, 4: 0.092},  # batch 4 k=1 below batch 2's
        },
        draft_seconds={1: 0.004, 2: 0.003, 4: 0.012},
    )
    fitted = noisy.monotone()
    assert not ordered(noisy) and ordered(fitted)
    # violators pooled to their mean, the rest left as measured
    assert fitted.plain_seconds == pytest.approx({1: 0.0115, 2: 0.0115, 4: 0.028})
    assert fitted.draft_seconds == pytest.approx({1: 0.0035, 2: 0.0035, 4: 0.012})
    assert fitted.verify_seconds[1][2] == fitted.verify_seconds[1][4] == pytest.approx(0.0135)
    assert fitted.verify_seconds[1][1] == pytest.approx(0.0115)  # lifted to the plain step of its batch
    assert fitted.verify_seconds[2][4] == pytest.approx(0.040) and fitted.verify_seconds[4][4] == pytest.approx(0.092)
    assert fitted.verify_seconds[4][1] >= fitted.verify_seconds[2][1] >= 0.0115
    assert fitted.monotone() == fitted
    # a long sequence costs no less than the short one, cell by cell, in the same order along k
    noisy_long = with_long_context(long_plain_seconds=0.009, long_verify_seconds={1: 0.018, 2: 0.016, 4: 0.028})
    fitted = noisy_long.monotone()
    assert fitted.long_plain_seconds == pytest.approx(0.010)  # not below the short plain step
    assert fitted.long_verify_seconds == pytest.approx({1: 0.017, 2: 0.017, 4: 0.028})
    assert fitted.long_draft_seconds == noisy_long.long_draft_seconds


def test_round_trip_through_json_and_a_file(tmp_path):
    cal = table(measured_at=1234.5, took_seconds=3.25)
    again = Calibration.from_json(cal.to_json())
    assert again == cal
    assert Calibration.from_json(with_long_context().to_json()) == with_long_context()
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
        ('{"format": 2, "verify_seconds": {"1": {"1": 0.1}}}', "plain_seconds"),
        ('{"format": 2, "plain_seconds": {"1": 0.1}, "verify_seconds": {}}', "verify_seconds"),
        ('{"format": 2, "plain_seconds": {"1": -1}, "verify_seconds": {"1": {"1": 0.1}}}', "plain_seconds[1]"),
        ('{"format": 2, "plain_seconds": {"x": 1}, "verify_seconds": {"1": {"1": 0.1}}}', "ValueError"),
        (
            '{"format": 2, "plain_seconds": {"1": 0.1}, "verify_seconds": {"1": {"1": 0.1}}, "context_tokens": 40, '
            '"short_context_tokens": 48}',
            "context_tokens",
        ),
        (
            '{"format": 2, "plain_seconds": {"1": 0.1}, "verify_seconds": {"1": {"1": 0.1}}, "context_tokens": 900, '
            '"short_context_tokens": 48, "long_plain_seconds": 0.2, "long_verify_seconds": {"2": 0.3}}',
            "long_verify_seconds",
        ),
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


# ---- measured through a real Triton server --------------------------------------------------------------------


def _wide_pair(root):
    """A target wide enough that a pass's rows cost more than its overhead (the tiny pair's are all overhead), and
    a perturbed copy as its draft."""
    from support.tiny import make_checkpoint, make_perturbed_copy

    target = make_checkpoint(root / "target", layers=2, hidden=1024, heads=8, kv_heads=2, seed=0)
    return target, make_perturbed_copy(target, root / "draft", noise=0.01)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    from support.tiny import served_pair

    # prompts up to 512 tokens: the calibration's long context is 512
    return served_pair(tmp_path_factory.mktemp("calibration") / "wide", pair=_wide_pair, max_input_len=512)


def _serve(repo, *flags) -> tuple:
    """`trtspec serve` in a subprocess until it says Triton is ready; (process, its output so far, HTTP port,
    metrics port)."""
    import subprocess
    import sys
    import threading
    import time

    from conftest import free_ports

    http, grpc, metrics = free_ports(3)
    proc = subprocess.Popen(
        [sys.executable, "-m", "trtspec.cli", "serve", "--repo", str(repo), "--http-port", str(http)]
        + ["--grpc-port", str(grpc), "--metrics-port", str(metrics), "--start-timeout", "840", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=os.environ | {"COLUMNS": "200"},
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    deadline = time.monotonic() + 900
    while not any("Triton is ready" in line for line in lines):
        assert proc.poll() is None, "".join(lines)
        assert time.monotonic() < deadline, "trtspec serve was not ready within 900 s:\n" + "".join(lines)
        time.sleep(0.5)
    return proc, lines, http, metrics


def _stop(proc) -> None:
    import signal
    import subprocess

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.server
def test_serve_measures_the_engines_before_it_is_ready_stores_and_reuses_it(wide):
    from trtspec.bench.calibrate import calibration_path, from_repository
    from trtspec.client import SpecClient

    repo = wide.repo
    proc, lines, http, metrics = _serve(repo)
    try:
        path = calibration_path(repo)
        cal = Calibration.load(path)  # stored before "Triton is ready" was printed
        text = "".join(lines)
        assert "engine costs on this machine" in text and f"stored in {path}" in text
        assert "at 512 tokens (batch 1)" in " ".join(text.split())
        # the BLS reads the file the server named to it (TRTSPEC_CALIBRATION_FILE) at its next request, and exports it
        with SpecClient(f"127.0.0.1:{http}", model="tensorrt_llm_bls") as client:
            client.generate("The quick brown fox", max_tokens=2)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=30) as resp:
            exported = resp.read().decode()
        plain = [line for line in exported.splitlines() if line.startswith("trtspec_calibration_seconds{")]
        one = next(line for line in plain if 'kind="plain"' in line and 'batch="1"' in line)
        assert float(one.split()[-1]) == pytest.approx(cal.plain_seconds[1], rel=1e-3)
        assert sum('kind="verify"' in line for line in plain) == sum(len(ks) for ks in cal.verify_seconds.values())
    finally:
        _stop(proc)
    # every batch of the engine (1, 2, 4, ...) and draft lengths 1, 2, 4 (max_draft_len 4), each a duration
    target = from_repository(repo)
    batches, top = target.batches(), target.max_batch
    assert target.draft_lengths() == [1, 2, 4] and batches[:3] == [1, 2, 4] and batches[-1] == top
    assert sorted(cal.plain_seconds) == batches and sorted(cal.verify_seconds) == batches
    assert all(sorted(ks) == [1, 2, 4] for ks in cal.verify_seconds.values())
    assert sorted(cal.draft_seconds) == [1, 2, 4] and cal.round_trip_seconds > 0
    assert all(0 < s < 10 for name, s in cal.durations() if name != "round_trip_seconds")
    assert cal.matches(target.engines) and cal.took_seconds > 0
    # and at batch 1 on a 512-token prompt, every k and draft length, each no cheaper than on the short one
    assert (cal.short_context_tokens, cal.context_tokens) == (48, 512) == (48, target.long_context())
    assert sorted(cal.long_verify_seconds) == sorted(cal.long_draft_seconds) == [1, 2, 4]
    assert cal.long_plain_seconds >= cal.plain_seconds[1]
    assert all(cal.long_verify_seconds[k] >= cal.verify_seconds[1][k] for k in (1, 2, 4))
    # monotone where the work differs tenfold: a pass of 5 rows for each of the largest batch costs more than one
    # of 2 rows, and a pass's time grows with its rows over the whole table (a line fitted through every cell: noise
    # moves the points, not the slope's sign)
    assert cal.verify_seconds[top][4] > cal.verify_seconds[1][1]
    assert ordered(cal)  # as stored: fitted to the work's order (Calibration.monotone)
    cells = [(b * (k + 1), s) for b, ks in cal.verify_seconds.items() for k, s in ks.items()]
    mean_rows = sum(r for r, _ in cells) / len(cells)
    mean_s = sum(s for _, s in cells) / len(cells)
    assert sum((r - mean_rows) * (s - mean_s) for r, s in cells) > 0
    # the cost model at each load is what the BLS starts from: finite, non-negative, verification dearer under load
    for load in (1, 2, 4, 8):
        costs = cal.cost_model(load)
        assert min(costs.draft_cost_ratio, costs.verify_cost_fixed, costs.verify_cost_per_token) >= 0
    # --no-calibrate: the stored one, measured on these engines on this machine, is reused and printed
    proc, lines, _, _ = _serve(repo, "--no-calibrate")
    try:
        assert "calibration: reused" in "".join(lines) and Calibration.load(calibration_path(repo)) == cal
    finally:
        _stop(proc)


@pytest.mark.server
def test_calibration_on_the_tensorrtllm_standin(tmp_path):
    """The same measurement through the strict stand-in of TensorRT-LLM's backend (a batch of rows in one decoupled
    request, perf outputs as the backend writes them)."""
    from rich.console import Console
    from support.standin_repo import write_standin_repository
    from support.tiny import served_pair

    from trtspec.bench.calibrate import calibration_path, from_repository, measure, refresh

    def write(config, engines, repo, overrides):
        return write_standin_repository(config, engines, repo, overrides=overrides)

    server = served_pair(tmp_path / "standin", write=write, max_input_len=256)  # a 256-token long context
    with server:
        cal, skipped = measure(server.grpc_url, server.inference_headers, from_repository(server.repo))
        # past its time budget it keeps the batches measured whole (batch 1 always) and names what it left out
        quick, left_out = measure(server.grpc_url, server.inference_headers, from_repository(server.repo), budget_s=0)
        assert sorted(quick.plain_seconds) == [1] and sorted(quick.verify_seconds[1]) == [1, 2, 4]
        assert left_out == ["batch 2 and above (past the 0 s budget)", "the 256-token context (past the 0 s budget)"]
        assert quick.cost_model(4) == quick.cost_model(1) and quick.context_tokens == 0
        # `trtspec bench --apply REPO` measures again into the file the deployment's BLS reads
        console = Console(record=True, width=200)
        refreshed = refresh(server.repo, server.grpc_url, "grpc", console)
    assert refreshed is not None and Calibration.load(calibration_path(server.repo)) == refreshed
    assert "engine costs on this machine" in console.export_text()
    assert skipped == [] and sorted(cal.plain_seconds) == from_repository(server.repo).batches()
    assert sorted(cal.draft_seconds) == [1, 2, 4] and ordered(cal)
    assert cal.context_tokens == 256 and sorted(cal.long_verify_seconds) == [1, 2, 4]
    assert all(s > 0 for name, s in cal.durations() if name != "round_trip_seconds")
