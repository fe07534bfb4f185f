"""The orchestration cost of one iteration: the part of every draft-then-verify iteration that is not model work.

    python benchmarks/overhead.py --tokenizer /tmp/bench-demo/engines/target --output overhead.json
    python benchmarks/overhead.py --config build_configs/demo.yaml          # the tokenizer of the config's target

It writes a model repository with trtspec's own templates (`trtspec.repository.write_repository`) for two engine
dirs that hold no weights, only a TensorRT-LLM style config.json, the real tokenizer, and a `trivial.json`; the
engine models' model.py is `benchmarks/trivial_engine.py`, which answers at once (a fixed token; the whole draft
accepted). The BLS, the pre/postprocessing tokenizer and every config are the production ones. The repository
is served by the real tritonserver; streamed requests go to `tensorrt_llm_bls` from as many clients as the
concurrency, every (concurrency, K) cell interleaved with the others in rounds.

With engines that take no time, the time between two streamed responses of a request is one iteration of pure
orchestration: the BLS round trip to the draft engine (K > 0) and to the target engine (tensor packing, Triton's
scheduling, the Python backend's shared-memory IPC), the loop's bookkeeping, incremental detokenization, and the
response path to the client. Reported per cell, as percentiles over every iteration of every request:

    iteration_ms        time between consecutive streamed responses (one iteration each, or one token of a
                        plain stretch, which streams from one engine call)
    round_trips_ms      (draft_ms + verify_ms) / responses, per request: the BLS's calls of the two engines
    rest_ms             iteration_ms of the request minus its round trips: loop, detokenization, response path
    ttft_ms             request to first response: tokenization, the first (plain) iteration, the response

Each (C, K) cell runs twice: without return_perf_metrics, what most clients pay, and with it, which adds output
tensors to every engine call and response and is what round_trips_ms and rest_ms need (draft_time_ms,
verify_time_ms). Client and server share this machine's cores, so the client's own receiving is in iteration_ms too.

Last, the floor: a BLS round trip between two Python-backend models that do nothing else (round_trip_floor.py),
with one tensor each way and with a verification's tensor count. An iteration makes two round trips (draft,
verify) and sends one response, so twice the floor is what no BLS iteration on this machine can go below.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trtspec.bench import (
    distribution,
    environment,
    finish_environment,
    load_prompt_set,
    table_console,
    write_report,
)
from trtspec.client import ClientError, SpecClient
from trtspec.config import BuildConfig, EngineSpec, ModelSpec, SpeculationSpec
from trtspec.repository import BLS_MODEL, DRAFT_MODEL, TARGET_MODEL, write_repository
from trtspec.repository_checks import validate_repository
from trtspec.server import TritonServer, free_port

HERE = Path(__file__).resolve().parent
TRIVIAL_ENGINE = HERE / "trivial_engine.py"
FLOOR_MODELS = HERE / "round_trip_floor.py"
FLOOR_CALLER, FLOOR_ECHO = "floor_caller", "floor_echo"
MAX_DRAFT_LEN = 8


# ---- the repository ----------------------------------------------------------------------------------------


def load_tokenizer(args):
    if args.tokenizer:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(args.tokenizer)
    from trtspec.checkpoint import load_tokenizer as load
    from trtspec.config import load_config

    return load(load_config(args.config).checkpoints["target"])


def engine_config(vocab_size: int, max_input_len: int, max_seq_len: int) -> dict:
    """The config.json of a TensorRT-LLM engine dir, as much of it as trtspec reads (trtspec.engine.manifest)."""
    return {
        "version": "trivial",
        "pretrained_config": {"architecture": "TrivialForCausalLM", "dtype": "float32", "vocab_size": vocab_size},
        "build_config": {
            "max_batch_size": 8,
            "max_input_len": max_input_len,
            "max_seq_len": max_seq_len + MAX_DRAFT_LEN,
            "max_draft_len": MAX_DRAFT_LEN,
            "speculative_decoding_mode": 2,
        },
        "trtspec": {"backend": "torch"},
    }


def write_trivial_repository(workdir: Path, tokenizer, *, max_input_len: int = 1024, max_seq_len: int = 2048) -> Path:
    """Engine dirs without weights + the repository from trtspec's templates, the engines swapped for trivial ones."""
    token = tokenizer(" the", add_special_tokens=False)["input_ids"][-1]
    if token == tokenizer.eos_token_id:
        raise SystemExit("the fixed token must not be the end token")
    engines = workdir / "engines"
    for role in ("target", "draft"):
        folder = engines / role
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(
            json.dumps(engine_config(len(tokenizer), max_input_len, max_seq_len), indent=2)
        )
        (folder / "trivial.json").write_text(json.dumps({"token": token}))
        tokenizer.save_pretrained(str(folder))
    config = BuildConfig(
        name="trivial",
        backend="torch",
        target=ModelSpec(checkpoint="trivial"),
        draft=ModelSpec(checkpoint="trivial"),
        speculation=SpeculationSpec(max_draft_len=MAX_DRAFT_LEN, num_draft_tokens=4),
        engine=EngineSpec(max_batch_size=8, max_input_len=max_input_len, max_seq_len=max_seq_len),
    )
    repo = write_repository(config, engines, workdir / "model_repository", force=True, device="cpu")
    for model in (TARGET_MODEL, DRAFT_MODEL):
        shutil.copy(TRIVIAL_ENGINE, repo / model / "1" / "model.py")
    problems = validate_repository(repo)
    if problems:
        raise SystemExit("the trivial repository does not validate:\n" + "\n".join(f"  - {p}" for p in problems))
    for model in (FLOOR_CALLER, FLOOR_ECHO):  # not in the deployment: only the floor's measurement calls them
        (repo / model / "1").mkdir(parents=True)
        (repo / model / "config.pbtxt").write_text(floor_config(model))
        shutil.copy(FLOOR_MODELS, repo / model / "1" / "model.py")
    return repo


def floor_config(name: str) -> str:
    """config.pbtxt of the floor's models: the echo is decoupled, as trtspec deploys its engine models."""
    if name == FLOOR_ECHO:
        inputs = ", ".join(f'{{ name: "T{i}" data_type: TYPE_INT32 dims: [-1] optional: true }}' for i in range(10))
        outputs = ", ".join(f'{{ name: "T{i}" data_type: TYPE_INT32 dims: [-1] }}' for i in range(10))
        io = f"input [ {inputs} ]\noutput [ {outputs} ]\nmodel_transaction_policy {{ decoupled: true }}"
    else:
        io = (
            'input [ { name: "rounds" data_type: TYPE_INT32 dims: [1] } ]\n'
            'output [ { name: "round_trip_ms" data_type: TYPE_STRING dims: [1] } ]'
        )
    return (
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n{io}\n'
        "instance_group [ { kind: KIND_CPU count: 1 } ]\n"
    )


def measure_floor(url: str, rounds: int = 300) -> dict[str, float]:
    """Median ms of a bare BLS round trip between two Python-backend models, per shape (round_trip_floor.py)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        tensor = grpcclient.InferInput("rounds", [1], "INT32")
        tensor.set_data_from_numpy(np.asarray([rounds], np.int32))
        answer = client.infer(FLOOR_CALLER, [tensor]).as_numpy("round_trip_ms")
        return json.loads(answer.reshape(-1)[0])
    finally:
        client.close()


# ---- the measurement ---------------------------------------------------------------------------------------


def one_request(client: SpecClient, prompt: str, k: int, perf: bool, max_tokens: int, fields: dict) -> dict:
    c = client.generate(
        prompt, max_tokens=max_tokens, num_draft_tokens=k, stream=True, return_perf_metrics=perf, **fields
    )
    times = [chunk.seconds for chunk in c.chunks if chunk.token_ids]
    gaps = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    record = {
        "tokens": len(c.token_ids),
        "seconds": c.seconds,
        "ttft_ms": (c.time_to_first_token or 0) * 1e3,
        "responses": len(times),
        "gaps_ms": gaps,
    }
    if not perf:  # what a client that does not ask for perf metrics pays; the breakdown needs them
        return record
    iterations = c.iterations or 0
    speculative = c.drafted_per_position[0] if c.drafted_per_position else 0  # iterations that drafted
    # per response: a speculative iteration sends one; a streamed plain stretch is one engine call and one response
    # per token, so its call's time is spread over its tokens
    round_trips = (c.draft_ms + c.verify_ms) / len(times) if times else None
    return {
        **record,
        "iterations": iterations,
        "draft_ms": c.draft_ms,
        "verify_ms": c.verify_ms,
        "round_trips_ms": round_trips,
        "draft_ms_per_iteration": c.draft_ms / speculative if speculative else None,
        "verify_ms_per_iteration": c.verify_ms / iterations if iterations else None,
        "rest_ms": sum(gaps) / len(gaps) - round_trips if gaps and round_trips is not None else None,
        "accepted": c.accepted,
        "drafted": c.drafted,
    }


def measure(
    url: str,
    protocol: str,
    prompts: list[str],
    concurrencies,
    ks,
    perfs,
    *,
    max_tokens: int,
    requests: int,
    seed: int,
    console: Console,
) -> dict:
    clients = [SpecClient(url, protocol=protocol) for _ in range(max(concurrencies))]
    try:
        inputs = [i["name"] for i in clients[0].model_config(BLS_MODEL).get("input", [])]
        fields = {"adaptive_draft_length": False} if "adaptive_draft_length" in inputs else {}
        if "speculation" in inputs:  # the trivial engine repeats one token, which prompt lookup would draft for free
            fields["speculation"] = "draft_model"
        for k in ks:  # warm-up
            clients[0].generate(prompts[0], max_tokens=16, num_draft_tokens=k, stream=True, **fields)
        rounds = {c: max(1, -(-requests // c)) for c in concurrencies}
        results = {(c, k, p): [] for c in concurrencies for k in ks for p in perfs}
        counter = 0
        total = sum(rounds[c] * c * len(ks) * len(perfs) for c in concurrencies)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("measuring", total=total)
            for r in range(max(rounds.values())):
                cells = [(c, k, p) for c in concurrencies for k in ks for p in perfs if r < rounds[c]]
                random.Random(seed + r).shuffle(cells)
                for c, k, p in cells:
                    progress.update(task, description=f"round {r + 1}: C={c} K={k} perf={'on' if p else 'off'}")
                    texts = [f"#{counter + i} {prompts[(counter + i) % len(prompts)]}" for i in range(c)]
                    counter += c
                    with ThreadPoolExecutor(max_workers=c) as pool:
                        done = list(
                            pool.map(lambda i: one_request(clients[i], texts[i], k, p, max_tokens, fields), range(c))
                        )
                    results[(c, k, p)] += done
                    progress.advance(task, c)
    finally:
        for client in clients:
            client.close()
    return {
        "cells": [summarize(c, k, p, recs) for (c, k, p), recs in results.items()],
        "fixed_draft_length": bool(fields),
    }


def summarize(concurrency: int, k: int, perf: bool, records: list[dict]) -> dict:
    def values(key):
        return [r[key] for r in records if r.get(key) is not None]

    cell = {
        "concurrency": concurrency,
        "k": k,
        "perf_metrics": perf,
        "requests": len(records),
        "tokens": sum(values("tokens")),
        "responses": sum(values("responses")),
        "iteration_ms": distribution([g for r in records for g in r["gaps_ms"]]),
        "ttft_ms": distribution(values("ttft_ms")),
        "tokens_per_s": sum(values("tokens")) / sum(values("seconds")) * concurrency if records else None,
    }
    if perf:
        cell.update(
            {
                "iterations": sum(values("iterations")),
                "tokens_per_iteration": sum(values("tokens")) / max(1, sum(values("iterations"))),
                "round_trips_ms": distribution(values("round_trips_ms")),
                "draft_round_trip_ms": distribution(values("draft_ms_per_iteration")),
                "verify_round_trip_ms": distribution(values("verify_ms_per_iteration")),
                "rest_ms": distribution(values("rest_ms")),
                "all_accepted": all(r["accepted"] == r["drafted"] for r in records),
            }
        )
    return cell


def render(report: dict, console: Console) -> None:
    table = Table(title="orchestration cost per iteration, trivial engines (they answer at once)")
    for col in (
        "C",
        "K",
        "perf",
        "req",
        "responses",
        "tok/iter",
        "iteration ms p50/p99",
        "BLS round trips ms p50",
        "draft / verify ms p50",
        "rest ms p50",
        "TTFT ms p50/p99",
    ):
        table.add_column(col, justify="right")

    def ms(d):
        return "-" if d is None or d.get("p50") is None else f"{d['p50']:.2f}"

    for c in sorted(report["cells"], key=lambda c: (c["concurrency"], c["k"], c["perf_metrics"])):
        it, ttft = c["iteration_ms"], c["ttft_ms"]
        perf = c["perf_metrics"]
        table.add_row(
            str(c["concurrency"]),
            str(c["k"]),
            "on" if perf else "off",
            str(c["requests"]),
            str(c["responses"]),
            f"{c['tokens_per_iteration']:.2f}" if perf else "-",
            f"{it['p50']:.2f}/{it['p99']:.2f}",
            ms(c.get("round_trips_ms")),
            f"{ms(c.get('draft_round_trip_ms'))} / {ms(c.get('verify_round_trip_ms'))}",
            ms(c.get("rest_ms")),
            f"{ttft['p50']:.1f}/{ttft['p99']:.1f}",
        )
    console.print(table)
    floor = report.get("round_trip_floor_ms") or {}
    console.print(
        "floor of one BLS round trip between two Python-backend models that do nothing (median ms): "
        + ", ".join(f"{shape} {ms:.2f}" for shape, ms in floor.items())
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", default="build_configs/demo.yaml", help="build config whose target's tokenizer to use"
    )
    parser.add_argument(
        "--tokenizer", help="tokenizer dir (e.g. a target engine dir) instead of the config's checkpoint"
    )
    parser.add_argument("--workdir", help="where the repository goes [default: a temporary dir, removed]")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--num-draft-tokens", default="0,4")
    parser.add_argument(
        "--perf-metrics",
        default="off,on",
        help="cells without and with return_perf_metrics (the per-call breakdown needs them; they add "
        "output tensors to every engine call and response)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=8, help="requests per cell (rounded up to the concurrency)")
    parser.add_argument("--prompts", default="builtin:chat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="JSON report")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    concurrencies = sorted({int(x) for x in args.concurrency.split(",")})
    ks = sorted({int(x) for x in args.num_draft_tokens.split(",")})
    perfs = sorted({{"on": True, "off": False}[x.strip()] for x in args.perf_metrics.split(",")})

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="trtspec-overhead-"))
    try:
        with console.status("writing the trivial repository…"):
            repo = write_trivial_repository(workdir, load_tokenizer(args))
        server = TritonServer(
            repo,
            http_port=free_port(),
            grpc_port=free_port(),
            metrics_port=free_port(),
            model_control_explicit_models=(TARGET_MODEL, DRAFT_MODEL, BLS_MODEL, FLOOR_ECHO, FLOOR_CALLER),
        )
        with console.status("starting tritonserver…"):
            server.start(timeout=300)
        try:
            url = server.grpc_url if args.protocol == "grpc" else server.http_url
            env, started = environment(), time.perf_counter()
            result = measure(
                url,
                args.protocol,
                load_prompt_set(args.prompts),
                concurrencies,
                ks,
                perfs,
                max_tokens=args.max_tokens,
                requests=args.requests,
                seed=args.seed,
                console=console,
            )
            with console.status("measuring the floor of a BLS round trip…"):
                floor = measure_floor(server.grpc_url)
        finally:
            server.stop()
    except ClientError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "settings": {
            "protocol": args.protocol,
            "concurrency": concurrencies,
            "num_draft_tokens": ks,
            "perf_metrics": perfs,
            "max_tokens": args.max_tokens,
            "requests": args.requests,
            "prompts": args.prompts,
            "fixed_draft_length": result["fixed_draft_length"],
            "stream": True,
        },
        "environment": finish_environment(env, started),
        "cells": result["cells"],
        "round_trip_floor_ms": floor,
    }
    render(report, table_console())
    if args.output:
        console.print(f"report: {write_report(report, args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
