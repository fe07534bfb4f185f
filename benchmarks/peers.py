"""trtspec next to Hugging Face transformers' own speculative decoding, on the same checkpoints, prompts and machine.

    python benchmarks/peers.py --config build_configs/demo.yaml --url 127.0.0.1:8001 --protocol grpc
    python benchmarks/peers.py --config build_configs/demo.yaml --repo /tmp/bench-demo/model_repository

Six ways to generate greedy answers, each measured against its own baseline:

    hf target            model.generate(...)                                         the baseline of hf
    hf assisted          model.generate(..., assistant_model=draft)                  assisted generation
    hf prompt lookup     model.generate(..., prompt_lookup_num_tokens=K)             prompt lookup decoding
    trtspec target       the deployment's tensorrt_llm_bls with num_draft_tokens 0   the baseline of trtspec
    trtspec draft model  num_draft_tokens K (speculation draft_model)
    trtspec prompt lookup  num_draft_tokens K, speculation prompt_lookup (when the deployment has that input)

Hugging Face loads the target and the draft from the checkpoints the build config names (a GGUF through
transformers' gguf_file; a draft that shares the target's tensors assembled as `trtspec build` does), in the
process, on this machine's CPU, each in the compute dtype the build config gives it. Assisted generation drafts
a constant K tokens (num_assistant_tokens=K, schedule "constant", assistant_confidence_threshold 0: no early stop),
and trtspec is asked for a fixed K too (adaptive_draft_length false), so both draft the same number of tokens.
trtspec's runs go through a tritonserver: the one at --url, or one started here on --repo.

The runs are interleaved: each prompt is one round, in which every method generates once, in a shuffled order, so
the machine's noise falls on all of them alike. Every generation's prompt starts with its own number ("#4817203 "),
for transformers and trtspec alike, so that no trtspec run finds the prompt of another method's run in the
engines' prefix KV cache (transformers keeps no cache across calls): every run pays its own prefill. The answers
of a method and of its baseline therefore differ a little; that speculation leaves greedy outputs unchanged is
what `trtspec validate outputs` checks. Figures: output tokens / seconds over all rounds; speedup = that of a
method / that of its own baseline; paired median: the median over prompts of the same ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from trtspec.bench import environment, finish_environment, load_prompt_set, table_console, write_report
from trtspec.client import SpecClient
from trtspec.config import load_config

HF_TARGET, HF_ASSISTED, HF_LOOKUP = "hf target", "hf assisted", "hf prompt lookup"
TS_TARGET, TS_DRAFT, TS_LOOKUP = "trtspec target", "trtspec draft model", "trtspec prompt lookup"
BASELINE = {
    HF_TARGET: HF_TARGET,
    HF_ASSISTED: HF_TARGET,
    HF_LOOKUP: HF_TARGET,
    TS_TARGET: TS_TARGET,
    TS_DRAFT: TS_TARGET,
    TS_LOOKUP: TS_TARGET,
}


class HuggingFace:
    """The target and the draft in transformers, greedy, batch size 1."""

    def __init__(self, config_path: str, dtype: str | None = None):
        from trtspec.checkpoint import load_model, load_tokenizer

        loaded = load_config(config_path)

        def dtype_of(role: str):  # the build config's compute dtype of the model, unless one is forced
            return getattr(torch, dtype or getattr(loaded.config, role).dtype)

        self.tokenizer = load_tokenizer(loaded.checkpoints["target"])
        self.target = load_model(loaded.checkpoints["target"], dtype_of("target"))
        draft = loaded.checkpoints.get("draft")
        self.draft = load_model(draft, dtype_of("draft")) if draft is not None else None
        self.same_checkpoint = draft is not None and draft.path == loaded.checkpoints["target"].path

    def generate(self, text: str, max_tokens: int, **options) -> tuple[list[int], float]:
        start = time.perf_counter()
        inputs = self.tokenizer(text, return_tensors="pt", add_special_tokens=True)
        with torch.inference_mode():
            out = self.target.generate(
                **inputs,
                max_new_tokens=max_tokens,
                do_sample=False,
                num_beams=1,
                pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
                **options,
            )
        seconds = time.perf_counter() - start
        return out[0, inputs["input_ids"].shape[1] :].tolist(), seconds

    def options(self, method: str, k: int) -> dict:
        if method == HF_ASSISTED:
            return {
                "assistant_model": self.draft,
                "num_assistant_tokens": k,
                "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.0,
            }
        if method == HF_LOOKUP:
            return {"prompt_lookup_num_tokens": k}
        return {}


def chat(tokenizer, prompt: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return prompt


def run(args, console: Console) -> dict:
    hf = HuggingFace(args.config, args.hf_dtype)
    prompts = load_prompt_set(args.prompts)[: args.num_prompts]
    number = iter(range(random.SystemRandom().randrange(10_000, 100_000) * 100, 10**9))

    def text(i: int) -> str:
        return chat(hf.tokenizer, f"#{next(number)} {prompts[i]}")

    server = None
    if args.url is None:
        from trtspec.server import TritonServer, free_port

        server = TritonServer(args.repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
        with console.status("starting tritonserver…"):
            server.start(timeout=600)
        url = server.grpc_url if args.protocol == "grpc" else server.http_url
    else:
        url = args.url
    client = SpecClient(url, protocol=args.protocol, timeout=1200)
    try:
        inputs = [i["name"] for i in client.model_config("tensorrt_llm_bls").get("input", [])]
        fixed = {"adaptive_draft_length": False} if "adaptive_draft_length" in inputs else {}
        methods = [HF_TARGET, HF_LOOKUP, TS_TARGET, TS_DRAFT]
        if hf.draft is not None:
            methods.append(HF_ASSISTED)
        if "speculation" in inputs:
            methods.append(TS_LOOKUP)

        def once(method: str, text: str, max_tokens: int) -> dict:
            if method.startswith("hf"):
                ids, seconds = hf.generate(text, max_tokens, **hf.options(method, args.num_draft_tokens))
                return {"token_ids": ids, "seconds": seconds}
            k = 0 if method == TS_TARGET else args.num_draft_tokens
            extra = {"speculation": "prompt_lookup"} if method == TS_LOOKUP else {}
            c = client.generate(text, max_tokens=max_tokens, num_draft_tokens=k, **fixed, **extra)
            return {"token_ids": c.token_ids, "seconds": c.seconds, "accepted": c.accepted, "drafted": c.drafted}

        with console.status("warming up…"):
            for method in methods:
                once(method, text(0), 8)
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for i in range(len(prompts)):
            order = list(methods)
            random.Random(args.seed + i).shuffle(order)
            for method in order:
                with console.status(f"prompt {i + 1}/{len(prompts)}: {method}"):
                    runs[method].append(once(method, text(i), args.max_tokens) | {"prompt": i})
    finally:
        client.close()
        if server is not None:
            server.stop()
    return {"methods": summarize(runs), "runs": runs, "same_checkpoint": hf.same_checkpoint, "url": url}


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    order = [HF_TARGET, HF_ASSISTED, HF_LOOKUP, TS_TARGET, TS_DRAFT, TS_LOOKUP]
    for method, results in sorted(runs.items(), key=lambda item: order.index(item[0])):
        base = runs[BASELINE[method]]
        tokens = sum(len(r["token_ids"]) for r in results)
        seconds = sum(r["seconds"] for r in results)
        base_tps = sum(len(r["token_ids"]) for r in base) / sum(r["seconds"] for r in base)
        paired = [
            (len(r["token_ids"]) / r["seconds"]) / (len(b["token_ids"]) / b["seconds"]) for r, b in zip(results, base)
        ]
        accepted = sum(r.get("accepted") or 0 for r in results)
        drafted = sum(r.get("drafted") or 0 for r in results)
        rows.append(
            {
                "method": method,
                "baseline": BASELINE[method],
                "runs": len(results),
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "speedup": tokens / seconds / base_tps,
                "median_paired_speedup": statistics.median(paired),
                "drafted": drafted if method.startswith("trtspec") else None,
                "acceptance_rate": accepted / drafted if drafted else None,
            }
        )
    return rows


def render(report: dict, console: Console) -> None:
    s = report["settings"]
    table = Table(
        title=f"speculative decoding, each against its own baseline: {s['num_prompts']} prompts "
        f"({s['prompts']}), {s['max_tokens']} tokens, K = {s['num_draft_tokens']}, greedy, batch 1"
    )
    for col in ("method", "tok/s", "speedup", "paired median", "acceptance"):
        table.add_column(col, justify="right" if col != "method" else "left")
    for row in report["methods"]:
        base = row["method"] == row["baseline"]
        table.add_row(
            row["method"],
            f"{row['tokens_per_s']:.2f}",
            "1.00x (baseline)" if base else f"{row['speedup']:.2f}x",
            "-" if base else f"{row['median_paired_speedup']:.2f}x",
            "no drafts"
            if row.get("drafted") == 0 and not base
            else "-"
            if row["acceptance_rate"] is None
            else f"{row['acceptance_rate']:.0%}",
        )
    console.print(table)
    if report["same_checkpoint"]:
        console.print(
            "The build config's draft is the target's own checkpoint: every draft token is accepted and each "
            "costs a full target step.",
            style="dim",
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="build_configs/demo.yaml", help="build config naming the checkpoints")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="host:port of a server already serving the config's deployment")
    where.add_argument("--repo", help="model repository (from `trtspec deploy`) to serve here")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--prompts", default="builtin:chat")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument(
        "--hf-dtype",
        choices=("float32", "bfloat16"),
        help="transformers' compute dtype for both models [default: each model's dtype in the build config]",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", help="JSON report")
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    env, started = environment(), time.perf_counter()
    result = run(args, console)
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "settings": {
            "config": args.config,
            "prompts": args.prompts,
            "num_prompts": args.num_prompts,
            "max_tokens": args.max_tokens,
            "num_draft_tokens": args.num_draft_tokens,
            "hf_dtype": args.hf_dtype,
            "protocol": args.protocol,
            "url": result["url"],
        },
        "environment": finish_environment(env, started) | {"torch_threads": torch.get_num_threads()},
        "same_checkpoint": result["same_checkpoint"],
        "methods": result["methods"],
        "runs": result["runs"],
    }
    render(report, table_console())
    if args.output:
        console.print(f"report: {write_report(report, args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
