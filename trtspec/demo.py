"""`trtspec demo`: the whole path on the embedded default, end to end, leaving nothing running.

build the demo pair -> deploy a model repository -> serve it with tritonserver -> stream answers ->
compare target-only and speculative outputs token by token -> one summary table.
"""

from __future__ import annotations

import json
import statistics
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
    rows = []
    try:
        with SpecClient(server.grpc_url, protocol="grpc") as client:
            for question, prompt in zip(PROMPTS[:2], prompts[:2]):
                console.rule(f"[bold]{question}")
                client.generate(prompt, max_tokens=max_tokens, num_draft_tokens=k, stream=True,
                                on_chunk=lambda chunk: console.print(chunk.text, end="", markup=False, highlight=False))
                console.print()
            console.rule("target-only vs speculative, greedy")
            for question, prompt in zip(PROMPTS, prompts):
                plain = client.generate(prompt, max_tokens=max_tokens, num_draft_tokens=0)
                spec = client.generate(prompt, max_tokens=max_tokens, num_draft_tokens=k)
                rows.append((question, plain, spec))
    finally:
        server.stop()
    return _summary(console, rows, k, self_draft, workdir)


def _chat(tokenizer, question: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return question


def _summary(console: Console, rows, k: int, self_draft: bool, workdir: Path) -> int:
    table = Table(title=f"trtspec demo: K = {k} draft tokens" + (" (draft = the target itself)" if self_draft else ""))
    for col in ("prompt", "tokens", "target-only tok/s", "speculative tok/s", "speedup", "acceptance", "identical"):
        table.add_column(col, justify="right" if col != "prompt" else "left")
    speedups, identical = [], True
    accepted = drafted = 0
    for question, plain, spec in rows:
        same = plain.token_ids == spec.token_ids
        identical &= same
        plain_tps, spec_tps = len(plain.token_ids) / plain.seconds, len(spec.token_ids) / spec.seconds
        speedups.append(spec_tps / plain_tps)
        accepted += spec.accepted
        drafted += spec.drafted
        table.add_row(question[:40], str(len(spec.token_ids)), f"{plain_tps:.1f}", f"{spec_tps:.1f}",
                      f"{spec_tps / plain_tps:.2f}x", f"{spec.acceptance_rate:.2f}", "yes" if same else "[red]NO")
    overall = accepted / drafted if drafted else 0.0
    table.add_section()
    table.add_row("all", "", "", "", f"{statistics.median(speedups):.2f}x (median)", f"{overall:.2f}",
                  "yes" if identical else "[red]NO")
    console.print(table)
    if self_draft:
        console.print("The demo's draft is the target itself: every draft token is accepted, and drafting costs as "
                      "much as decoding, so this shows correctness and the orchestration, not a speed-up.")
    report = {
        "num_draft_tokens": k, "self_draft": self_draft, "acceptance_rate": overall,
        "median_speedup": statistics.median(speedups), "identical": identical,
        "prompts": [{"prompt": q, "plain_tokens": p.token_ids, "spec_tokens": s.token_ids,
                     "plain_seconds": p.seconds, "spec_seconds": s.seconds, "acceptance_rate": s.acceptance_rate}
                    for q, p, s in rows],
    }
    (workdir / "demo-report.json").write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"report: {workdir / 'demo-report.json'}")
    return 0 if identical else 1
