"""What one engine call costs beyond its forward passes, as a served `tensorrt_llm` model answers it.

    python benchmarks/engine_calls.py --url 127.0.0.1:8001

A speculative request makes one engine call per iteration (and one more per draft-model draft); target-only
decoding makes one for the whole answer. Each round here generates --tokens tokens twice from the same prompt:
once in one call, then one token per call with the sequence so far (each call finds the previous one's tokens in
the prefix cache, as a verification does). The difference per call is what a call costs beyond its forward pass:
the client's and the server's messages, the engine model's parsing, queueing and response. Both ways must give the
same tokens (greedy, batch-invariant). The client's own share is included: its gRPC stream per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rich.console import Console
from rich.table import Table

from trtspec.client import SpecClient
from trtspec.contract import GenerationRequest, request_to_tensors


def generate(client, model: str, ids: list[int], tokens: int) -> list[int]:
    request = GenerationRequest(input_ids=ids, request_output_len=tokens, end_id=-1)
    out = client.infer(model, request_to_tensors(request), ["output_ids", "sequence_length"])
    length = int(out["sequence_length"].reshape(-1)[0])
    return [int(t) for t in out["output_ids"].reshape(-1)[len(ids) : length]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="gRPC address of the server (e.g. 127.0.0.1:8001)")
    p.add_argument("--model", default="tensorrt_llm")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--output")
    args = p.parse_args(argv)
    rows = []
    with SpecClient(args.url, protocol="grpc", timeout=600) as client:
        generate(client, args.model, list(range(1000, 1000 + args.prompt_tokens)), 4)  # warm
        for r in range(args.rounds):
            prompt = [1000 + (i * 7 + r) % 5000 for i in range(args.prompt_tokens)]  # a new prompt each round
            t = time.perf_counter()
            whole = generate(client, args.model, prompt, args.tokens)
            one_call = time.perf_counter() - t
            seq = list(prompt)
            t = time.perf_counter()
            for _ in range(args.tokens):
                seq += generate(client, args.model, seq, 1)
            per_token = time.perf_counter() - t
            rows.append(
                {
                    "one_call_ms_per_token": one_call / args.tokens * 1e3,
                    "calls_ms_per_token": per_token / args.tokens * 1e3,
                    "extra_ms_per_call": (per_token - one_call) / args.tokens * 1e3,
                    "same_tokens": seq[len(prompt) :] == whole,
                }
            )
    table = Table(title=f"{args.model}: {args.tokens} tokens in one call, and one call per token")
    for col in ("round", "one call, ms/token", "a call per token, ms/token", "extra ms per call", "same tokens"):
        table.add_column(col, justify="right")
    for i, row in enumerate(rows, 1):
        table.add_row(
            str(i),
            f"{row['one_call_ms_per_token']:.2f}",
            f"{row['calls_ms_per_token']:.2f}",
            f"{row['extra_ms_per_call']:.2f}",
            "yes" if row["same_tokens"] else "NO",
        )
    console = Console()
    console.print(table)
    median = statistics.median(row["extra_ms_per_call"] for row in rows)
    console.print(f"median extra per call: {median:.2f} ms")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": vars(args), "rounds": rows, "median_extra_ms_per_call": median}, f, indent=2)
    return 0 if all(row["same_tokens"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
