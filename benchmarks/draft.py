"""Side-by-side measurement of a draft with the embedded engine: target-only vs speculative, greedy, concurrency 1.

    python benchmarks/draft.py --config build_configs/demo.yaml --engines /tmp/demo-engines --output draft-bench.json

What it measures, in one process, with the real engine, orchestrator loop and draft-model drafter:

  a. step costs: one greedy decode step of the target and of the draft on a cached sequence, and one target
     verify of k draft tokens (k = 1..max K) relative to a target decode step;
  b. per prompt (held-out chat prompts in the target's chat template), interleaved in a rotating order:
     target-only decoding (the orchestrator with no drafter: one engine call for the whole answer) and
     speculative decoding with K = 1..max K draft tokens; the outputs must be identical (greedy);
     reported per K: acceptance, new tokens per target call, wall time and the speedup over target-only
     (ratio of summed times; the median of per-prompt ratios is also given).

The machine may be shared: each table says how many cores other processes used meanwhile.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import CpuMeter  # benchmarks/common.py, beside this script
from rich.console import Console
from rich.table import Table

from trtspec.contract import GenerationRequest, SamplingParams
from trtspec.distill.data import builtin_prompts, chat_ids
from trtspec.engine.runtime import Engine, InProcessClient
from trtspec.orchestrator.drafters.draft_model import DraftModelDrafter
from trtspec.orchestrator.drafters.prompt_lookup import PromptLookupDrafter
from trtspec.orchestrator.loop import SpecRequest, speculate
from trtspec.orchestrator.stats import RequestStats

NO_END = -1


def med(values):
    return statistics.median(values) if values else float("nan")


# ---- a. step costs --------------------------------------------------------------------------------------------


def step_costs(target: Engine, draft: Engine | None, prompt: list[int], max_k: int, reps: int) -> dict:
    """Median ms of: a target decode step, a draft decode step, a target verify of k drafts (k = 1..max_k),
    each on a sequence whose prefix is cached (as in the loop's steady state), in a rotating order."""

    def pristine(engine: Engine, seq: list[int]):
        engine.cache.clear()
        engine.generate(GenerationRequest(input_ids=seq[:-1], request_output_len=1, end_id=NO_END))
        cache = engine.cache.kept(seq[:-1])
        assert cache is not None
        return copy.deepcopy(cache)

    seq = prompt + target.generate(GenerationRequest(input_ids=prompt, request_output_len=32, end_id=NO_END)).new_tokens
    caches = {"target": pristine(target, seq)} | ({"draft": pristine(draft, seq)} if draft else {})
    times: dict[str, list[float]] = (
        {"target decode": []}
        | ({"draft decode": []} if draft else {})
        | {f"verify k={k}": [] for k in range(1, max_k + 1)}
    )

    def run(name: str) -> float:
        engine = draft if name == "draft decode" else target
        engine.cache.clear()
        engine.cache.keep(seq[:-1], copy.deepcopy(caches["draft" if engine is draft else "target"]))
        k = int(name.split("=")[1]) if name.startswith("verify") else 0
        request = GenerationRequest(
            input_ids=list(seq), request_output_len=k + 1, end_id=NO_END, draft_input_ids=[seq[-1]] * k or None
        )
        start = time.perf_counter()
        engine.generate(request)
        return time.perf_counter() - start

    names = list(times)
    for name in names:
        run(name)  # warm-up
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            times[name].append(run(name))
    base = med(times["target decode"])
    return {
        "context_tokens": len(seq),
        "reps": reps,
        "ms": {n: round(med(t) * 1e3, 2) for n, t in times.items()},
        "ratio_to_target_decode": {n: round(med(t) / base, 3) for n, t in times.items()},
    }


# ---- b. side by side ------------------------------------------------------------------------------------------


def generate(
    target: Engine, draft: Engine | None, prompt: list[int], max_tokens: int, k: int, end_id
) -> tuple[list[int], float, RequestStats]:
    """One greedy answer; the drafter is the draft model, or prompt lookup when `draft` is None."""
    target.cache.clear()
    stats = RequestStats()
    drafter = None
    if k and draft is None:
        drafter = PromptLookupDrafter()
    elif k:
        draft.cache.clear()
        drafter = DraftModelDrafter(InProcessClient(draft), sampling=SamplingParams(), end_id=end_id, pad_id=end_id)
    request = SpecRequest(prompt=prompt, max_tokens=max_tokens, num_draft_tokens=k, end_id=end_id, pad_id=end_id)
    start = time.perf_counter()
    tokens = [t for chunk in speculate(request, InProcessClient(target), drafter, stats=stats) for t in chunk]
    return tokens, time.perf_counter() - start, stats


def side_by_side(
    target: Engine, draft: Engine, prompts: list[list[int]], ks: list[int], max_tokens: int, end_id, console: Console
) -> dict:
    modes = [0] + ks
    seconds = {k: [] for k in modes}
    tokens = {k: 0 for k in modes}
    drafted = {k: 0 for k in modes}
    accepted = {k: 0 for k in modes}
    calls = {k: 0 for k in modes}
    mismatches = []
    for i, prompt in enumerate(prompts):
        generate(target, draft, prompt, 4, 1, end_id)  # warm-up of this prompt's shapes
        outputs = {}
        for k in modes[i % len(modes) :] + modes[: i % len(modes)]:
            out, t, stats = generate(target, draft, prompt, max_tokens, k, end_id)
            outputs[k] = out
            seconds[k].append(t)
            tokens[k] += len(out)
            drafted[k] += stats.num_draft_tokens
            accepted[k] += stats.num_accepted_tokens
            calls[k] += stats.iterations
        mismatches += [(i, k) for k in ks if outputs[k] != outputs[0]]
        console.print(
            f"prompt {i + 1}/{len(prompts)}: {len(outputs[0])} tokens, target-only {seconds[0][-1]:.2f} s; "
            + ", ".join(f"K={k} {seconds[k][-1]:.2f} s" for k in ks),
            highlight=False,
        )
    rows = []
    total0 = sum(seconds[0])
    for k in modes:
        per_prompt = [a / b for a, b in zip(seconds[0], seconds[k])]
        rows.append(
            {
                "k": k,
                "seconds": round(sum(seconds[k]), 2),
                "tokens": tokens[k],
                "ms_per_token": round(sum(seconds[k]) / max(tokens[k], 1) * 1e3, 2),
                "acceptance": round(accepted[k] / drafted[k], 4) if drafted[k] else None,
                "tokens_per_target_call": round(tokens[k] / max(calls[k], 1), 3) if k else None,
                "speedup": round(total0 / sum(seconds[k]), 3),
                "speedup_median_per_prompt": round(med(per_prompt), 3),
            }
        )
    return {
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "rows": rows,
        "outputs_identical": not mismatches,
        "mismatches": mismatches,
    }


# ---- the run --------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--engines",
        type=Path,
        required=True,
        help="engine dir holding target/ and draft/ (built with --config if given)",
    )
    p.add_argument("--config", help="build config to build first (e.g. build_configs/demo.yaml)")
    p.add_argument(
        "--prompts",
        default="builtin:assistant-heldout",
        help='builtin:assistant-heldout or a JSONL file of {"prompt": ...}',
    )
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ks", default="1,2,3,4,5,6", help="draft lengths to measure")
    p.add_argument("--reps", type=int, default=9, help="repetitions of the step-cost measurements")
    p.add_argument("--threads", type=int, help="torch threads [default: torch's]")
    p.add_argument("--device", default="cpu", help="where the engines run: cpu or cuda")
    p.add_argument("--dtype", help="compute dtype of both engines [default: as built]")
    p.add_argument(
        "--drafter",
        choices=("model", "lookup"),
        default="model",
        help="the draft model, or prompt lookup (no draft engine; e.g. code editing)",
    )
    p.add_argument("--costs-only", action="store_true", help="measure the step costs (a.) only")
    p.add_argument("--output", type=Path, default=Path("draft-bench.json"))
    return p.parse_args(argv)


def load_prompts(source: str, n: int) -> list[str]:
    if source.startswith("builtin:"):
        return builtin_prompts(source.split(":", 1)[1], limit=n)
    return [json.loads(line)["prompt"] for line in Path(source).read_text().splitlines() if line.strip()][:n]


def main(argv=None) -> int:
    args = parse_args(argv)
    console = Console()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.config:
        from trtspec.compile import run_build

        run_build(args.config, args.engines, console=console)
    target = Engine.load(args.engines / "target", device=args.device, dtype=args.dtype)
    draft = (
        Engine.load(args.engines / "draft", device=args.device, dtype=args.dtype) if args.drafter == "model" else None
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.engines / "target"))
    texts = load_prompts(args.prompts, args.num_prompts)
    prompts = [chat_ids(tokenizer, t) for t in texts]
    ks = [int(k) for k in args.ks.split(",")]
    end_id = target.eos_token_id

    with CpuMeter() as m_costs:
        costs = step_costs(target, draft, prompts[0], max(ks), args.reps)
    t = Table(
        title=f"a. step costs on a cached {costs['context_tokens']}-token sequence, median of {args.reps} "
        f"(other processes: {m_costs.others_cores:.2f} cores)"
    )
    for col in ("step", "ms", "x target decode"):
        t.add_column(col, justify="right")
    for name, value in costs["ms"].items():
        t.add_row(name, f"{value:.1f}", f"{costs['ratio_to_target_decode'][name]:.3f}")
    console.print(t)

    if args.costs_only:
        args.output.write_text(json.dumps({"threads": torch.get_num_threads(), "step_costs": costs}, indent=2) + "\n")
        return 0
    with CpuMeter() as m_side:
        side = side_by_side(target, draft, prompts, ks, args.max_tokens, end_id, console)
    t = Table(
        title=f"b. greedy, concurrency 1, {side['prompts']} held-out chat prompts, up to {args.max_tokens} tokens, "
        f"interleaved (other processes: {m_side.others_cores:.2f} cores); outputs identical: "
        f"{side['outputs_identical']}"
    )
    for col in ("K", "acceptance", "tokens/target call", "ms/token", "speedup", "median per prompt"):
        t.add_column(col, justify="right")
    for r in side["rows"]:
        t.add_row(
            "target-only" if r["k"] == 0 else str(r["k"]),
            "-" if r["acceptance"] is None else f"{r['acceptance']:.3f}",
            "-" if r["tokens_per_target_call"] is None else f"{r['tokens_per_target_call']:.2f}",
            f"{r['ms_per_token']:.1f}",
            f"{r['speedup']:.3f}x",
            f"{r['speedup_median_per_prompt']:.3f}x",
        )
    console.print(t)
    best = max(side["rows"][1:], key=lambda r: r["speedup"])
    console.print(
        f"best K = {best['k']}: {best['speedup']:.3f}x at acceptance {best['acceptance']:.3f}"
        + (f"; draft step = {costs['ratio_to_target_decode']['draft decode']:.3f} x target step" if draft else "")
    )
    report = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "engines": str(args.engines),
        "threads": torch.get_num_threads(),
        "step_costs": costs | {"other_processes_cores": round(m_costs.others_cores, 2)},
        "side_by_side": side | {"other_processes_cores": round(m_side.others_cores, 2)},
        "best_k": best["k"],
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"report: {args.output}")
    return 0 if side["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
