"""Fuzz a served deployment's speculative BLS with many generated requests (the generator of tests/test_fuzz.py:
every BLS field with valid, boundary and invalid values and types, unknown fields; HTTP generate, generate_stream
and gRPC streaming) and count the outcomes by kind.

    python benchmarks/fuzz.py --cases 10000 [--repo REPO | --http 127.0.0.1:8000 --grpc 127.0.0.1:8001]

Without --http/--grpc it builds a tiny random pair and serves it. Each case must get an answer or an error naming a
field (HTTP: or Triton's own refusal of a JSON value of the wrong type); the server must stay ready; a greedy
answer with only output-neutral fields must equal the target-only answer. Exits 1 on any violation, and writes the
counts (and the first violations) as JSON with --output.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402
from support.fuzzing import OUTPUT_NEUTRAL, PROMPTS, Outcome, bls_requests, send, wrong_json_type  # noqa: E402


class _Endpoints:
    def __init__(self, http: str, grpc: str):
        self.http_base_url, self.grpc_url = f"http://{http}", grpc


def _tiny_server(root: Path):
    from support.tiny import make_checkpoint, make_perturbed_copy, write_config

    from trtspec.compile import run_build
    from trtspec.config import load_config
    from trtspec.deploy.writer import write_repository
    from trtspec.server import TritonServer, free_port

    target = make_checkpoint(root / "target", layers=2, seed=0)
    draft = make_perturbed_copy(target, root / "draft", noise=0.01)
    config = write_config(
        root / "build.yaml",
        target,
        draft,
        speculation={"max_draft_len": 4},
        engine={"max_input_len": 64, "max_seq_len": 128},
    )
    repo = write_repository(load_config(config), run_build(config, root / "engines"), root / "repo")
    return TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=10000)
    p.add_argument("--http", help="host:port of a running server's HTTP endpoint")
    p.add_argument("--grpc", help="host:port of its gRPC endpoint")
    p.add_argument("--repo", type=Path, help="serve this repository instead of a tiny random pair")
    p.add_argument("--output", type=Path)
    args = p.parse_args(argv)
    console = Console()
    server = None
    if args.http and args.grpc:
        target = _Endpoints(args.http, args.grpc)
    else:
        from trtspec.server import TritonServer, free_port

        server = (
            TritonServer(args.repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
            if args.repo
            else _tiny_server(Path(tempfile.mkdtemp(prefix="trtspec-fuzz-")))
        )
        server.start()
        target = server
    counts: collections.Counter = collections.Counter()
    violations: list[dict] = []
    references: dict = {}
    started = time.perf_counter()

    def reference(prompt: str, max_tokens: int) -> list[int]:
        key = (prompt, max_tokens)
        if key not in references:
            references[key] = send(target, "grpc", {"text_input": prompt, "max_tokens": max_tokens}).ids
        return references[key]

    try:
        with Progress(console=console) as progress:
            task = progress.add_task("fuzzing", total=args.cases)

            @settings(
                max_examples=args.cases,
                deadline=None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=bls_requests())
            def run(case):
                transport, fields = case
                outcome = send(target, transport, fields)
                counts[(transport, outcome.kind)] += 1
                allowed = {Outcome.ANSWER, Outcome.FIELD_ERROR}
                if transport != "grpc" and wrong_json_type(fields):
                    allowed.add(Outcome.JSON_TYPE_ERROR)
                problem = None if outcome.kind in allowed else f"{outcome.kind}: {outcome.detail}"
                with urllib.request.urlopen(f"{target.http_base_url}/v2/health/ready", timeout=30) as ready:
                    if ready.status != 200:
                        problem = f"server not ready after the request ({ready.status})"
                if (
                    problem is None
                    and outcome.kind == Outcome.ANSWER
                    and set(fields) <= OUTPUT_NEUTRAL
                    and fields.get("text_input") in PROMPTS
                    and outcome.ids != reference(fields["text_input"], fields["max_tokens"])
                ):
                    problem = "greedy answer differs from target-only"
                if problem:
                    counts[("violation", problem.split(":")[0])] += 1
                    if len(violations) < 20:
                        violations.append({"transport": transport, "fields": repr(fields), "problem": problem})
                progress.advance(task)

            run()
    finally:
        if server is not None:
            server.stop()
    seconds = time.perf_counter() - started
    table = Table(title=f"{args.cases} generated requests in {seconds:.0f} s")
    for col in ("transport", "outcome", "count"):
        table.add_column(col, justify="right" if col == "count" else "left")
    for (transport, kind), n in sorted(counts.items()):
        table.add_row(transport, kind, str(n))
    console.print(table)
    for v in violations:
        console.print(v, markup=False)
    if args.output:
        args.output.write_text(
            json.dumps(
                {
                    "command": "python " + " ".join(sys.argv),
                    "cases": args.cases,
                    "seconds": seconds,
                    "counts": {f"{t} | {k}": n for (t, k), n in counts.items()},
                    "violations": violations,
                },
                indent=2,
            )
        )
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
