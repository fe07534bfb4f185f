"""Benchmark of the embedded (torch) engine on the demo target, on CPU.

    python benchmarks/engine.py --engines /tmp/demo-engines --output /tmp/engine-bench.json
    python benchmarks/engine.py --config build_configs/demo.yaml --output report.json   # builds the pair first

What it measures (everything that is compared is measured side by side, interleaved, in one run; the
figures are medians, and ratios are taken within a repetition before the median is taken):

  a. decode: greedy ms per token with the KV cache after a prompt, for the demo target and its variants
     (FP8 or unquantized weights x bfloat16 or float32 compute);
  b. verify: the cost of one `generate` with k = 0..max_draft_len `draft_input_ids` on a cached sequence,
     relative to one decode step (k = 0): the engine's forward pass covers k + 1 tokens;
  c. prefix cache: the orchestrator's request pattern (re-send the whole sequence + k draft tokens every
     iteration) with the engine's prefix KV cache on and off; outputs must be identical;
  d. FP8: greedy token agreement of the FP8 engine with the unquantized one on chat prompts, plus the
     build time and the load time (`Engine.load`) of each.

The unquantized variants are built from the demo target's own checkpoint into a scratch dir.
The machine is shared: the tables say how many cores other processes used while each part ran.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from cpu_meter import CpuMeter, cpu_flags  # benchmarks/cpu_meter.py, beside this script
from rich.console import Console
from rich.table import Table

from trtspec.checkpoint import inspect_checkpoint
from trtspec.compile.torch import build_model, plan
from trtspec.config import BuildConfig, LoadedConfig
from trtspec.contract import GenerationRequest
from trtspec.engine.manifest import read_manifest
from trtspec.engine.runtime import Engine

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of Australia, and why was it chosen?",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for writing clear emails.",
    "Translate 'Where is the train station?' into French and Spanish.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn rain.",
    "How do I reverse a string in JavaScript?",
    "Why is the sky blue?",
    "Suggest a healthy breakfast that takes five minutes to make.",
    "What causes the seasons on Earth?",
    "Write a SQL query that counts the orders of each customer.",
    "Explain what a hash map is and when to use one.",
    "Write a short motivational message for someone starting a new job.",
    "What are the main differences between TCP and UDP?",
    "Convert 72 degrees Fahrenheit to Celsius and show the formula.",
    "Write a limerick about a cat who loves coffee.",
    "Name four planets of the solar system and one fact about each.",
    "How does compound interest work? Give a short example.",
]
BLS_PROMPT = "Explain step by step how a hash map works, then show a short Python implementation of one."
OTHER_DTYPE = {"bfloat16": "float32", "float16": "float32", "float32": "bfloat16"}
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
NO_END = -1  # end_id -1: generate exactly request_output_len tokens


# ---- measuring ------------------------------------------------------------------------------------------------


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def med(values):
    return statistics.median(values) if values else float("nan")


def _deciles(values) -> tuple[float, float]:
    if len(values) < 10:
        return (min(values), max(values)) if values else (float("nan"), float("nan"))
    cuts = statistics.quantiles(values, n=10)
    return cuts[0], cuts[-1]


# ---- engines --------------------------------------------------------------------------------------------------


def build_demo(config: str, engines_dir: Path, console: Console) -> float:
    from trtspec.compile import run_build

    seconds, _ = timed(lambda: run_build(config, engines_dir, console=console))
    return seconds


def target_checkpoint(target_dir: Path) -> tuple[Path, dict]:
    """The checkpoint the demo target was built from and its build settings, from its manifest."""
    manifest = read_manifest(target_dir)
    if manifest is None:
        raise SystemExit(f"{target_dir} has no manifest.json: not an engine built by `trtspec build`")
    files = [Path(s["file"]) for s in manifest["sources"]]
    gguf = [f for f in files if f.suffix == ".gguf"]
    return (gguf[0] if gguf else files[0].parent), manifest


def build_variant(checkpoint: Path, settings: dict, quantization: str, dtype: str, out: Path) -> dict:
    """Build the target checkpoint as one variant engine; returns {seconds, steps, built}."""
    model = dict(settings["model"], checkpoint=str(checkpoint), quantization=quantization, dtype=dtype)
    config = BuildConfig(
        name=f"bench-{quantization}-{dtype}",
        backend="torch",
        target=model,
        engine=settings["engine"],
        speculation=settings["speculation"],
    )
    loaded = LoadedConfig(config, out / "config.yaml", {"target": inspect_checkpoint(checkpoint)})
    (build,) = plan(loaded, out)
    if build.up_to_date:
        manifest = read_manifest(build.output)
        return {
            "dir": str(build.output),
            "built_now": False,
            "seconds": round(sum(manifest["durations_s"].values()), 2),
            "steps_s": manifest["durations_s"],
        }
    seconds, manifest = timed(lambda: build_model(build, config))
    return {
        "dir": str(build.output),
        "built_now": True,
        "seconds": round(seconds, 2),
        "steps_s": manifest["durations_s"],
        "weights_bytes": next(o["bytes"] for o in manifest["outputs"] if o["file"].endswith(".safetensors")),
    }


def chat_ids(tokenizer, text: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(t) for t in ids]


def greedy(engine: Engine, ids: list[int], n: int, end_id: int | None = None):
    return engine.generate(GenerationRequest(input_ids=list(ids), request_output_len=n, end_id=end_id))


def rotate(items: list, i: int) -> list:
    i %= len(items)
    return items[i:] + items[:i]


# ---- a. decode ------------------------------------------------------------------------------------------------


def bench_decode(engines: dict[str, Engine], prompt: list[int], runs: int, tokens: int) -> dict:
    """Per run: every engine prefills the prompt (a one-token request), then the engines take turns, one
    greedy decode step each (a one-token request on the cached sequence, as a plain decoding loop sends
    them), so that bursts of load from other processes fall on all engines alike.
    Reports the median over all steps and the median over runs of each run's mean ms/token."""
    prefill = {name: [] for name in engines}
    steps = {name: [] for name in engines}
    run_means = {name: [] for name in engines}
    for engine in engines.values():  # warm-up: first calls allocate and pick kernels
        engine.cache.clear()
        greedy(engine, prompt, 4, NO_END)
    for run in range(runs):
        seqs = {}
        for name in rotate(list(engines), run):
            engines[name].cache.clear()
            t, first = timed(lambda: greedy(engines[name], prompt, 1, NO_END))
            prefill[name].append(t)
            seqs[name] = first.output_ids
        this_run = {name: [] for name in engines}
        for step in range(tokens):
            for name in rotate(list(engines), run + step):
                t, result = timed(lambda: greedy(engines[name], seqs[name], 1, NO_END))
                assert result.computed_tokens == 1 and result.reused_tokens == len(seqs[name]) - 1, (
                    "not a cached decode step"
                )
                seqs[name] = result.output_ids
                this_run[name].append(t)
        for name, ts in this_run.items():
            steps[name] += ts
            run_means[name].append(statistics.fmean(ts))
    return {
        name: {
            "prefill_ms": round(med(prefill[name]) * 1e3, 1),
            "prefill_ms_runs": [round(v * 1e3, 1) for v in prefill[name]],
            "decode_ms_per_token": round(med(steps[name]) * 1e3, 2),
            "decode_ms_p10_p90": [round(v * 1e3, 2) for v in _deciles(steps[name])],
            "decode_ms_per_token_runs": [round(v * 1e3, 2) for v in run_means[name]],
            "decode_ms_per_token_median_of_run_means": round(med(run_means[name]) * 1e3, 2),
        }
        for name in engines
    } | {"prompt_tokens": len(prompt), "decode_tokens": tokens, "runs": runs}


# ---- b. verify cost -------------------------------------------------------------------------------------------


def bench_verify(engine: Engine, prompt: list[int], context: int, max_k: int, reps: int, seed: int = 0) -> dict:
    """Time one request on a cached sequence with k draft tokens (k = 0: a plain one-token decode step).

    Before each timed request the prefix cache holds exactly the sequence minus its last token (as after the
    previous iteration of a real loop), so the forward pass covers that token plus the k draft tokens.
    The drafts are the target's own greedy continuation from one-token decode steps; the verify pass computes
    them in one multi-token pass, whose rounding may differ, so a near-tie can reject one (recorded)."""
    ref = greedy(engine, prompt, context + max_k, NO_END).new_tokens
    seq, continuation = prompt + ref[:context], ref[context:]
    engine.cache.clear()
    greedy(engine, seq[:-1], 1, NO_END)  # leaves the KV of seq[:-1] in the cache
    pristine = copy.deepcopy(engine.cache.kept(seq[:-1]))
    assert pristine is not None
    times = {k: [] for k in range(max_k + 1)}
    accepted = {k: k for k in times}
    rng = random.Random(seed)

    def run(k: int) -> float:
        engine.cache.clear()
        engine.cache.keep(seq[:-1], copy.deepcopy(pristine))
        request = GenerationRequest(
            input_ids=list(seq), request_output_len=k + 1, end_id=NO_END, draft_input_ids=list(continuation[:k]) or None
        )
        seconds, result = timed(lambda: engine.generate(request))
        assert result.computed_tokens == k + 1 and result.reused_tokens == len(seq) - 1, (k, result)
        accepted[k] = min(accepted[k], result.num_accepted_tokens)
        return seconds

    for k in times:  # warm-up
        run(k)
    for _ in range(reps):
        order = list(times)
        rng.shuffle(order)
        for k in order:
            times[k].append(run(k))
    base = times[0]
    rows = []
    for k, ts in times.items():
        paired = [t / b for t, b in zip(ts, base)]  # within a repetition: robust to drifting load
        ratio = med(paired)
        rows.append(
            {
                "k": k,
                "forward_tokens": k + 1,
                "accepted": accepted[k],
                "ms": round(med(ts) * 1e3, 2),
                "ratio_to_decode": round(ratio, 3),
                "ms_runs": [round(t * 1e3, 2) for t in ts],
                # with a free draft that is always right: tokens per verify / relative cost
                "ideal_speedup_all_accepted": round((k + 1) / ratio, 2),
            }
        )
    return {"context_tokens": len(seq), "reps": reps, "rows": rows}


# ---- c. prefix cache ------------------------------------------------------------------------------------------


class OracleDrafter:
    """A deterministic draft: the target's greedy continuation with each position replaced by a wrong token
    with probability `error` (seeded by position), so that some drafts are rejected and the engine crops."""

    def __init__(self, reference: list[int], prompt_len: int, error: float, vocab: int, seed: int = 0):
        self.reference, self.prompt_len, self.error, self.vocab, self.seed = reference, prompt_len, error, vocab, seed

    def propose(self, seq: list[int], k: int) -> list[int]:
        out = []
        for pos in range(len(seq) - self.prompt_len, len(seq) - self.prompt_len + k):
            token = self.reference[pos] if pos < len(self.reference) else 0
            rng = random.Random(self.seed * 1_000_003 + pos)
            if rng.random() < self.error:
                token = (token + 1 + rng.randrange(self.vocab - 1)) % self.vocab
            out.append(token)
        return out


def run_bls(engine: Engine, prompt: list[int], n_tokens: int, k: int, drafter: OracleDrafter) -> dict:
    """The orchestrator's loop against the engine: every iteration re-sends prompt + generated + k drafts."""
    seq, iterations, computed, reused, drafted, accepted = list(prompt), 0, 0, 0, 0, 0
    start = time.perf_counter()
    while len(seq) - len(prompt) < n_tokens:
        remaining = n_tokens - (len(seq) - len(prompt))
        draft = drafter.propose(seq, min(k, remaining - 1))
        result = engine.generate(
            GenerationRequest(
                input_ids=seq, request_output_len=min(k + 1, remaining), end_id=NO_END, draft_input_ids=draft or None
            )
        )
        seq = result.output_ids
        iterations += 1
        computed += result.computed_tokens
        reused += result.reused_tokens
        drafted += result.num_draft_tokens
        accepted += result.num_accepted_tokens
    return {
        "seconds": time.perf_counter() - start,
        "new_tokens": seq[len(prompt) :],
        "iterations": iterations,
        "computed_tokens": computed,
        "reused_tokens": reused,
        "draft_tokens": drafted,
        "accepted_draft_tokens": accepted,
    }


def bench_prefix_cache(
    engines: dict[str, Engine], demo: str, prompt: list[int], n_tokens: int, k: int, error: float, reps: int
) -> dict:
    """The orchestrator pattern on the demo target with the prefix cache on and off (outputs must be identical),
    and, for every engine in `engines`, plain greedy decoding vs the pattern with the cache on; all runs of a
    repetition interleaved, in rotating order."""
    plain, drafters = {}, {}
    for name, engine in engines.items():  # the reference continuation each engine's oracle drafter follows
        engine.cache.clear()
        plain[name] = greedy(engine, prompt, n_tokens, NO_END).new_tokens
        drafters[name] = OracleDrafter(plain[name], len(prompt), error, engine.info.vocab_size)
    cases = [(demo, "on"), (demo, "off")] + [
        (n, mode) for n in engines for mode in ("plain", "on") if (n, mode) != (demo, "on")
    ]
    runs = {case: [] for case in cases}
    try:
        for rep in range(reps):
            for name, mode in rotate(cases, rep):
                engine = engines[name]
                engine.cache.clear()
                engine.cache.reuse = mode != "off"
                if mode == "plain":
                    seconds, result = timed(lambda: greedy(engine, prompt, n_tokens, NO_END))
                    runs[name, mode].append(
                        {
                            "seconds": seconds,
                            "new_tokens": result.new_tokens,
                            "iterations": n_tokens,
                            "computed_tokens": result.computed_tokens,
                            "reused_tokens": 0,
                            "draft_tokens": 0,
                            "accepted_draft_tokens": 0,
                        }
                    )
                else:
                    runs[name, mode].append(run_bls(engine, prompt, n_tokens, k, drafters[name]))
    finally:
        for engine in engines.values():
            engine.cache.reuse = True
            engine.cache.clear()
    demo_outputs = {tuple(r["new_tokens"]) for mode in ("on", "off") for r in runs[demo, mode]}
    assert len(demo_outputs) == 1, "the prefix cache changed the output: cache on and off disagree"

    def summary(rs: list[dict]) -> dict:
        seconds = med([r["seconds"] for r in rs])
        keys = ("iterations", "computed_tokens", "reused_tokens", "draft_tokens", "accepted_draft_tokens")
        return {
            "seconds": round(seconds, 3),
            "seconds_runs": [round(r["seconds"], 3) for r in rs],
            "ms_per_new_token": round(seconds / n_tokens * 1e3, 1),
        } | {key: rs[-1][key] for key in keys}

    def paired(a, b) -> float:  # median over repetitions of time(a) / time(b)
        return round(med([x["seconds"] / y["seconds"] for x, y in zip(runs[a], runs[b])]), 2)

    on, off = summary(runs[demo, "on"]), summary(runs[demo, "off"])
    return {
        "engine": demo,
        "prompt_tokens": len(prompt),
        "new_tokens": n_tokens,
        "draft_len": k,
        "draft_error_rate": error,
        "reps": reps,
        "outputs_identical": True,
        "output_equals_plain_greedy": list(next(iter(demo_outputs))) == plain[demo],
        "on": on,
        "off": off,
        "speedup_cache_on": paired((demo, "off"), (demo, "on")),
        "computed_tokens_ratio_off_on": round(off["computed_tokens"] / on["computed_tokens"], 1),
        "plain_vs_pattern": {
            name: {
                "plain": summary(runs[name, "plain"]),
                "pattern_cache_on": summary(runs[name, "on"]),
                "pattern_output_equals_plain": runs[name, "on"][-1]["new_tokens"] == plain[name],
                "speedup_pattern_over_plain": paired((name, "plain"), (name, "on")),
            }
            for name in engines
        },
    }


# ---- d. agreement ---------------------------------------------------------------------------------------------


def agreement(reference: list[list[int]], candidate: list[list[int]]) -> dict:
    """Free-running greedy outputs: leading agreement (until the first divergence) and position-wise agreement."""
    total = sum(len(r) for r in reference)
    leading = positional = identical = 0
    for ref, cand in zip(reference, candidate):
        n = 0
        while n < min(len(ref), len(cand)) and ref[n] == cand[n]:
            n += 1
        leading += n
        positional += sum(a == b for a, b in zip(ref, cand))
        identical += ref == cand
    return {
        "until_first_divergence": round(leading / total, 3),
        "overall": round(positional / total, 3),
        "identical_outputs": identical,
        "positions": total,
    }


@torch.inference_mode()
def teacher_forced_choices(engine: Engine, prompt: list[int], text: list[int]) -> list[int]:
    """The engine's greedy choice at each position of `text` when fed prompt + text (one forward pass)."""
    ids = torch.tensor([prompt + text[:-1]], dtype=torch.long, device=engine.device)
    logits = engine.model(input_ids=ids, logits_to_keep=len(text)).logits[0]
    return logits.argmax(-1).tolist()


def bench_agreement(
    free: dict[str, Engine],
    everything: dict[str, Engine],
    pairs: list[tuple[str, str]],
    prompts: list[list[int]],
    tokens: int,
    text_from: str,
) -> dict:
    """Greedy agreement between engines, two ways:
    - free-running: every engine of `free` generates greedily (rotating order per prompt); compared until the
      first divergence and position by position;
    - teacher-forced: every engine is fed the same text (the greedy outputs of `text_from`) in one forward
      pass; the fraction of positions where two engines make the same greedy choice."""
    outputs = {name: [] for name in free}
    seconds = {name: 0.0 for name in free}
    for i, prompt in enumerate(prompts):
        for name in rotate(list(free), i):
            engine = free[name]
            engine.cache.clear()
            t, result = timed(lambda: greedy(engine, prompt, tokens))
            outputs[name].append(result.new_tokens)
            seconds[name] += t
    texts = outputs[text_from]
    choices = {
        name: [teacher_forced_choices(e, p, t) if t else [] for p, t in zip(prompts, texts)]
        for name, e in everything.items()
    }
    positions = sum(map(len, texts))
    results = []
    for cand, ref in pairs:
        row = {"candidate": cand, "reference": ref}
        if cand in outputs and ref in outputs:
            row["free_running"] = agreement(outputs[ref], outputs[cand])
        same = sum(a == b for c, r in zip(choices[cand], choices[ref]) for a, b in zip(c, r))
        row["teacher_forced"] = round(same / positions, 3)
        results.append(row)
    throughput = {
        name: {
            "new_tokens": sum(map(len, outputs[name])),
            "seconds": round(seconds[name], 2),
            "ms_per_token": round(seconds[name] / max(sum(map(len, outputs[name])), 1) * 1e3, 1),
        }
        for name in free
    }
    return {
        "prompts": len(prompts),
        "max_new_tokens": tokens,
        "teacher_forced_text": text_from,
        "teacher_forced_positions": positions,
        "pairs": results,
        "generation": throughput,
    }


# ---- the run --------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--engines",
        type=Path,
        help="engine dir of a built demo pair (holding target/); with --config: where to build it",
    )
    p.add_argument("--config", help="build config to build first (e.g. build_configs/demo.yaml)")
    p.add_argument(
        "--variants-dir",
        type=Path,
        help="where to build the unquantized variants (default: a temporary dir, removed "
        "after the run); builds found there up to date are reused and their recorded build times reported",
    )
    p.add_argument("--output", type=Path, help="write the JSON report here")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--prompts", type=int, default=20, help=f"chat prompts for the FP8 agreement (max {len(PROMPTS)})")
    p.add_argument("--tokens", type=int, default=48, help="max new tokens per prompt for the FP8 agreement")
    p.add_argument("--decode-runs", type=int, default=5)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--verify-reps", type=int, default=7)
    p.add_argument(
        "--verify-context", type=int, default=64, help="generated tokens in the cached sequence before verifying"
    )
    p.add_argument("--bls-tokens", type=int, default=100, help="new tokens of the orchestrator-pattern run")
    p.add_argument("--bls-reps", type=int, default=2)
    p.add_argument(
        "--draft-len", type=int, help="draft tokens per iteration (default: the build's speculation.num_draft_tokens)"
    )
    p.add_argument(
        "--draft-error", type=float, default=0.3, help="chance that a draft token of the oracle drafter is wrong"
    )
    p.add_argument("--load-reps", type=int, default=3)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: decode,verify,prefix,agreement")
    args = p.parse_args(argv)
    if not args.engines and not args.config:
        p.error("give --engines DIR (a built demo pair) or --config FILE (to build one first)")
    args.prompts = max(1, min(args.prompts, len(PROMPTS)))
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console()
    flags = cpu_flags()
    report: dict = {
        "meta": {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "argv": sys.argv[1:] if argv is None else argv,
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "python": platform.python_version(),
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "cpu": _cpu_model(),
            "cpu_bf16_instructions": sorted(f for f in flags if "bf16" in f) or None,
            "avx512": any(f.startswith("avx512") for f in flags),
            "loadavg_start": os.getloadavg(),
        }
    }
    scratch = []
    with CpuMeter() as total:
        engines_dir = args.engines
        if args.config:
            engines_dir = engines_dir or Path(tempfile.mkdtemp(prefix="trtspec-bench-engines-"))
            if not args.engines:
                scratch.append(engines_dir)
            report["demo_build_seconds"] = round(build_demo(args.config, engines_dir, Console(stderr=True)), 1)
        try:
            _run(args, Path(engines_dir) / "target", report, console, scratch)
        finally:
            for d in scratch:
                shutil.rmtree(d, ignore_errors=True)
    report["meta"]["total"] = total.summary()
    report["meta"]["loadavg_end"] = os.getloadavg()
    console.print(
        f"\ntotal {total.seconds:.0f} s; other processes used {total.others_cores:.2f} cores on average meanwhile"
    )
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"report: {args.output}")
    return 0


def _run(args, target_dir: Path, report: dict, console: Console, scratch: list) -> None:
    checkpoint, manifest = target_checkpoint(target_dir)
    settings = manifest["settings"]
    dtype, other = settings["model"]["dtype"], OTHER_DTYPE[settings["model"]["dtype"]]
    quant = settings["model"]["quantization"]
    if quant != "fp8":
        raise SystemExit(f"{target_dir} is not an FP8 engine (quantization {quant}); benchmark the demo pair")
    k_default = args.draft_len or settings["speculation"]["num_draft_tokens"]
    max_k = settings["speculation"]["max_draft_len"]
    report["target"] = {
        "dir": str(target_dir),
        "checkpoint": str(checkpoint),
        "dtype": dtype,
        "quantization": quant,
        "fp8_scaling": settings["model"]["fp8_scaling"],
        "max_draft_len": max_k,
    }
    variants_dir = args.variants_dir or Path(tempfile.mkdtemp(prefix="trtspec-bench-variants-"))
    if not args.variants_dir:
        scratch.append(variants_dir)

    # ---- builds: FP8 and unquantized at the target's dtype, and the unquantized float32 reference ----
    console.rule("builds")
    wanted = [("fp8", dtype), ("none", dtype)] + ([("none", "float32")] if dtype != "float32" else [])
    builds = {}
    with CpuMeter() as meter:
        for q, dt in wanted:
            console.print(f"building {q}/{SHORT[dt]} from {checkpoint.name} ...")
            builds[f"{q}/{SHORT[dt]}"] = build_variant(checkpoint, settings, q, dt, variants_dir / f"{q}-{dt}")
    report["builds"] = builds | {"meter": meter.summary()}

    # ---- loads: FP8 and unquantized at the target dtype, interleaved; then the other-dtype variants ----
    console.rule("loads")
    d, o = SHORT[dtype], SHORT[other]
    names = {
        f"fp8/{d}": (target_dir, None),
        f"none/{d}": (Path(builds[f"none/{d}"]["dir"]), None),
        f"fp8/{o}": (target_dir, other),
    }
    names[f"none/{o}"] = (
        (Path(builds["none/fp32"]["dir"]), None) if other == "float32" else (Path(builds[f"none/{d}"]["dir"]), other)
    )
    load_times = {name: [] for name in names}
    engines: dict[str, Engine] = {}
    with CpuMeter() as meter:
        for rep in range(args.load_reps):
            for name in rotate([f"fp8/{d}", f"none/{d}"], rep):
                path, dt = names[name]
                engines.pop(name, None)
                gc.collect()
                t, engines[name] = timed(lambda: Engine.load(path, dtype=dt))
                load_times[name].append(t)
        for name in (f"fp8/{o}", f"none/{o}"):
            path, dt = names[name]
            t, engines[name] = timed(lambda: Engine.load(path, dtype=dt))
            load_times[name].append(t)
    report["loads"] = {
        name: {
            "seconds": round(med(ts), 2),
            "runs": [round(t, 2) for t in ts],
            "engine": f"{names[name][0]}" + (f" loaded as {names[name][1]}" if names[name][1] else ""),
        }
        for name, ts in load_times.items()
    } | {"meter": meter.summary()}
    _print_builds_loads(console, report, d)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    prompts = [chat_ids(tokenizer, text) for text in PROMPTS[: args.prompts]]
    demo = f"fp8/{d}"
    order = [demo, f"fp8/{o}", f"none/{d}", f"none/{o}"]

    if "decode" not in args.skip:
        console.rule("a. decode")
        with CpuMeter() as meter:
            report["decode"] = bench_decode(
                {n: engines[n] for n in order}, prompts[0], args.decode_runs, args.decode_tokens
            )
        report["decode"]["meter"] = meter.summary()
        _print_decode(console, report["decode"], order, demo)

    if "verify" not in args.skip:
        console.rule("b. verify cost")
        report["verify"] = {}
        for name in (demo, f"fp8/{o}"):
            with CpuMeter() as meter:
                report["verify"][name] = bench_verify(
                    engines[name], prompts[0], args.verify_context, max_k, args.verify_reps
                )
            report["verify"][name]["meter"] = meter.summary()
        _print_verify(console, report["verify"])

    if "prefix" not in args.skip:
        console.rule("c. prefix cache")
        with CpuMeter() as meter:
            report["prefix_cache"] = bench_prefix_cache(
                {demo: engines[demo], f"fp8/{o}": engines[f"fp8/{o}"]},
                demo,
                chat_ids(tokenizer, BLS_PROMPT),
                args.bls_tokens,
                k_default,
                args.draft_error,
                args.bls_reps,
            )
        report["prefix_cache"]["meter"] = meter.summary()
        _print_prefix(console, report["prefix_cache"])

    if "agreement" not in args.skip:
        console.rule("d. FP8 agreement")
        free = {n: engines[n] for n in (demo, f"none/{d}")}
        pairs = [
            (demo, f"none/{d}"),
            (f"fp8/{o}", f"none/{o}"),
            (f"none/{d}", f"none/{o}"),
            (demo, f"fp8/{o}"),
            (demo, "none/fp32") if d != "fp32" else (f"fp8/{o}", "none/fp32"),
        ]
        with CpuMeter() as meter:
            report["fp8_agreement"] = bench_agreement(
                free, {n: engines[n] for n in order}, pairs, prompts, args.tokens, f"none/{d}"
            )
        report["fp8_agreement"]["meter"] = meter.summary()
        _print_agreement(console, report["fp8_agreement"])


# ---- tables ---------------------------------------------------------------------------------------------------


def _table(title: str, *columns: str, meter: dict | None = None) -> Table:
    if meter:
        title += f"  [dim]({meter['seconds']:.0f} s; other processes: {meter['other_processes_cores']:.2f} cores)[/]"
    table = Table(title=title, title_justify="left")
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    return table


def _print_builds_loads(console: Console, report: dict, d: str) -> None:
    t = _table(
        "builds and loads",
        "engine",
        "build s",
        "  load ckpt",
        "  quantize",
        "  write",
        "weights MB",
        "Engine.load s (median)",
        "load runs",
    )
    for name, load in report["loads"].items():
        if name == "meter":
            continue
        b = report["builds"].get(name)
        steps = b["steps_s"] if b else {}
        t.add_row(
            name + (" (demo target)" if name == f"fp8/{d}" else ""),
            (f"{b['seconds']:.1f}" + ("" if b["built_now"] else " (recorded)")) if b else "-",
            str(steps.get("load checkpoint", "-")),
            str(steps.get("quantize fp8", "-")),
            str(steps.get("write engine", "-")),
            f"{b['weights_bytes'] / 2**20:.0f}" if b and "weights_bytes" in b else "-",
            f"{load['seconds']:.2f}",
            " ".join(f"{r:.2f}" for r in load["runs"]),
        )
    console.print(t)
    console.print(f"[dim]builds: {report['builds']['meter']}; loads: {report['loads']['meter']}[/]")


def _print_decode(console: Console, r: dict, order: list[str], demo: str) -> None:
    t = _table(
        f"a. greedy decode with KV cache ({r['prompt_tokens']}-token prompt, {r['decode_tokens']} steps x {r['runs']} "
        "runs, "
        "engines interleaved step by step)",
        "engine",
        "prefill ms",
        "decode ms/token (median step)",
        "vs demo target",
        "tokens/s",
        "step p10-p90 ms",
        "run means ms/token",
        meter=r["meter"],
    )
    base = r[demo]["decode_ms_per_token"]
    for name in order:
        row = r[name]
        t.add_row(
            name + (" (demo target)" if name == demo else ""),
            f"{row['prefill_ms']:.0f}",
            f"{row['decode_ms_per_token']:.1f}",
            f"{row['decode_ms_per_token'] / base:.2f}x",
            f"{1e3 / row['decode_ms_per_token']:.1f}",
            "-".join(f"{v:.0f}" for v in row["decode_ms_p10_p90"]),
            " ".join(f"{v:.0f}" for v in row["decode_ms_per_token_runs"]),
        )
    console.print(t)


def _print_verify(console: Console, results: dict) -> None:
    for name, r in results.items():
        t = _table(
            f"b. verify k draft tokens on a cached {r['context_tokens']}-token sequence, {name} (median of "
            f"{r['reps']})",
            "k",
            "forward tokens",
            "accepted",
            "ms",
            "ratio to decode step",
            "ideal speed-up (all accepted, free draft)",
            meter=r["meter"],
        )
        for row in r["rows"]:
            t.add_row(
                str(row["k"]) + (" (decode step)" if row["k"] == 0 else ""),
                str(row["forward_tokens"]),
                str(row["accepted"]),
                f"{row['ms']:.1f}",
                f"{row['ratio_to_decode']:.2f}",
                f"{row['ideal_speedup_all_accepted']:.2f}",
            )
        console.print(t)


def _print_prefix(console: Console, r: dict) -> None:
    t = _table(
        f"c. orchestrator pattern on {r['engine']}: {r['prompt_tokens']}-token prompt, {r['new_tokens']} new tokens, "
        f"{r['draft_len']} draft tokens/iteration (oracle draft, {r['draft_error_rate']:.0%} of draft tokens wrong), "
        f"median of {r['reps']}",
        "prefix cache",
        "total s",
        "ms/new token",
        "iterations",
        "tokens computed",
        "tokens reused",
        "accepted/drafted",
        meter=r["meter"],
    )
    for mode in ("on", "off"):
        m = r[mode]
        t.add_row(
            mode,
            f"{m['seconds']:.2f}",
            f"{m['ms_per_new_token']:.0f}",
            str(m["iterations"]),
            str(m["computed_tokens"]),
            str(m["reused_tokens"]),
            f"{m['accepted_draft_tokens']}/{m['draft_tokens']}",
        )
    console.print(t)
    console.print(
        f"cache on is {r['speedup_cache_on']:.2f}x faster and computes {r['computed_tokens_ratio_off_on']:.1f}x fewer "
        "tokens; "
        f"outputs identical: {r['outputs_identical']}; equal to plain greedy decoding: "
        f"{r['output_equals_plain_greedy']}"
    )
    t = _table(
        "c'. plain greedy decoding vs the orchestrator pattern (cache on), same oracle draft, interleaved",
        "engine",
        "plain s",
        "plain ms/token",
        "pattern s",
        "pattern ms/token",
        "accepted/drafted",
        "pattern speed-up over plain",
        "same output",
    )
    for name, v in r["plain_vs_pattern"].items():
        p, s = v["plain"], v["pattern_cache_on"]
        t.add_row(
            name,
            f"{p['seconds']:.2f}",
            f"{p['ms_per_new_token']:.0f}",
            f"{s['seconds']:.2f}",
            f"{s['ms_per_new_token']:.0f}",
            f"{s['accepted_draft_tokens']}/{s['draft_tokens']}",
            f"{v['speedup_pattern_over_plain']:.2f}x",
            str(v["pattern_output_equals_plain"]),
        )
    console.print(t)


def _print_agreement(console: Console, r: dict) -> None:
    t = _table(
        f"d. greedy agreement, {r['prompts']} chat prompts, up to {r['max_new_tokens']} new tokens",
        "candidate",
        "reference",
        "until 1st divergence",
        "overall (position-wise)",
        "identical outputs",
        f"teacher-forced ({r['teacher_forced_positions']} positions)",
        meter=r["meter"],
    )
    for row in r["pairs"]:
        f = row.get("free_running")
        t.add_row(
            row["candidate"],
            row["reference"],
            f"{f['until_first_divergence']:.3f}" if f else "-",
            f"{f['overall']:.3f}" if f else "-",
            f"{f['identical_outputs']}/{r['prompts']}" if f else "-",
            f"{row['teacher_forced']:.3f}",
        )
    console.print(t)
    g = _table(
        "d'. generation during the agreement run (interleaved per prompt, prefill included)",
        "engine",
        "new tokens",
        "s",
        "ms/token",
    )
    for name, v in r["generation"].items():
        g.add_row(name, str(v["new_tokens"]), f"{v['seconds']:.1f}", f"{v['ms_per_token']:.1f}")
    console.print(g)


# ---- machine --------------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
