"""Streamed against not streamed: the same greedy plain requests through every path a client reads from, side by side.

    trtspec serve --repo REPO --openai-port 9000 &
    python benchmarks/streaming.py --grpc-url 127.0.0.1:8001 --http-url 127.0.0.1:8000 \
        --openai-url http://127.0.0.1:9000 --engine ENGINES/target [--metrics-url http://127.0.0.1:8002] \
        [--concurrency 1,8] [--output streaming.json]

Paths: `tensorrt_llm_bls` not streamed (gRPC), its `generate_stream` (HTTP SSE, `stream: true`), gRPC streaming
(`stream: true`), and the OpenAI front's `/v1/chat/completions` with `stream: true` (standard library HTTP, so the
figure holds the front and not a client library). The prompts are the built-in chat set in the target's chat
template (the OpenAI path sends the messages; the front applies the same template), `num_draft_tokens: 0`.

Where the server runs on this machine, a second table gives each serving process's CPU per output token (the
engine's stub, tritonserver, the BLS's stub, `trtspec serve` with the OpenAI front, the other models) and this
client's, read from /proc around each cell.

Every (concurrency, path) cell runs in each round, in a new random order per round, so drift in the machine's
speed hits every path alike; each prompt is sent once with max_tokens 1 first, so every path finds the prompt in
the engines' prefix cache. Reported per cell: aggregate output tokens/s (tokens of every request / the cell's
wall time), the ratio to the not-streamed path at the same concurrency, and the inter-token latency p50 of the
streamed paths (time between two responses / the tokens the later one carries). `--engine` also times the
engine's own decode step in this process while the server is idle (the bound the streamed ITL is held against).
A BLS path named with `+perf` (e.g. `generate_stream+perf`) asks for the perf metrics with the last response, as the
OpenAI front does. All paths must give the same text per prompt; a mismatch is reported. `--stream-interval N` asks
every streamed path for N tokens a message (SGLang's and vLLM's fixed behaviour), which trades inter-token latency
for messages.

Messages per token: what the client received per token (the BLS's responses over gRPC and generate_stream, the front's
content events), and with `--metrics-url` each hop's from the server's `trtspec_stream_messages_total` /
`trtspec_stream_tokens_total` (hop `engine`: the embedded engine model's responses to the BLS; `bls`: the BLS's to its
client, its final response included).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.table import Table

from trtspec.bench import parse_int_list, table_console
from trtspec.client import SpecClient
from trtspec.errors import BenchError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ProcessCpu, add_num_prompts, serving_processes  # noqa: E402  benchmarks/common.py, beside this script

PATHS = ("bls", "generate_stream", "grpc_stream", "openai_stream")


def chat_prompts(n: int) -> list[str]:
    source = Path(__file__).resolve().parents[1] / "trtspec/data/prompts/chat.jsonl"
    return [json.loads(line)["prompt"] for line in source.read_text().splitlines() if line.strip()][:n]


def openai_stream(
    url: str, model: str, message: str, max_tokens: int, interval: int = 0
) -> tuple[str, list[float], int]:
    """(text, arrival time of each content chunk, completion tokens) of one streamed chat completion."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": message}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "num_draft_tokens": 0,
    } | ({"stream_interval": interval} if interval else {})
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"openai front: HTTP {resp.status}: {resp.read()[:300]!r}")
    text, times, tokens = [], [], 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                text.append(piece)
                times.append(time.perf_counter())
    conn.close()
    return "".join(text), times, tokens


class Runner:
    def __init__(self, args, model_name: str, templated: dict[str, str]):
        self.args, self.model_name, self.templated = args, model_name, templated
        # the server's processes, when it runs on this machine (--server-pid: that tritonserver's, where several run)
        self.processes = serving_processes(args.server_pid)

    def one(self, path: str, prompt: str) -> tuple[str, int, list[float], int]:
        """(text, tokens, inter-token latencies in s, messages that carried text or tokens) of one request."""
        a = self.args
        if path == "openai_stream":
            sent = time.perf_counter()
            text, times, tokens = openai_stream(a.openai_url, self.model_name, prompt, a.max_tokens, a.stream_interval)
            gaps = [t1 - t0 for t0, t1 in zip([sent] + times, times)][1:]
            return text, tokens, gaps, len(times)
        perf = path.endswith("+perf")  # the perf metrics with the last response, as the OpenAI front asks for them
        path = path.removesuffix("+perf")
        protocol, url = ("http", a.http_url) if path == "generate_stream" else ("grpc", a.grpc_url)
        with SpecClient(url, protocol=protocol, timeout=600) as client:
            c = client.generate(
                self.templated[prompt],
                max_tokens=a.max_tokens,
                num_draft_tokens=0,
                temperature=0.0,
                stream=path != "bls",
                return_perf_metrics=perf,
                final_perf_metrics_only=perf or None,
                **({"stream_interval": a.stream_interval} if a.stream_interval and path != "bls" else {}),
            )
        gaps = [(b.seconds - c0.seconds) / max(len(b.token_ids), 1) for c0, b in zip(c.chunks, c.chunks[1:])]
        return c.text, len(c.token_ids), gaps, len(c.chunks)

    def cell(self, path: str, concurrency: int, prompts: list[str]) -> dict:
        hops = hop_counts(self.args.metrics_url)
        start = time.perf_counter()
        with ProcessCpu(self.processes) as cpu, ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(lambda p: self.one(path, p), prompts))
        wall = time.perf_counter() - start
        time.sleep(0.6)  # the engine model reports its counters every 0.25 s
        after = hop_counts(self.args.metrics_url)
        return {
            "messages": sum(r[3] for r in results),
            "hops": {k: [after[k][i] - hops.get(k, (0, 0))[i] for i in range(2)] for k in after},
            "seconds": wall,
            "cpu_seconds": cpu.seconds,
            "tokens": sum(r[1] for r in results),
            "gaps": [g for r in results for g in r[2]],
            "texts": [r[0] for r in results],
        }


def hop_counts(metrics_url: str | None) -> dict[str, tuple[float, float]]:
    """hop -> (messages, tokens) streamed so far, from the server's trtspec_stream_* counters (summed over models);
    empty without --metrics-url or where the server has no such counters."""
    if not metrics_url:
        return {}
    with urllib.request.urlopen(f"{metrics_url.rstrip('/')}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        for i, name in enumerate(("trtspec_stream_messages_total{", "trtspec_stream_tokens_total{")):
            if line.startswith(name):
                labels, value = line[len(name) :].rsplit("}", 1)
                hop = next((p.split("=")[1].strip('"') for p in labels.split(",") if p.startswith("hop=")), "?")
                found.setdefault(hop, [0.0, 0.0])[i] += float(value)
    return {hop: (m, t) for hop, (m, t) in found.items()}


def decode_step_ms(engine_dir: str, prompt_ids: list[int], tokens: int, reps: int) -> float:
    """The engine's own time per token of a plain generation, in this process (median of `reps`)."""
    from trtspec.contract import GenerationRequest
    from trtspec.engine.runtime import Engine

    engine = Engine.load(engine_dir, "cpu")
    times = []
    for rep in range(reps + 1):
        ids = prompt_ids + [rep]  # a new last token: the prompt's prefix is cached, the rest is decode
        t0 = time.perf_counter()
        result = engine.generate(GenerationRequest(input_ids=ids, request_output_len=tokens, end_id=-1))
        if rep:
            times.append((time.perf_counter() - t0) / len(result.new_tokens))
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grpc-url", default="127.0.0.1:8001")
    parser.add_argument("--http-url", default="127.0.0.1:8000")
    parser.add_argument("--openai-url", default="http://127.0.0.1:9000")
    parser.add_argument("--engine", help="target engine dir: also time its decode step in this process")
    parser.add_argument("--server-pid", type=int, help="the tritonserver's pid, where several servers run here")
    parser.add_argument(
        "--metrics-url", help="Triton's metrics address (http://HOST:8002): also the messages per token of each hop"
    )
    parser.add_argument("--concurrency", default="1,8")
    add_num_prompts(parser, 16, "how many of the chat prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=0,
        help="tokens per streamed message on every streamed path (0: the deployment's default)",
    )
    parser.add_argument("--output", default="streaming.json")
    args = parser.parse_args()
    console = table_console()
    try:
        concurrencies = parse_int_list(args.concurrency, "--concurrency", minimum=1)
    except BenchError as exc:
        raise SystemExit(f"error: {exc}") from None
    paths = [p for p in args.paths.split(",") if p]

    with urllib.request.urlopen(f"{args.openai_url}/v1/models") as resp:
        model_name = json.loads(resp.read())["data"][0]["id"]
    with SpecClient(args.grpc_url, protocol="grpc") as client:
        tokenizer_dir = client.model_config("tensorrt_llm_bls")["parameters"]["tokenizer_dir"]["string_value"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = chat_prompts(args.num_prompts)
    templated = {
        p: tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    }
    runner = Runner(args, model_name, templated)
    step_ms = []
    if args.engine:
        ids = tok(templated[prompts[0]])["input_ids"]
        step_ms.append(decode_step_ms(args.engine, ids, args.max_tokens, 5))
    with SpecClient(args.grpc_url, protocol="grpc") as client:  # every prompt in the prefix cache
        for p in prompts:
            client.generate(templated[p], max_tokens=1, num_draft_tokens=0, temperature=0.0)

    cells = {(c, p): [] for c in concurrencies for p in paths}
    order = list(cells)
    rng = random.Random(0)
    for r in range(args.rounds):
        rng.shuffle(order)
        for c, p in order:
            console.print(f"round {r + 1}/{args.rounds}: C={c} {p}", highlight=False)
            cells[(c, p)].append(runner.cell(p, c, prompts))
    if args.engine:
        ids = tok(templated[prompts[1]])["input_ids"]
        step_ms.append(decode_step_ms(args.engine, ids, args.max_tokens, 5))

    reference = cells[(concurrencies[0], paths[0])][0]["texts"]
    mismatches = sum(a != b for runs in cells.values() for run in runs for a, b in zip(run["texts"], reference))
    table = Table(
        title=f"{len(prompts)} chat prompts, {args.max_tokens} tokens, greedy, num_draft_tokens 0, "
        f"{args.rounds} rounds interleaved"
        + (f", stream_interval {args.stream_interval}" if args.stream_interval else "")
    )
    for col in ("C", "path", "tok/s", "vs not streamed", "ITL p50 ms", "ITL / decode step", "msgs/token"):
        table.add_column(col, justify="right" if col not in ("path",) else "left")
    step = statistics.mean(step_ms) if step_ms else None
    report = {"decode_step_ms": step_ms, "cells": []}
    for c in concurrencies:
        base = None
        for p in paths:
            runs = cells[(c, p)]
            rate = sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs)
            base = rate if p == "bls" else base
            gaps = [g for r in runs for g in r["gaps"]]
            itl = statistics.median(gaps) * 1e3 if gaps and p != "bls" else None
            # what the client received: the BLS's responses (gRPC, generate_stream) or the front's events
            per_token = sum(r["messages"] for r in runs) / max(sum(r["tokens"] for r in runs), 1)
            table.add_row(
                str(c),
                p,
                f"{rate:.1f}",
                f"{rate / base:.2f}x" if base else "",
                f"{itl:.1f}" if itl else "",
                f"{itl / step:.2f}x" if itl and step and c == 1 else "",
                f"{per_token:.2f}" if not p.startswith("bls") else "",
            )
            report["cells"].append(
                {
                    "concurrency": c,
                    "path": p,
                    "tokens_per_second": rate,
                    "ratio_to_not_streamed": rate / base if base else None,
                    "itl_p50_ms": itl,
                    "client_messages_per_token": per_token,
                    "hops": _hops(runs),
                }
            )
    console.print(table)
    if any(row["hops"] for row in report["cells"]):
        console.print(hop_table(report, concurrencies, paths))
    if runner.processes:
        console.print(cpu_table(cells, concurrencies, paths, report))
    if step:
        console.print(f"engine decode step (in process, server idle): {', '.join(f'{s:.1f}' for s in step_ms)} ms")
    console.print(f"outputs differing from the first path's: {mismatches}")
    report["mismatches"] = mismatches
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if mismatches else 0


def _hops(runs: list[dict]) -> dict[str, float]:
    """hop -> messages per token over a cell's runs, from the server's counters."""
    totals: dict[str, list[float]] = {}
    for r in runs:
        for hop, (m, t) in r["hops"].items():
            totals.setdefault(hop, [0.0, 0.0])
            totals[hop][0] += m
            totals[hop][1] += t
    return {hop: m / t for hop, (m, t) in totals.items() if t}


def hop_table(report: dict, concurrencies: list[int], paths: list[str]) -> Table:
    table = Table(title="messages per token by hop (the server's trtspec_stream_* counters; front: events received)")
    hops = sorted({h for row in report["cells"] for h in row["hops"]})
    for col in ("C", "path", *hops, "front"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for row in report["cells"]:
        if row["path"].startswith("bls"):
            continue
        front = f"{row['client_messages_per_token']:.2f}" if row["path"] == "openai_stream" else ""
        table.add_row(str(row["concurrency"]), row["path"], *(f"{row['hops'].get(h, 0):.2f}" for h in hops), front)
    return table


# the processes a streamed token passes, in the order it passes them; the rest of the serving processes are summed
CPU_ROLES = ("tensorrt_llm", "tritonserver", "tensorrt_llm_bls", "trtspec serve", "client")


def cpu_table(cells: dict, concurrencies: list[int], paths: list[str], report: dict) -> Table:
    """CPU milliseconds per output token of each serving process and of this client, per cell: on a machine whose
    cores the engine shares, every millisecond outside the engine is taken from its forward passes, so this says
    where a path's cost is, more steadily than the ratio of rates that such a machine's drift moves."""
    table = Table(title="CPU ms per output token, by process (this machine's server)")
    for col in ("C", "path", "engine", "tritonserver", "BLS", "front", "other models", "client", "outside engine"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for c in concurrencies:
        for p in paths:
            runs = cells[(c, p)]
            tokens = sum(r["tokens"] for r in runs)
            per_token = {}
            for r in runs:
                for role, seconds in r["cpu_seconds"].items():
                    per_token[role] = per_token.get(role, 0.0) + seconds * 1e3 / tokens
            other = sum(v for role, v in per_token.items() if role not in CPU_ROLES)
            outside = sum(v for role, v in per_token.items() if role not in ("tensorrt_llm", "client"))
            table.add_row(
                str(c),
                p,
                *(f"{per_token.get(role, 0.0):.2f}" for role in CPU_ROLES[:4]),
                f"{other:.2f}",
                f"{per_token.get('client', 0.0):.2f}",
                f"{outside:.2f}",
            )
            for row in report["cells"]:
                if row["concurrency"] == c and row["path"] == p:
                    row["cpu_ms_per_token"] = per_token
    return table


if __name__ == "__main__":
    sys.exit(main())
