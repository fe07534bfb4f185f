"""The embedded engine's speed against the memory-bandwidth bound, against the Hugging Face eager forward, and
under in-flight batching, on a built pair (the demo pair by default).

    python benchmarks/engine_speed.py --engines /tmp/demo-engines --output engine-speed.json

Every repetition measures, interleaved, so that the machine's noise hits all of them alike:
  a. bandwidth: a 256 MiB float32 copy (`copy_`, read + written bytes, as STREAM counts) and a read (`sum`), on
     the pages the engine keeps its weights on (2 MiB pages where the machine gives them);
     and the CPU product's multiply-adds per second on weights in cache (the roofline's compute side);
  b. the decode step (one row on a cached 106-token sequence) of the compact forward and of the Hugging Face
     eager forward, for the target and the draft; the bound is the weight bytes the step reads (as the
     engine keeps them: FP8 codes are 1 byte) / read bandwidth;
  c. passes of k+1 rows (k = 1..8 draft tokens) on the same cache, in decode steps of the same repetition;
  d. target-only generation of 32 tokens by C = 1, 4, 8 requests at once (the scheduler batches them), in
     process and, with --url, sent at once to a served `tensorrt_llm` model over gRPC;
  e. the draft's decode step as the draft-then-verify loop runs it: right after a target step of two rows (a
     verification at K=1), which leaves the caches holding the target's weights, against back to back;
  f. the target's decode step at long contexts (--long-contexts), its KV cache in the dtype the engine keeps it
     (and passes of LONG_ROWS rows on that cache: a verification's cost where attention weighs most)
     (bfloat16 for a bfloat16 build) against float32, side by side;
  g. greedy generation of --generate tokens by one request from a single token, each step's token picked from
     its logits, the model's own loop without the scheduler: what llama.cpp's `llama-bench -n 128 -p 0` (tg128)
     measures, so that the two compare directly.
Ratios are taken within a repetition, then the median over repetitions is reported.
$TRTSPEC_CPU_ISA=avx2 measures the AVX2 kernels on an AVX-512 machine; $TRTSPEC_FP8_WEIGHTS=bf16 the FP8 weights
kept as bfloat16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import cpu_flags  # benchmarks/common.py, beside this script
from rich.console import Console
from rich.table import Table

from trtspec.contract import GenerationRequest
from trtspec.engine import hugepages
from trtspec.engine.model import Segment
from trtspec.engine.runtime import Engine

CONTEXT = 106


def bandwidth(mib: int = 256) -> dict[str, float]:
    """Copy and read rates on the pages the engine keeps its weights on (hugepages.place: 2 MiB pages where the
    machine gives them, which read faster than 4 KiB ones)."""
    src, dst = hugepages.place([torch.ones(mib * 2**18), torch.empty(mib * 2**18)])[0]
    dst.copy_(src)
    copies, reads = [], []
    for _ in range(3):
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t)
        t = time.perf_counter()
        src.sum()
        reads.append(time.perf_counter() - t)
    nbytes = src.numel() * 4
    return {
        "copy_gbs": 2 * nbytes / statistics.median(copies) / 1e9,
        "read_gbs": nbytes / statistics.median(reads) / 1e9,
    }


def kernel_fma_rate(rows_dtype: torch.dtype, rows: int = 12, reps: int = 50) -> float:
    """Multiply-adds per second of trtspec's CPU product on weights that stay in cache (the demo target's q/k/v
    shape, FP8 codes, rows of `rows_dtype` as the model's products take them), `rows` rows at a time: the
    compute side of the roofline."""
    from trtspec.engine import fp8, kernels

    weight, scale = fp8.quantize(torch.randn(960, 576))
    linear = kernels.PackedLinear(weight, None, scale=scale, storage="e4m3", rows=rows_dtype)
    x = torch.randn(rows, 576)
    linear(x)
    t = time.perf_counter()
    for _ in range(reps):
        linear(x)
    return rows * weight.numel() * reps / (time.perf_counter() - t)


def pass_times(model, ids: list[int], ks: list[int], steps: int) -> dict[int, float]:
    """Median seconds of a pass of k+1 rows at position CONTEXT on a cache that holds ids[:CONTEXT]."""
    kv = model.new_kv(CONTEXT + max(ks) + 1)
    model.forward([Segment(ids[:CONTEXT], 0, kv, 1)])
    out = {}
    for k in ks:
        rows = ids[CONTEXT : CONTEXT + k + 1]
        times = []
        for _ in range(steps if k == 0 else max(2, steps // 3)):
            t = time.perf_counter()
            model.forward([Segment(rows, CONTEXT, kv, k + 1)])
            times.append(time.perf_counter() - t)
        out[k] = statistics.median(times)
    return out


def draft_in_loop(target, draft, ids: list[int], steps: int) -> dict[str, float]:
    """Median seconds of the draft's decode step back to back and right after a target pass of 2 rows, and of
    that target pass, each on its own cache at position CONTEXT (what one iteration at K=1 computes)."""
    kv_t, kv_d = target.new_kv(CONTEXT + 2 * steps + 2), draft.new_kv(CONTEXT + 2 * steps + 2)
    target.forward([Segment(ids[:CONTEXT], 0, kv_t, 1)])
    draft.forward([Segment(ids[:CONTEXT], 0, kv_d, 1)])
    hot, after, verify = [], [], []
    for i in range(steps):
        p = CONTEXT + 2 * i
        t = time.perf_counter()
        draft.forward([Segment(ids[p : p + 1], p, kv_d, 1)])
        hot.append(time.perf_counter() - t)
        t = time.perf_counter()
        target.forward([Segment(ids[p : p + 2], p, kv_t, 2)])
        verify.append(time.perf_counter() - t)
        t = time.perf_counter()
        draft.forward([Segment(ids[p + 1 : p + 2], p + 1, kv_d, 1)])
        after.append(time.perf_counter() - t)
    return {
        "hot": statistics.median(hot),
        "after_target": statistics.median(after),
        "verify": statistics.median(verify),
    }


LONG_ROWS = (2, 5, 9)


def long_context_steps(model, ids: list[int], contexts: list[int], steps: int) -> dict[int, dict[str, float]]:
    """Median seconds of a decode step after `context` tokens, per context, with the KV cache as the model keeps
    it ("kept") and in float32 (the same kernels; only the cache's element differs); and of a pass of each of
    LONG_ROWS rows at that position on the kept cache (key `rows`)."""
    out = {}
    for context in contexts:
        caches = {}
        for name, dtype in (("kept", model.kv_dtype), ("float32", torch.float32)):
            kv = torch.zeros_like(model.new_kv(context + max(steps, *LONG_ROWS)), dtype=dtype)
            model.forward([Segment(ids[:context], 0, kv, 1)])
            caches[name] = kv
        times = {name: [] for name in caches}
        for i in range(steps):  # interleaved, so drift hits both alike
            for name, kv in caches.items():
                t = time.perf_counter()
                model.forward([Segment(ids[context + i : context + i + 1], context + i, kv, 1)])
                times[name].append(time.perf_counter() - t)
        out[context] = {name: statistics.median(v) for name, v in times.items()}
        passes = {n: [] for n in LONG_ROWS}
        for _ in range(max(2, steps // 3)):
            for n in LONG_ROWS:
                t = time.perf_counter()
                model.forward([Segment(ids[context : context + n], context, caches["kept"], n)])
                passes[n].append(time.perf_counter() - t)
        out[context]["rows"] = {n: statistics.median(v) for n, v in passes.items()}
    return out


def greedy_rate(model, first: int, tokens: int) -> float:
    """Tokens/s of greedy generation of `tokens` tokens from the single token `first` at position 0, one row a
    step (llama-bench's tg: no prompt to process, then one token at a time)."""
    kv = model.new_kv(tokens + 1)
    token = first
    t = time.perf_counter()
    for pos in range(tokens):
        # the engine's greedy pick (sampling.select): numpy's argmax, not torch's, which wakes its thread pool
        token = int(model.forward([Segment([token], pos, kv, 1)])[0][-1].numpy().argmax())
    return tokens / (time.perf_counter() - t)


def batched_rate(engine: Engine, prompts: list[list[int]], concurrency: int, tokens: int) -> float:
    """Aggregate tokens/s of `concurrency` target-only requests run together (fresh prompts: no reuse)."""
    requests = [GenerationRequest(input_ids=p, request_output_len=tokens, end_id=-1) for p in prompts[:concurrency]]
    t = time.perf_counter()
    results = engine.generate_many(requests)
    return sum(len(r.new_tokens) for r in results) / (time.perf_counter() - t)


def served_rate(url: str, prompts: list[list[int]], concurrency: int, tokens: int) -> float:
    """The same through Triton: `concurrency` requests sent at once to the `tensorrt_llm` model (gRPC)."""
    import concurrent.futures as cf

    from trtspec.client import SpecClient
    from trtspec.contract import request_to_tensors

    def one(prompt: list[int]) -> int:
        # SpecClient.infer: a plain infer, or a gRPC stream for decoupled engine models (the default deployment)
        with SpecClient(url, protocol="grpc", timeout=600) as client:
            out = client.infer(
                "tensorrt_llm",
                request_to_tensors(GenerationRequest(input_ids=prompt, request_output_len=tokens, end_id=-1)),
                ["sequence_length"],
            )
        return int(out["sequence_length"].reshape(-1)[0]) - len(prompt)

    t = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        total = sum(pool.map(one, prompts[:concurrency]))
    return total / (time.perf_counter() - t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=Path, required=True, help="engine dir holding target/ (and draft/)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=9, help="decode steps timed per repetition")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32, help="tokens per request in the batching part")
    p.add_argument("--generate", type=int, default=128, help="tokens of the greedy generation part (0: skip it)")
    p.add_argument(
        "--url",
        help="gRPC address of a server running this pair's repository (e.g. 127.0.0.1:8001): "
        "also measure part d through Triton",
    )
    p.add_argument("--long-contexts", default="900,1800", help="contexts of part f (comma-separated; empty: skip it)")
    p.add_argument("--output", type=Path)
    args = p.parse_args(argv)
    contexts = [int(c) for c in args.long_contexts.split(",") if c.strip()]
    torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    roles = [r for r in ("target", "draft") if (args.engines / r / "config.json").is_file()]
    engines = {}
    for role in roles:
        engines[role, "compact"] = Engine.load(args.engines / role)
        engines[role, "hf"] = Engine.load(args.engines / role, forward="hf")
    target = engines["target", "compact"]
    vocab = target.info.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (max([CONTEXT, *contexts]) + 2 * args.steps + 9,), generator=gen).tolist()
    prompts = [torch.randint(0, vocab, (40,), generator=gen).tolist() for _ in range(8 * (args.reps + 1))]
    ks = list(range(0, 9))
    reps = []
    with torch.inference_mode():
        batched_rate(target, prompts[:8], 8, 4)  # warm-up
        for rep in range(args.reps):
            console.print(f"repetition {rep + 1}/{args.reps}")
            r = {
                "bandwidth": bandwidth(),
                "passes": {},
                "rates": {},
                "fma_rate": kernel_fma_rate(target.model.rows_dtype),
            }
            for (role, forward), engine in engines.items():
                r["passes"][f"{role}/{forward}"] = pass_times(
                    engine.model, ids, ks if role == "target" else [0], args.steps
                )
            if "draft" in roles:
                r["loop"] = draft_in_loop(target.model, engines["draft", "compact"].model, ids, args.steps)
            if args.generate:
                r["greedy"] = greedy_rate(target.model, ids[0], args.generate)
            if contexts and hasattr(target.model, "kv_dtype"):
                r["long"] = long_context_steps(target.model, ids, contexts, args.steps)
            batch = prompts[8 * (rep + 1) : 8 * (rep + 2)]
            for c in (1, 4, 8):
                r["rates"][c] = batched_rate(target, batch, c, args.tokens)
                if args.url:
                    r.setdefault("served", {})[c] = served_rate(
                        args.url, [[t + 1 for t in p] for p in batch], c, args.tokens
                    )
            r["bandwidth_after"] = bandwidth()
            reps.append(r)

    def median(fn):
        return statistics.median(fn(r) for r in reps)

    def read_gbs(r):  # the best read bandwidth seen around a repetition
        return max(r["bandwidth"]["read_gbs"], r["bandwidth_after"]["read_gbs"])

    read = median(read_gbs)
    model = target.model
    report = {
        "command": "python " + " ".join(sys.argv),
        "threads": args.threads,
        "reps": args.reps,
        "batch_invariant": target.batch_invariant,
        "linears": getattr(model, "kernel_summary", model.linear_kind),
        "cpu_flags": sorted(f for f in cpu_flags() if f.startswith("avx")),
        "copy_gbs": median(lambda r: max(r["bandwidth"]["copy_gbs"], r["bandwidth_after"]["copy_gbs"])),
        "read_gbs": read,
        "models": {},
    }
    for role in roles:
        wb = engines[role, "compact"].model.weight_bytes
        name = f"{role}/compact"
        report["models"][role] = {
            "weight_mb": wb / 1e6,
            "decode_ms": median(lambda r: r["passes"][name][0]) * 1e3,
            "eager_decode_ms": median(lambda r: r["passes"][f"{role}/hf"][0]) * 1e3,
            "eager_over_compact": median(lambda r: r["passes"][f"{role}/hf"][0] / r["passes"][name][0]),
            "bound_ms": wb / (read * 1e9) * 1e3,
            # the bound of each repetition: the weight bytes a step reads over the read bandwidth around it
            "decode_over_bound": median(lambda r: r["passes"][name][0] / (wb / (read_gbs(r) * 1e9))),
            "tokens_per_s": 1 / median(lambda r: r["passes"][name][0]),
        }
    # The roofline: rows at which a pass's multiply-adds (rows x weights at the kernel's in-cache rate) take
    # as long as reading its weights once; below it a pass costs about one decode step.
    fma = median(lambda r: r["fma_rate"])
    weights = sum(lin.n_padded * lin.k for layer in model.layers for lin in layer.values() if hasattr(lin, "n_padded"))
    weights += getattr(model.head, "n_padded", 0) * getattr(model.head, "k", 0)
    report["roofline"] = {
        "fma_per_s": fma,
        "weights": weights,
        "rows": fma * report["models"]["target"]["weight_mb"] * 1e6 / weights / (read * 1e9),
    }
    for forward in ("compact", "hf"):
        name = f"target/{forward}"
        report[f"passes_{forward}"] = {
            k + 1: median(lambda r: r["passes"][name][k] / r["passes"][name][0]) for k in ks[1:]
        }
    if args.generate:
        report["greedy"] = {"tokens": args.generate, "tokens_per_s": median(lambda r: r["greedy"])}
    report["rates"] = {c: median(lambda r: r["rates"][c]) for c in (1, 4, 8)}
    report["rate_ratio"] = {c: median(lambda r: r["rates"][c] / r["rates"][1]) for c in (1, 4, 8)}
    if args.url:
        report["served_rates"] = {c: median(lambda r: r["served"][c]) for c in (1, 4, 8)}
        report["served_ratio"] = {c: median(lambda r: r["served"][c] / r["served"][1]) for c in (1, 4, 8)}
    if "draft" in roles:
        loop = report["draft_in_loop"] = {}
        for key in ("hot", "after_target", "verify"):
            loop[f"{key}_ms"] = median(lambda r: r["loop"][key]) * 1e3
            loop[f"{key}_in_target_steps"] = median(lambda r: r["loop"][key] / r["passes"]["target/compact"][0])
    if reps and "long" in reps[0]:
        report["long_context"] = {
            "kv_dtype": str(model.kv_dtype).removeprefix("torch."),
            "kv_bytes_per_token": model.kv_bytes_per_token,
            "contexts": {
                c: {
                    "kept_ms": median(lambda r: r["long"][c]["kept"]) * 1e3,
                    "float32_ms": median(lambda r: r["long"][c]["float32"]) * 1e3,
                    "ratio": median(lambda r: r["long"][c]["kept"] / r["long"][c]["float32"]),
                    "passes_in_steps": {
                        n: median(lambda r: r["long"][c]["rows"][n] / r["long"][c]["kept"]) for n in LONG_ROWS
                    },
                }
                for c in contexts
            },
        }
    report["batching"] = vars(target.stats.batching)
    _print(Console(), report)
    if args.output:
        args.output.write_text(json.dumps(report, indent=2))
    return 0


def _print(console: Console, r: dict) -> None:
    t = Table(
        title=f"decode step vs the bandwidth bound (read {r['read_gbs']:.1f} GB/s, copy {r['copy_gbs']:.1f} GB/s; "
        f"{', '.join(r['cpu_flags'])}; linears {r['linears']}; batch-invariant {r['batch_invariant']})"
    )
    for col in (
        "model",
        "weights MB read",
        "decode ms",
        "tok/s",
        "bound ms",
        "decode / bound",
        "HF eager ms",
        "eager / compact",
    ):
        t.add_column(col, justify="right")
    for role, m in r["models"].items():
        t.add_row(
            role,
            f"{m['weight_mb']:.0f}",
            f"{m['decode_ms']:.2f}",
            f"{m['tokens_per_s']:.0f}",
            f"{m['bound_ms']:.2f}",
            f"{m['decode_over_bound']:.2f}x",
            f"{m['eager_decode_ms']:.1f}",
            f"{m['eager_over_compact']:.2f}x",
        )
    console.print(t)
    rf = r["roofline"]
    console.print(
        f"roofline (target): the kernel's in-cache rate {rf['fma_per_s'] / 1e9:.0f} G multiply-adds/s over "
        f"{rf['weights'] / 1e6:.0f} M weights of {r['models']['target']['weight_mb']:.0f} MB: a pass is "
        f"memory-bound up to {rf['rows']:.1f} rows"
    )
    t = Table(title="a pass of k+1 rows, in decode steps (target)")
    t.add_column("forward")
    for k in r["passes_compact"]:
        t.add_column(f"{k} rows", justify="right")
    for forward in ("compact", "hf"):
        t.add_row(forward, *(f"{v:.2f}" for v in r[f"passes_{forward}"].values()))
    console.print(t)
    if "draft_in_loop" in r:
        d = r["draft_in_loop"]
        t = Table(
            title="one iteration at K=1: the draft's decode step back to back and right after a target pass of 2 "
            "rows, and that pass"
        )
        for col in ("", "ms", "in target decode steps"):
            t.add_column(col, justify="right")
        t.add_row("back to back", f"{d['hot_ms']:.1f}", f"{d['hot_in_target_steps']:.3f}")
        t.add_row("after a target pass", f"{d['after_target_ms']:.1f}", f"{d['after_target_in_target_steps']:.3f}")
        t.add_row("the target pass of 2 rows", f"{d['verify_ms']:.1f}", f"{d['verify_in_target_steps']:.3f}")
        console.print(t)
    if "greedy" in r:
        g = r["greedy"]
        console.print(
            f"greedy generation of {g['tokens']} tokens from one token, one request, in process (llama-bench's "
            f"tg{g['tokens']}): {g['tokens_per_s']:.1f} tok/s"
        )
    if "long_context" in r:
        lc = r["long_context"]
        t = Table(
            title=f"decode step at long contexts (target): the KV cache as kept ({lc['kv_dtype']}) against float32"
        )
        rows = "/".join(str(n) for n in LONG_ROWS)
        for col in ("context", "KV MB read as kept", "ms as kept", "ms float32", "kept / float32", f"{rows} rows"):
            t.add_column(col, justify="right")
        for c, m in lc["contexts"].items():
            t.add_row(
                str(c),
                f"{c * lc['kv_bytes_per_token'] / 1e6:.1f}",
                f"{m['kept_ms']:.2f}",
                f"{m['float32_ms']:.2f}",
                f"{m['ratio']:.2f}x",
                " / ".join(f"{v:.2f}" for v in m["passes_in_steps"].values()) + " steps",
            )
        console.print(t)
    t = Table(title="target-only, requests generating together (in-flight batching)")
    for col in ("concurrency", "in process tok/s", "vs concurrency 1") + (
        ("through Triton tok/s", "vs concurrency 1") if "served_rates" in r else ()
    ):
        t.add_column(col, justify="right")
    for c, rate in r["rates"].items():
        served = (f"{r['served_rates'][c]:.1f}", f"{r['served_ratio'][c]:.2f}x") if "served_rates" in r else ()
        t.add_row(str(c), f"{rate:.1f}", f"{r['rate_ratio'][c]:.2f}x", *served)
    console.print(t)


if __name__ == "__main__":
    sys.exit(main())
