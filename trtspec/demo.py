"""`trtspec demo`: the whole path on the embedded default, end to end, leaving nothing running.

build the demo pair -> deploy a model repository -> serve it with tritonserver -> stream answers ->
compare target-only and speculative outputs token by token -> one summary table.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trtspec.build import run_build
from trtspec.config import load_config
from trtspec.repository import write_repository
from trtspec.server import TritonServer, free_port

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain in three sentences why the sky is blue.",
    "List five tips for writing clear technical documentation.",
    "What is the difference between a list and a tuple in Python?",
]


def run_demo(config_path: str, workdir: Path, *, max_tokens: int = 64, num_draft_tokens: int | None = None) -> int:
    from transformers import AutoTokenizer

    from trtspec.client import SpecClient
    from trtspec.validate import Tokens, run_validation

    console = Console()
    loaded = load_config(config_path)
    config = loaded.config
    k = num_draft_tokens if num_draft_tokens is not None else config.speculation.num_draft_tokens
    workdir = workdir.resolve()
    engines = run_build(config_path, workdir / "engines", console=console)
    repo = write_repository(loaded, engines, workdir / "model_repository", force=True)
    console.print(f"model repository in {repo}")
    self_draft = config.draft is not None and config.draft.checkpoint == config.target.checkpoint

    tokenizer = AutoTokenizer.from_pretrained(str(engines / "target"))
    prompts = [_chat(tokenizer, p) for p in PROMPTS]
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    with console.status("starting tritonserver (loads both engines)…"):
        server.start()
    try:
        with SpecClient(server.grpc_url, protocol="grpc") as client:
            for question, prompt in zip(PROMPTS[:2], prompts[:2]):
                console.rule(f"[bold]{question}")
                client.generate(prompt, max_tokens=max_tokens, num_draft_tokens=k, stream=True,
                                on_chunk=lambda chunk: console.print(chunk.text, end="", markup=False, highlight=False))
                console.print()
            console.rule("target-only vs speculative, greedy, side by side")
            with console.status("comparing…") as status:
                # the deployment's default draft length (adaptive), as a request gets it
                report = run_validation(client, prompts, [k], max_tokens=max_tokens, fixed_k=False,
                                        tokens=Tokens(client, engines / "target"), progress=status.update)
    finally:
        server.stop()
    return _summary(console, report, self_draft, workdir)


def _chat(tokenizer, question: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return question


def _summary(console: Console, report, self_draft: bool, workdir: Path) -> int:
    result = report.results[0]
    plain, spec = result.baseline_tokens_per_second, result.tokens_per_second
    speedup = spec / plain if plain else 0.0
    if result.mismatches or result.errors or report.errors:
        identical = "[red]NO"
    elif result.near_ties:
        identical = f"yes, but {result.near_ties} near-tie(s)"
    else:
        identical = "yes"
    table = Table(title="trtspec demo" + (" (the draft is the target itself)" if self_draft else ""))
    for col in ("prompts", "K", "acceptance", "target-only tok/s", "speculative tok/s", "speedup", "outputs identical"):
        table.add_column(col, justify="right")
    table.add_row(str(result.runs), str(result.k), f"{result.acceptance or 0:.2f}", f"{plain:.1f}", f"{spec:.1f}",
                  f"{speedup:.2f}x", identical)
    console.print(table)
    for d in result.differences:
        verdict = d.verdict
        detail = f"gap {verdict.gap:.4f}, allowed {verdict.allowed:.4f}" if verdict else d.error
        console.print(f"  prompt {d.prompt_index + 1}, token {d.position}: target-only {d.expected_text}, "
                      f"speculative {d.got_text}: {d.kind} ({detail})", markup=False, highlight=False)
    if self_draft:
        console.print("The draft is the target itself: nearly every draft token is accepted, but drafting costs as much "
                      "as decoding, so this shows correctness and the orchestration, not a speed-up.")
    summary = {
        "num_draft_tokens": result.k, "self_draft": self_draft, "acceptance_rate": result.acceptance,
        "target_only_tokens_per_s": plain, "speculative_tokens_per_s": spec, "speedup": speedup,
        "identical": result.matches, "near_ties": result.near_ties, "mismatches": result.mismatches,
        "errors": report.errors + result.errors,
    }
    (workdir / "demo-report.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"report: {workdir / 'demo-report.json'}")
    return 0 if report.passed(allow_near_ties=True) else 1
