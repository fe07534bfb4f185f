"""`benchmarks/stream_floor.py`, the floor of a streamed token, run small against the real tritonserver: every token
arrives on both paths, and the CPU it reports is read from the server's own processes, streamed costing more per
token than unary (one response per token through both hops against one per request)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.server
def test_the_stream_floor_counts_every_token_and_the_cpu_of_each_process(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import stream_floor

    out = tmp_path / "floor.json"
    args = "--concurrency 1,2 --tokens 128 --requests 8 --rounds 1 --engine-cpu-ms 1:5,2:5".split()
    assert stream_floor.main([*args, "--output", str(out)]) == 0
    cells = {(c["concurrency"], c["mode"]): c for c in json.loads(out.read_text())["cells"]}
    assert set(cells) == {(1, "unary"), (1, "streamed"), (2, "unary"), (2, "streamed")}
    for (c, mode), cell in cells.items():
        cpu = cell["cpu_ms_per_token"]
        assert set(cpu) == {"tritonserver", "floor_source", "floor_relay", "client"}
        assert cell["tokens"] == 8 * 128 and cell["tokens_per_second"] > 0
        if mode == "streamed":  # 1024 responses through each hop: their stubs' and the server's CPU is seen
            assert cpu["floor_relay"] > 0 and cpu["floor_source"] > 0 and cpu["tritonserver"] > 0, (c, cpu)
    for c in (1, 2):
        streamed, unary = cells[(c, "streamed")]["cpu_ms_per_token"], cells[(c, "unary")]["cpu_ms_per_token"]
        assert sum(streamed.values()) > sum(unary.values())
    bounds = json.loads(out.read_text())["bounds"]
    assert [b["concurrency"] for b in bounds] == [1, 2] and all(0 < b["streamed_over_unary"] < 1 for b in bounds)
