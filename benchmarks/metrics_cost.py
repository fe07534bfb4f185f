"""What the BLS's Prometheus metrics cost per request, against what a request costs, in one run.

    python benchmarks/metrics_cost.py [--url 127.0.0.1:8001 --max-tokens 64 --requests 8]

Serves benchmarks/metrics_probe.py (the BLS's own metric families, updated as the BLS updates them per finished
request) in a real tritonserver and reads the median microseconds of one request's updates. With `--url` (a running
`trtspec serve`, gRPC), it times plain-prompt requests there in the same run and prints the ratio."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

CONFIG = """name: "metrics_probe"
backend: "python"
max_batch_size: 0
input [ { name: "rounds" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "result" data_type: TYPE_STRING dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""


def probe(rounds: int) -> float:
    import tritonclient.grpc as grpcclient

    from trtspec.server import TritonServer, free_port

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "repo" / "metrics_probe"
        (model / "1").mkdir(parents=True)
        shutil.copy(HERE / "metrics_probe.py", model / "1" / "model.py")
        (model / "config.pbtxt").write_text(CONFIG)
        server = TritonServer(model.parent, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
        server.start(timeout=120)
        try:
            client = grpcclient.InferenceServerClient(server.grpc_url)
            given = grpcclient.InferInput("rounds", [1], "INT32")
            given.set_data_from_numpy(np.array([rounds], dtype=np.int32))
            result = client.infer("metrics_probe", [given]).as_numpy("result").reshape(-1)[0]
            return json.loads(result)["us_per_request"]
        finally:
            server.stop()


def request_ms(url: str, max_tokens: int, requests: int) -> float:
    from trtspec.client import SpecClient

    times = []
    with SpecClient(url, "grpc") as client:
        for i in range(requests + 1):  # the first warms up
            started = time.perf_counter()
            client.generate(f"Write a short note about item {i}.", max_tokens=max_tokens)
            times.append(time.perf_counter() - started)
    return statistics.median(times[1:]) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--url", help="a running trtspec server's gRPC address, to time requests beside")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8)
    a = ap.parse_args()
    us = probe(a.rounds)
    print(f"metric updates per finished request: {us:.1f} us (median of {a.rounds})")
    if a.url:
        ms = request_ms(a.url, a.max_tokens, a.requests)
        print(
            f"a {a.max_tokens}-token request at {a.url}: {ms:.1f} ms (median of {a.requests}); "
            f"metrics: {us / 1000 / ms:.2%} of it"
        )


if __name__ == "__main__":
    main()
