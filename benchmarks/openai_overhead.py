"""What the OpenAI-compatible front costs per request: the same greedy requests through `/v1/completions` and to
`tensorrt_llm_bls` directly (SpecClient over gRPC), interleaved in one run.

    trtspec serve --repo REPO --openai-port 9000 &
    python benchmarks/openai_overhead.py --triton-url 127.0.0.1:8001 --openai-url http://127.0.0.1:9000 \
        --requests 32 --max-tokens 32 [--stream] [--prompts FILE] [--num-draft-tokens K]

Each prompt is sent both ways back to back, in a random order per pair (so drift in the server's speed hits both
ways alike), one request at a time, after a one-token request of the same prompt: the engines' prefix cache then
holds the prompt for both ways, so neither is measured without the prefill the other skips. The OpenAI side uses
one keep-alive HTTP connection and the standard library,
so the figures hold the front (parsing, tokenizing the prompt for usage, the gRPC call, the response) and not a
client library's own cost. Both sides must produce the same tokens (greedy, same max_tokens); pairs that do not
are counted and left out. Prompts: a JSONL file of {"prompt": ...} or one per line [default: the built-in chat set].
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
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trtspec.client import SpecClient


def load_prompts(path: str | None) -> list[str]:
    source = Path(path) if path else Path(__file__).resolve().parents[1] / "trtspec/data/prompts/chat.jsonl"
    prompts = []
    for line in source.read_text().splitlines():
        line = line.strip()
        if line:
            prompts.append(json.loads(line)["prompt"] if line.startswith("{") else line)
    if not prompts:
        sys.exit(f"{source} holds no prompts")
    return prompts


class OpenAIClient:
    """POST /v1/completions on one keep-alive connection; returns (seconds, time to first text, tokens, text)."""

    def __init__(self, url: str):
        parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        self.model = self._get("/v1/models")["data"][0]["id"]

    def _get(self, path: str) -> dict:
        self.conn.request("GET", path)
        resp = self.conn.getresponse()
        body = json.loads(resp.read())
        if resp.status != 200:
            sys.exit(f"GET {path}: HTTP {resp.status}: {body}")
        return body

    def complete(self, prompt: str, max_tokens: int, stream: bool, extra: dict) -> tuple[float, float, int, str]:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
            **extra,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        sent = time.perf_counter()
        self.conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        if resp.status != 200:
            sys.exit(f"POST /v1/completions: HTTP {resp.status}: {resp.read().decode()[:500]}")
        if not stream:
            out = json.loads(resp.read())
            seconds = time.perf_counter() - sent
            return seconds, seconds, out["usage"]["completion_tokens"], out["choices"][0]["text"]
        first, text, tokens = None, [], 0
        for raw in resp:  # server-sent events, one `data:` line each
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("choices") and event["choices"][0]["text"]:
                first = first or time.perf_counter() - sent
                text.append(event["choices"][0]["text"])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
        seconds = time.perf_counter() - sent
        return seconds, first or seconds, tokens, "".join(text)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--triton-url", default="127.0.0.1:8001", help="gRPC host:port of Triton")
    parser.add_argument("--openai-url", default="http://127.0.0.1:9000", help="the OpenAI front's base URL")
    parser.add_argument("--prompts", help='JSONL of {"prompt": ...} or one prompt per line [default: built-in chat]')
    parser.add_argument("--requests", type=int, default=32, help="requests each way (after 2 warm-ups each)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--stream", action="store_true", help="stream both ways (adds time to first token)")
    parser.add_argument("--num-draft-tokens", type=int, help="K for both ways [default: the deployment's]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the order within each pair")
    parser.add_argument("--output", help="also write the raw figures here (JSON)")
    args = parser.parse_args()

    prompts = load_prompts(args.prompts)
    front = OpenAIClient(args.openai_url)
    direct = SpecClient(args.triton_url, protocol="grpc")
    extra = {} if args.num_draft_tokens is None else {"num_draft_tokens": args.num_draft_tokens}

    def via_bls(prompt: str) -> tuple[float, float, int, str]:
        sent = time.perf_counter()
        c = direct.generate(prompt, max_tokens=args.max_tokens, temperature=0.0, stream=args.stream, **extra)
        return time.perf_counter() - sent, c.time_to_first_token or c.seconds, len(c.token_ids), c.text

    def via_openai(prompt: str) -> tuple[float, float, int, str]:
        return front.complete(prompt, args.max_tokens, args.stream, extra)

    ways = {"openai": via_openai, "bls": via_bls}
    for i in range(2):  # warm-up: connections, the front's first requests, the engines' caches
        for way in ways.values():
            way(prompts[i % len(prompts)])
    rng = random.Random(args.seed)
    rows, mismatched = [], 0
    console = Console()
    with console.status("measuring…") as status:
        for i in range(args.requests):
            prompt = prompts[i % len(prompts)]
            direct.generate(prompt, max_tokens=1, temperature=0.0)  # both ways then find the prompt's KV cached
            order = list(ways)
            rng.shuffle(order)
            result = {name: ways[name](prompt) for name in order}
            status.update(f"measuring… {i + 1}/{args.requests}")
            (o_s, o_ttft, o_tok, o_text), (b_s, b_ttft, b_tok, b_text) = result["openai"], result["bls"]
            if o_tok != b_tok or o_text != b_text:
                mismatched += 1
                continue
            rows.append(
                {
                    "prompt": i % len(prompts),
                    "tokens": o_tok,
                    "openai_s": o_s,
                    "bls_s": b_s,
                    "openai_ttft_s": o_ttft,
                    "bls_ttft_s": b_ttft,
                }
            )
    direct.close()
    if not rows:
        sys.exit(f"every pair differed ({mismatched}); is the deployment greedy and deterministic?")

    table = Table(
        title=f"OpenAI front vs tensorrt_llm_bls direct: {len(rows)} request pairs, "
        f"max_tokens {args.max_tokens}, {'streamed' if args.stream else 'not streamed'}"
    )
    for column in ("", "p50", "p90", "mean"):
        table.add_column(column, justify="right" if column else "left")

    def add(label: str, values: list[float], unit: str = "ms", scale: float = 1e3) -> None:
        fmt = (lambda v: f"{v * scale:.1f} {unit}") if unit == "ms" else (lambda v: f"{v:.3f}x")
        table.add_row(label, fmt(pct(values, 50)), fmt(pct(values, 90)), fmt(statistics.fmean(values)))

    add("latency via OpenAI front", [r["openai_s"] for r in rows])
    add("latency via BLS (SpecClient)", [r["bls_s"] for r in rows])
    add("overhead per request", [r["openai_s"] - r["bls_s"] for r in rows])
    add("overhead ratio (front / direct)", [r["openai_s"] / r["bls_s"] for r in rows], unit="x")
    if args.stream:
        add("time to first token, front", [r["openai_ttft_s"] for r in rows])
        add("time to first token, direct", [r["bls_ttft_s"] for r in rows])
        add("first-token overhead", [r["openai_ttft_s"] - r["bls_ttft_s"] for r in rows])
    console.print(table)
    tokens = statistics.fmean(r["tokens"] for r in rows)
    console.print(f"{tokens:.1f} tokens per request on average; {mismatched} pair(s) with different outputs left out")
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "rows": rows, "mismatched": mismatched}, indent=2))


if __name__ == "__main__":
    main()
