"""The floor of a streamed token: what Triton's Python backend costs per token with no trtspec code in the path.

    python benchmarks/stream_floor.py [--concurrency 1,8] [--tokens 64] [--requests 16] [--engine-cpu-ms 1:13.1,8:4.7]

It serves a repository of two Python-backend models that do nothing else (benchmarks/stream_floor_models.py): a
decoupled `floor_source` that answers as a streaming engine call does (one response per token), and a decoupled
`floor_relay` that calls it through BLS and sends each response on to its client, as trtspec's BLS relays a plain
stretch. Clients ask `floor_relay` for `--tokens` tokens over HTTP, streamed (`generate_stream`, one response per
token through both hops) and not (`generate`, one response with every token through each hop), with every
concurrency interleaved in rounds. Reported per cell: tokens/s and the CPU milliseconds per token of tritonserver,
each stub and this client, read from /proc. Each model serves its requests one at a time, inside `execute`, so
concurrent requests queue: the leanest relay there is (no thread to hand a response to), and so the lowest CPU per
token and the highest bound below. A relay shaped as trtspec's BLS must be (a thread per request) costs more.

What the floor means for a deployment whose engine shares these cores: a token's wall time is about (the engine's
CPU per token + everything else's) / cores, so no streamed path with these two hops can reach a ratio to the same
path unstreamed above (E + unary floor) / (E + streamed floor), E the engine's CPU ms per token (the `engine`
column of `benchmarks/streaming.py`'s CPU table, not streamed). `--engine-cpu-ms C:E,...` prints that bound for each
concurrency C measured here, with the E the engine spends there (batching lowers it as C grows).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.table import Table

from trtspec.bench import parse_int_list, table_console, write_report
from trtspec.errors import BenchError
from trtspec.server import TritonServer, free_port

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import ProcessCpu, serving_processes  # noqa: E402  benchmarks/common.py, beside this script

MODELS = HERE / "stream_floor_models.py"
SOURCE, RELAY = "floor_source", "floor_relay"
MODES = ("unary", "streamed")
CONFIGS = {
    SOURCE: """
input [ { name: "n" data_type: TYPE_INT32 dims: [1] }, { name: "streaming" data_type: TYPE_BOOL dims: [1] } ]
output [ { name: "output_ids" data_type: TYPE_INT32 dims: [-1, -1] },
         { name: "sequence_length" data_type: TYPE_INT32 dims: [-1] } ]""",
    RELAY: """
input [ { name: "n" data_type: TYPE_INT32 dims: [1] }, { name: "streaming" data_type: TYPE_BOOL dims: [1] } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [-1] },
         { name: "output_ids" data_type: TYPE_INT32 dims: [-1] } ]""",
}


def write_repository(root: Path) -> Path:
    repo = root / "floor_repository"
    for name, io in CONFIGS.items():
        (repo / name / "1").mkdir(parents=True)
        shutil.copy(MODELS, repo / name / "1" / "model.py")
        (repo / name / "config.pbtxt").write_text(
            f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n{io.strip()}\n'
            "model_transaction_policy { decoupled: true }\ninstance_group [ { kind: KIND_CPU count: 1 } ]\n"
        )
    return repo


def one(http_url: str, tokens: int, streamed: bool) -> int:
    """Tokens received by one request."""
    host, port = http_url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    endpoint = "generate_stream" if streamed else "generate"
    conn.request("POST", f"/v2/models/{RELAY}/{endpoint}", json.dumps({"n": tokens, "streaming": streamed}))
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{RELAY}: HTTP {resp.status}: {resp.read()[:300]!r}")
    bodies = (line[5:] for line in resp if line.startswith(b"data:")) if streamed else [resp.read()]
    got = 0
    for body in bodies:
        ids = json.loads(body).get("output_ids", [])
        got += len(ids) if isinstance(ids, list) else 1  # one id comes as a number
    conn.close()
    return got


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=16, help="requests per cell and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine-cpu-ms", default="", help="C:E,... the engine's CPU ms per token at concurrency C")
    parser.add_argument("--output", default="stream_floor.json")
    args = parser.parse_args(argv)
    console = table_console()
    try:
        concurrencies = parse_int_list(args.concurrency, "--concurrency", minimum=1)
    except BenchError as exc:
        raise SystemExit(f"error: {exc}") from None
    workdir = Path(tempfile.mkdtemp(prefix="trtspec-stream-floor-"))
    server = TritonServer(
        write_repository(workdir), http_port=free_port(), grpc_port=free_port(), metrics_port=free_port()
    )
    cells = {(c, m): [] for c in concurrencies for m in MODES}
    try:
        with console.status("starting tritonserver…"):
            server.start(timeout=120)
        url = server.http_url
        processes = serving_processes(server.pid)
        one(url, args.tokens, True)  # warm both models up
        order, rng = list(cells), random.Random(0)
        for r in range(args.rounds):
            rng.shuffle(order)
            for c, mode in order:
                console.print(f"round {r + 1}/{args.rounds}: C={c} {mode}", highlight=False)
                start = time.perf_counter()
                with ProcessCpu(processes) as cpu, ThreadPoolExecutor(c) as pool:
                    got = sum(pool.map(lambda _: one(url, args.tokens, mode == "streamed"), range(args.requests)))
                cells[(c, mode)].append({"seconds": time.perf_counter() - start, "tokens": got, "cpu": cpu.seconds})
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    roles = ("tritonserver", SOURCE, RELAY, "client")
    table = Table(title=f"The floor of a token through two Python-backend hops ({args.tokens} tokens a request)")
    for col in ("C", "mode", "tokens/s", *roles, "server total"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    report = {"command": " ".join(["stream_floor.py", *(argv if argv is not None else sys.argv[1:])]), "cells": []}
    floors: dict[tuple[int, str], float] = {}
    for (c, mode), runs in cells.items():
        tokens = sum(r["tokens"] for r in runs)
        per_token = {role: sum(r["cpu"].get(role, 0.0) for r in runs) * 1e3 / tokens for role in roles}
        server_ms = sum(v for role, v in per_token.items() if role != "client")
        floors[(c, mode)] = server_ms + per_token["client"]
        rate = tokens / sum(r["seconds"] for r in runs)
        table.add_row(str(c), mode, f"{rate:.0f}", *(f"{per_token[r]:.3f}" for r in roles), f"{server_ms:.3f}")
        report["cells"].append(
            {"concurrency": c, "mode": mode, "tokens": tokens, "tokens_per_second": rate, "cpu_ms_per_token": per_token}
        )
    console.print(table)
    for item in filter(None, args.engine_cpu_ms.split(",")):
        c, e = int(item.split(":")[0]), float(item.split(":")[1])
        if (c, "unary") not in floors:
            raise SystemExit(f"--engine-cpu-ms: concurrency {c} was not measured (--concurrency {args.concurrency})")
        unary, streamed = floors[(c, "unary")], floors[(c, "streamed")]
        bound = (e + unary) / (e + streamed)
        report.setdefault("bounds", []).append({"concurrency": c, "engine_cpu_ms": e, "streamed_over_unary": bound})
        console.print(
            f"C={c}, an engine of {e:g} CPU ms per token on these cores: streamed/unary at most {bound:.3f} "
            f"(floor {streamed:.3f} ms a token streamed, {unary:.3f} ms unary, client included)",
            highlight=False,
        )
    write_report(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
