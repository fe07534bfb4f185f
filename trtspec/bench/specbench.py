"""`trtspec bench --prompts spec-bench:PATH`: Spec-Bench's question set, measured per task for each draft source.

Spec-Bench (Xia et al. 2024, `hemingkx/Spec-Bench`, `data/spec_bench/question.jsonl`) has 480 questions, one JSON
object a line with `question_id`, `category` and `turns`. Its eight MT-bench categories form the task "multi-turn
conversation"; the others are tasks of their own (translation, summarization, qa, math_reasoning, rag). Each
question's first turn is sent in the target's chat template; a question longer than the deployment's max_input_len
is skipped and counted.

Each block of C questions runs once per method, the methods in a shuffled order, so they meet the same questions
and the same machine noise. The methods send a question with the same request number (see bench/__init__.py), so
that their greedy outputs can be compared; before them, the block is sent once untimed (target-only, one token), so
that every method finds the prompt in the target's prefix KV cache. Without it the method that ran a question first
paid its prefill for all of them: on a CPU a long question's prefill (summarization, RAG: 600-900 tokens) took as
long as half its 96-token answer, so each task's speed-ups leaned by which method the shuffle put first.
The methods: target-only (`speculation: none`), then each draft source with the deployment's own
draft length and adaptive policy (`speculation: draft_model`, `prompt_lookup`, `auto`). As Spec-Bench reports:

    speed-up (task)         (Σ tokens / Σ request seconds) of the method / the same of target-only, over the task
    mean accepted tokens    tokens / target forward passes = tokens / (tokens - accepted draft tokens)
                            (a verification adds its accepted tokens and one of its own; a plain step one)

and, over all questions, the aggregate throughput ratio (tokens / block wall time) and whether each greedy output
equals target-only's.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shlex
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trtspec.bench.arithmetic import _ratio
from trtspec.bench.prompts import Prompts
from trtspec.bench.report import SOURCE_NAMES, _fmt
from trtspec.bench.run import (
    Block,
    _Clients,
    _Numbers,
    deployment_info,
    environment,
    finish_environment,
    request_options,
    run_block,
)
from trtspec.errors import BenchError

PREFIX = "spec-bench:"
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
TASKS = ("multi-turn conversation", "translation", "summarization", "qa", "math_reasoning", "rag")
TASK_LABELS = {
    "multi-turn conversation": "MT-bench",
    "translation": "Trans.",
    "summarization": "Sum.",
    "qa": "QA",
    "math_reasoning": "Math",
    "rag": "RAG",
}
METHODS = ("none", "draft_model", "prompt_lookup", "auto")  # none: target-only, the baseline


@dataclass(frozen=True)
class Question:
    id: str
    task: str
    text: str  # the first turn


def task_of(category: str) -> str:
    return "multi-turn conversation" if category in MT_BENCH else category


def load_questions(path: str | Path) -> list[Question]:
    """Spec-Bench's question.jsonl; BenchError names the line of a malformed question."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise BenchError(
            f"{PREFIX}{path}: cannot read it ({exc.strerror}); give the path of Spec-Bench's "
            "data/spec_bench/question.jsonl"
        ) from None
    questions = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            turns, category = item["turns"], item["category"]
            if not (isinstance(turns, list) and turns and isinstance(turns[0], str) and isinstance(category, str)):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            raise BenchError(
                f"{path}, line {number}: not a Spec-Bench question (a JSON object with `category` and "
                "`turns`, a list of strings)"
            ) from None
        questions.append(Question(str(item.get("question_id", number)), task_of(category), turns[0]))
    if not questions:
        raise BenchError(f"{path}: no questions")
    return questions


def select(questions: list[Question], per_task: int | None) -> list[Question]:
    """The first `per_task` questions of each task (None: all), in an order that takes the tasks in turn, so a
    run cut short has measured every task alike."""
    by_task: dict[str, list[Question]] = {}
    for q in questions:
        by_task.setdefault(q.task, []).append(q)
    lists = [qs[:per_task] if per_task else qs for qs in by_task.values()]
    return [lst[i] for i in range(max(map(len, lists), default=0)) for lst in lists if i < len(lst)]


def fit(
    questions: list[Question], prompts: Prompts, count_tokens, max_input_len: int | None
) -> tuple[list[Question], dict[str, int]]:
    """The questions whose templated first turn fits max_input_len, and the skipped count per task."""
    kept, skipped = [], {}
    for i, q in enumerate(questions):
        # counted with a request number as long as the run's (see bench/run.py _Numbers), since it is sent
        if max_input_len is not None and count_tokens(prompts.text(i, 99_999_999)) > max_input_len:
            skipped[q.task] = skipped.get(q.task, 0) + 1
        else:
            kept.append(q)
    return kept, skipped


# ---- the run ------------------------------------------------------------------------------------------------


def run_spec_bench(
    settings,
    questions: list[Question],
    prompts: Prompts,
    *,
    methods: tuple[str, ...],
    k: int | None,
    adaptive: bool,
    skipped: dict[str, int],
    progress=None,
    command: Sequence[str] | None = None,
) -> dict:
    """Measure every method on every question at each concurrency of `settings` (a BenchSettings), interleaved;
    `prompts` holds the questions' first turns in the same order. Returns the report (JSON-able)."""
    env = environment()
    clients, first = _Clients(settings), _Numbers().take()
    rng = random.Random(settings.seed)
    plan = []
    for c in settings.concurrencies:
        for start in range(0, len(questions), c):
            indices = tuple(range(start, min(start + c, len(questions))))
            order = list(methods)
            rng.shuffle(order)
            number = first + len(plan) * 100  # each method's requests of this block get the same request numbers
            plan += [
                (Block(start // c, len(indices), 0 if m == "none" else k, indices, adaptive), m, c, number)
                for m in order
            ]
    rows: list[dict] = []
    walls: dict[tuple[int, str], float] = {}
    started = time.perf_counter()
    try:
        info = deployment_info(clients.get(0))
        task = progress.add_task("Spec-Bench", total=sum(b.concurrency for b, *_ in plan)) if progress else None
        lock = threading.Lock()

        def done(_rec) -> None:
            if progress is not None:
                with lock:
                    progress.advance(task)

        fields = request_options(info.get("inputs") or [], adaptive)
        warm, warmed = dataclasses.replace(settings, speculation="none", max_tokens=1, stream=False), set()
        for block, method, c, number in plan:
            if progress is not None:
                progress.update(task, description=f"Spec-Bench C={c} {method}")
            if number not in warmed:  # the block's prompts into the prefix cache, untimed (see the module docstring)
                run_block(clients, dataclasses.replace(block, k=0), prompts, warm, numbers=_Numbers(number))
                warmed.add(number)
            s = dataclasses.replace(settings, speculation=method)
            records, wall = run_block(
                clients, block, prompts, s, numbers=_Numbers(number), request_fields=fields, on_done=done, keep_ids=True
            )
            walls[(c, method)] = walls.get((c, method), 0.0) + wall
            for rec in records:
                q = questions[rec.prompt]
                rows.append(
                    {
                        "concurrency": c,
                        "method": method,
                        "question": q.id,
                        "task": q.task,
                        "tokens": rec.tokens,
                        "seconds": rec.seconds,
                        "accepted_draft_tokens": rec.accepted_draft_tokens,
                        "draft_tokens": rec.draft_tokens,
                        "iterations": rec.iterations,
                        "output": rec.output_digest,
                        "sources": rec.sources,
                        "error": rec.error,
                    }
                )
    finally:
        clients.close()
    finish_environment(env, started)
    return {
        "command": shlex.join(command) if command else None,
        "benchmark": "Spec-Bench",
        "settings": {
            "url": settings.url,
            "protocol": settings.protocol,
            "model": settings.model,
            "prompts": settings.prompts_source,
            "questions": len(questions),
            "skipped": skipped,
            "concurrency": list(settings.concurrencies),
            "methods": list(methods),
            "num_draft_tokens": k,
            "adaptive_draft_length": adaptive,
            "max_tokens": settings.max_tokens,
            "seed": settings.seed,
            "chat_template_from": settings.tokenizer,
        },
        "environment": env,
        "deployment": info,
        "summary": summarize(rows, walls, settings.concurrencies, methods),
        "requests": rows,
    }


def summarize(rows: list[dict], walls: dict, concurrencies, methods) -> list[dict]:
    """One entry per (concurrency, method): speed-up and mean accepted tokens per task and overall (module doc)."""
    out = []
    for c in concurrencies:
        base_ok = {r["question"]: r for r in rows if r["concurrency"] == c and r["method"] == "none" and not r["error"]}
        for m in methods:
            mine = [r for r in rows if r["concurrency"] == c and r["method"] == m]
            ok = [r for r in mine if not r["error"] and r["question"] in base_ok]
            entry = {
                "concurrency": c,
                "method": m,
                "requests": len(mine),
                "errors": sum(bool(r["error"]) for r in mine),
                "identical": sum(r["output"] == base_ok[r["question"]]["output"] for r in ok),
                "compared": len(ok),
                "throughput_ratio": _ratio(_rate_wall(rows, walls, c, m), _rate_wall(rows, walls, c, "none")),
                "tasks": {},
            }
            sources: dict[str, int] = {}
            for r in ok:
                for name, n in (r["sources"] or {}).items():
                    sources[name] = sources.get(name, 0) + n
            entry["sources"] = sources
            for task in (*TASKS, "overall"):
                here = [r for r in ok if task == "overall" or r["task"] == task]
                if not here:
                    continue
                base = [base_ok[r["question"]] for r in here]
                tokens, accepted = sum(r["tokens"] for r in here), sum(r["accepted_draft_tokens"] for r in here)
                entry["tasks"][task] = {
                    "questions": len(here),
                    "speedup": _ratio(_rate(here), _rate(base)),
                    "mean_accepted_tokens": _ratio(tokens, tokens - accepted),
                    "acceptance": _ratio(accepted, sum(r["draft_tokens"] for r in here)),
                }
            out.append(entry)
    return out


def _rate(rows: list[dict]) -> float | None:
    return _ratio(sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows))


def _rate_wall(rows, walls, c, method) -> float | None:
    return _ratio(
        sum(r["tokens"] for r in rows if r["concurrency"] == c and r["method"] == method and not r["error"]),
        walls.get((c, method), 0.0),
    )


# ---- the table ----------------------------------------------------------------------------------------------

NAMES = {
    "none": "target-only",
    "draft_model": "draft model (SpS)",
    "prompt_lookup": "prompt lookup (PLD)",
    "auto": "auto",
}


def k_text(k: int | None) -> str:
    return "the deployment's K" if k is None else f"K≤{k}"


def render(report: dict, console) -> None:
    """Spec-Bench's table, one per concurrency: speed-up per task and overall, mean accepted tokens."""
    from rich.table import Table

    s = report["settings"]
    skipped = sum(s["skipped"].values())
    for c in s["concurrency"]:
        entries = [e for e in report["summary"] if e["concurrency"] == c]
        tasks = [t for t in TASKS if any(t in e["tasks"] for e in entries)]
        table = Table(
            title=f"Spec-Bench, C={c}: {s['questions']} questions ({skipped} skipped: longer than "
            f"max_input_len), {s['max_tokens']} tokens, greedy, {k_text(s['num_draft_tokens'])}"
            f"{' adaptive' if s['adaptive_draft_length'] else ''}"
        )
        table.add_column("method")
        for t in tasks:
            table.add_column(TASK_LABELS.get(t, t), justify="right")
        for col in ("overall", "mean accepted\ntokens", "throughput\nvs target-only", "identical", "drafted by"):
            table.add_column(col, justify="right")
        for e in entries:
            overall = e["tasks"].get("overall", {})
            total = sum(e["sources"].values())
            drafted_by = (
                ", ".join(f"{SOURCE_NAMES.get(name, name)} {n / total:.0%}" for name, n in sorted(e["sources"].items()))
                if total
                else "-"
            )
            identical = f"{e['identical']}/{e['compared']}" if e["method"] != "none" else "-"
            if e["errors"]:
                identical += f" [red]({e['errors']} failed)[/]"
            table.add_row(
                NAMES.get(e["method"], e["method"]),
                *(_fmt(e["tasks"].get(t, {}).get("speedup"), ".2f", "x") for t in tasks),
                _fmt(overall.get("speedup"), ".2f", "x"),
                _fmt(overall.get("mean_accepted_tokens"), ".2f"),
                _fmt(e["throughput_ratio"], ".2f", "x"),
                identical,
                drafted_by,
            )
        console.print(table)
    console.print(
        "speed-up: tokens per request-second against target-only on the same questions; mean accepted "
        "tokens: tokens per target forward pass; drafted by: the speculative iterations each source drafted.",
        style="dim",
        highlight=False,
    )
