"""Soak a served speculative deployment: N requests at concurrency C with mixed fields, cancellations and client
disconnects, the draft model's process killed once in the middle and the target's twice; count what happened to every
request.

    python benchmarks/soak.py --requests 1000 --concurrency 16 --output soak.json
    python benchmarks/soak.py --repo demo-output/model_repository --tokenizer demo-output/engines/target

Without --repo it builds the pair of --config (the demo pair by default; engines already built are reused) in
--workdir and serves it. Each request draws, with a fixed seed: a chat or code-editing prompt, max_tokens,
the transport (gRPC stream, HTTP generate, HTTP generate_stream), the draft source, num_draft_tokens, adaptive or
fixed draft length, stop words, and for a fifth of them sampling (temperature, top_k/top_p, seed). A tenth are
abandoned part way: over gRPC the stream is cancelled, over HTTP the connection is closed.

Before the soak, every prompt's greedy target-only answer (speculation "none") is the reference. Afterwards:
  - completed / cancelled / disconnected / failed / lost (no final response and no error within --timeout);
  - unequal: a greedy answer (or the part of it that arrived before a cancellation) that is not the reference's
    prefix of the same length; a sampled answer longer than max_tokens;
  - the target kills (--kill-target-at): the requests that waited for its reload and went on are counted among the
    completed, equal or not, like every other; the server log's reload lines say when it was back;
  - the draft kill: stubs killed, `trtspec_fallbacks_total{reason="draft_error"}` before and after, and when
    the first draft-model request after the kill drafted again (speculation back by itself);
  - idle: seconds from the last response until the engines stop receiving calls (a cancelled request that kept
    generating would keep them busy);
  - server memory (tritonserver and its stubs, resident) after warm-up, at peak, and after the soak.
Exits 1 when a request failed, was lost or was unequal, or the server or the draft model is not ready at the end.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from trtspec.bench.prompts import Prompts, load_prompt_set
from trtspec.client import ClientError, SpecClient, fetch_metrics

HERE = Path(__file__).resolve().parent
TRANSPORTS = ("grpc", "http", "http_stream")
SPECULATION = (None, "draft_model", "prompt_lookup", "none")  # None: the deployment's default
STOP_WORDS = ["\n\n", ".", "return"]
MAX_TOKENS = 64


@dataclass
class Plan:
    """One request of the soak, drawn before it starts."""

    index: int
    prompt: int
    transport: str
    max_tokens: int
    speculation: str | None
    num_draft_tokens: int | None
    adaptive: bool | None
    stream: bool
    stop_words: list[str] | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    abandon_after_s: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature is None


@dataclass
class Result:
    plan: Plan
    outcome: str  # completed | cancelled | disconnected | failed | lost
    token_ids: list[int] = field(default_factory=list)
    detail: str = ""
    draft_tokens: int | None = None
    fallbacks: dict[str, int] = field(default_factory=dict)
    started: float = 0.0
    ended: float = 0.0


def draw_plans(count: int, prompts: int, rng: random.Random, *, cancel: float, sample: float) -> list[Plan]:
    plans = []
    for i in range(count):
        transport = rng.choice(TRANSPORTS)
        plan = Plan(
            index=i,
            prompt=rng.randrange(prompts),
            transport=transport,
            max_tokens=rng.randint(8, MAX_TOKENS),
            speculation=rng.choice(SPECULATION),
            num_draft_tokens=rng.choice([None, *range(1, 9)]),
            adaptive=rng.choice([None, True, False]),
            stream=transport == "http_stream" or (transport == "grpc" and rng.random() < 0.5),
        )
        if rng.random() < sample:
            plan.temperature = round(rng.uniform(0.5, 1.2), 2)
            plan.top_k, plan.top_p = rng.choice([(None, 1.0), (40, None), (None, 0.9), (20, 0.95)])
            plan.seed = rng.randrange(2**31)
        elif rng.random() < 0.1:
            plan.stop_words = [rng.choice(STOP_WORDS)]
        if rng.random() < cancel:
            plan.abandon_after_s = round(rng.uniform(0.05, 1.5), 3)
        plans.append(plan)
    return plans


def run_one(client: SpecClient, plan: Plan, prompt: str, timeout: float) -> Result:
    started = time.perf_counter()
    try:
        done = client.generate(
            prompt,
            max_tokens=plan.max_tokens,
            num_draft_tokens=plan.num_draft_tokens,
            temperature=plan.temperature,
            top_k=plan.top_k,
            top_p=plan.top_p,
            seed=plan.seed,
            stop_words=plan.stop_words,
            stream=plan.stream,
            speculation=plan.speculation,
            adaptive_draft_length=plan.adaptive,
            stop_after_s=plan.abandon_after_s,
        )
    except ClientError as exc:
        message = str(exc)
        lost = "gave no final response within" in message or "did not finish within" in message
        return Result(plan, "lost" if lost else "failed", detail=message, started=started, ended=time.perf_counter())
    outcome = "completed"
    if done.finish_reason == "cancelled":
        outcome = "cancelled" if plan.transport == "grpc" else "disconnected"
    return Result(
        plan,
        outcome,
        token_ids=list(done.token_ids),
        draft_tokens=done.draft_tokens,
        fallbacks=dict(done.fallbacks),
        started=started,
        ended=time.perf_counter(),
    )


def unequal(result: Result, reference: list[int]) -> str | None:
    """Why `result` is not what the target alone gives, or None."""
    plan, ids = result.plan, result.token_ids
    if len(ids) > plan.max_tokens:
        return f"{len(ids)} tokens for max_tokens {plan.max_tokens}"
    if not plan.greedy:
        return None
    expected = reference[: plan.max_tokens]
    if result.outcome == "completed" and not plan.stop_words:
        return None if ids == expected else f"differs from the reference at token {_first_difference(ids, expected)}"
    # cut short by a cancellation or a stop word: what arrived must be the reference's beginning
    return (
        None
        if ids == expected[: len(ids)]
        else f"not a prefix of the reference (token {_first_difference(ids, expected)})"
    )


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class Sampler(threading.Thread):
    """The server's resident memory every half second, for its peak."""

    def __init__(self, server):
        super().__init__(daemon=True)
        self.server, self.peak, self._halt = server, 0, threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.5):
            self.peak = max(self.peak, self.server.memory_bytes())

    def stop(self) -> None:
        self._halt.set()
        self.join()


def draft_error_fallbacks(metrics_url: str) -> float:
    metrics = fetch_metrics(metrics_url, prefix="trtspec_fallbacks_total")
    return sum(
        v for k, v in metrics.items() if k.startswith("trtspec_fallbacks_total{") and 'reason="draft_error"' in k
    )


def engine_calls(metrics_url: str) -> float:
    return fetch_metrics(metrics_url, prefix="nv_inference_request_success").get("nv_inference_request_success", 0.0)


def wait_idle(metrics_url: str, quiet_s: float = 2.0, limit_s: float = 60.0) -> float:
    """Seconds until the count of finished model calls stops moving for `quiet_s` (limit_s if it never does)."""
    start = time.perf_counter()
    last, last_change = engine_calls(metrics_url), start
    while time.perf_counter() - start < limit_s:
        time.sleep(0.25)
        now = engine_calls(metrics_url)
        if now != last:
            last, last_change = now, time.perf_counter()
        elif time.perf_counter() - last_change >= quiet_s:
            return last_change - start
    return limit_s


LOG_MESSAGES = {
    "draft model down": "requests decode without it",
    "stub reloaded": "whose process had died",
    "request waited for the target": "the request waits for tensorrt_llm",
    "draft model back": "speculation with it resumes",
}


def log_mentions(server) -> dict[str, int]:
    """How often the server log says each thing of LOG_MESSAGES (once per outage is the promise)."""
    path = server.log_path
    text = path.read_text(errors="replace") if path is not None and path.exists() else ""
    return {what: text.count(phrase) for what, phrase in LOG_MESSAGES.items()}


def ready(server, model: str | None = None) -> bool:
    url = f"{server.http_base_url}/v2/" + (f"models/{model}/ready" if model else "health/ready")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=10) as resp:
            return resp.status == 200
    except OSError:
        return False


def serve(args, console: Console):
    from trtspec.compile import run_build
    from trtspec.config import load_config
    from trtspec.deploy.writer import write_repository
    from trtspec.server import TritonServer, free_port, start_timeout_for

    repo, tokenizer = args.repo, args.tokenizer
    if repo is None:
        workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="trtspec-soak-"))).resolve()
        engines = run_build(str(args.config), workdir / "engines", console=console)
        repo = write_repository(load_config(str(args.config)), engines, workdir / "model_repository", force=True)
        tokenizer = tokenizer or engines / "target"
    server = TritonServer(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    with console.status("starting tritonserver…"):
        server.start(timeout=start_timeout_for(repo))
    return server, tokenizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--repo", type=Path, help="serve this model repository [default: build --config]")
    p.add_argument("--config", type=Path, default=HERE.parent / "build_configs" / "demo.yaml")
    p.add_argument("--workdir", type=Path, help="engines and repository of --config go here [default: a temporary dir]")
    p.add_argument(
        "--tokenizer",
        type=Path,
        help="send the prompts in this tokenizer's chat template [default with --config: the target engine dir]",
    )
    p.add_argument(
        "--kill-draft-at",
        type=float,
        default=0.5,
        help="kill the draft model's process when this fraction of the requests has ended (0: never)",
    )
    p.add_argument(
        "--kill-target-at",
        type=float,
        nargs="*",
        default=[0.3, 0.7],
        help="kill the target model's process when each of these fractions of the requests has ended",
    )
    p.add_argument("--cancel", type=float, default=0.1, help="fraction of requests abandoned part way")
    p.add_argument("--sample", type=float, default=0.2, help="fraction of requests that sample")
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds after which a request with no final response counts as lost",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, help="write the counts and every failure as JSON")
    args = p.parse_args(argv)
    console = Console()

    server, tokenizer = serve(args, console)
    try:
        prompts = Prompts(
            load_prompt_set("builtin:chat") + load_prompt_set("builtin:code-edit"),
            tokenizer_dir=tokenizer,
            numbered=False,
        )
        texts = [prompts.text(i) for i in range(len(prompts))]
        plans = draw_plans(args.requests, len(texts), random.Random(args.seed), cancel=args.cancel, sample=args.sample)
        report = soak(server, texts, plans, args, console)
    finally:
        server.stop()
    report["command"] = "python " + " ".join(sys.argv)
    show(report, console)
    if args.output:
        args.output.write_text(json.dumps(report, indent=2, default=str) + "\n")
    bad = report["counts"].get("failed", 0) + report["counts"].get("lost", 0) + report["unequal"]
    return (
        1 if bad or not (report["ready_after"] and report["target_ready_after"] and report["draft_ready_after"]) else 0
    )


def soak(server, texts: list[str], plans: list[Plan], args, console: Console) -> dict:
    local = threading.local()

    def client(transport: str) -> SpecClient:
        protocol = "grpc" if transport == "grpc" else "http"
        clients = local.__dict__.setdefault("clients", {})
        if protocol not in clients:
            clients[protocol] = SpecClient(
                server.grpc_url if protocol == "grpc" else server.http_url, protocol, timeout=args.timeout
            )
        return clients[protocol]

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("references (target only, greedy)", total=len(texts))
        references = []
        with SpecClient(server.grpc_url, "grpc", timeout=args.timeout) as c:
            for text in texts:
                references.append(list(c.generate(text, max_tokens=MAX_TOKENS, speculation="none").token_ids))
                progress.advance(task)
    by_process_before = server.memory_by_process()
    memory_before = sum(by_process_before.values())
    fallbacks_before = draft_error_fallbacks(server.metrics_url)

    results: list[Result] = []
    lock = threading.Lock()
    kill = {
        "at_count": int(len(plans) * args.kill_draft_at) if args.kill_draft_at > 0 else None,
        "stubs": 0,
        "time": None,
    }
    target_kills = {int(len(plans) * f): None for f in args.kill_target_at if 0 < f < 1}  # at count -> stubs killed
    sampler = Sampler(server)
    sampler.start()
    started = time.perf_counter()

    def one(plan: Plan) -> Result:
        result = run_one(client(plan.transport), plan, texts[plan.prompt], args.timeout)
        with lock:
            results.append(result)
            if kill["at_count"] is not None and len(results) == kill["at_count"]:
                pids = server.stub_pids("tensorrt_llm_draft")
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                kill.update(stubs=len(pids), time=time.perf_counter())
                console.log(f"killed the draft model's stub ({len(pids)} process) after {len(results)} requests")
            if len(results) in target_kills and target_kills[len(results)] is None:
                pids = server.stub_pids("tensorrt_llm")
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                target_kills[len(results)] = len(pids)
                console.log(f"killed the target model's stub ({len(pids)} process) after {len(results)} requests")
        return result

    with Progress(console=console) as progress:
        task = progress.add_task(f"{len(plans)} requests at concurrency {args.concurrency}", total=len(plans))
        with ThreadPoolExecutor(args.concurrency) as pool:
            for _ in pool.map(lambda plan: (one(plan), progress.advance(task)), plans):
                pass
    seconds = time.perf_counter() - started
    idle_s = wait_idle(server.metrics_url)
    sampler.stop()
    by_process_after = server.memory_by_process()
    memory_after = sum(by_process_after.values())
    fallbacks_after = draft_error_fallbacks(server.metrics_url)

    counts = collections.Counter(r.outcome for r in results)
    problems = []
    for r in results:
        why = unequal(r, references[r.plan.prompt]) if r.outcome in ("completed", "cancelled", "disconnected") else None
        if why or r.outcome in ("failed", "lost"):
            problems.append({"outcome": r.outcome, "why": why or r.detail, "plan": asdict(r.plan)})
    after_kill = sorted(
        (r.started - kill["time"], r)
        for r in results
        if kill["time"] is not None
        and r.started > kill["time"]
        and r.plan.speculation in (None, "draft_model")
        and r.outcome == "completed"
        and r.plan.num_draft_tokens != 0
    )
    drafting_after_kill = [t for t, r in after_kill if (r.draft_tokens or 0) > 0]
    fell_back = sum(1 for r in results if r.fallbacks.get("draft_error"))
    return {
        "requests": len(plans),
        "concurrency": args.concurrency,
        "seconds": seconds,
        "counts": dict(counts),
        "unequal": sum(1 for p in problems if p["outcome"] not in ("failed", "lost")),
        "greedy_checked": sum(1 for r in results if r.plan.greedy and r.outcome != "failed" and r.outcome != "lost"),
        "tokens": sum(len(r.token_ids) for r in results),
        "draft_kill": {
            "stubs_killed": kill["stubs"],
            "after_requests": kill["at_count"],
            "requests_with_draft_error_fallback": fell_back,
            "fallbacks_metric_before": fallbacks_before,
            "fallbacks_metric_after": fallbacks_after,
            "draft_model_requests_after_kill": len(after_kill),
            "of_which_drafted": len(drafting_after_kill),
            "first_drafting_request_after_kill_s": drafting_after_kill[0] if drafting_after_kill else None,
        },
        "target_kills": {str(at): stubs for at, stubs in target_kills.items()},
        "idle_after_last_response_s": idle_s,
        "memory_bytes": {"after_warmup": memory_before, "peak": sampler.peak, "after": memory_after},
        "memory_by_process": {
            name: [by_process_before.get(name), by_process_after.get(name)]
            for name in sorted(set(by_process_before) | set(by_process_after))
        },
        "server_log": log_mentions(server),
        "ready_after": ready(server),
        "draft_ready_after": ready(server, "tensorrt_llm_draft"),
        "target_ready_after": ready(server, "tensorrt_llm"),
        "problems": problems,
    }


def show(report: dict, console: Console) -> None:
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    kill, memory, counts = report["draft_kill"], report["memory_bytes"], report["counts"]
    table = Table(
        title=f"soak: {report['requests']} requests at concurrency {report['concurrency']} "
        f"in {report['seconds']:.0f} s ({report['tokens'] / report['seconds']:.1f} tok/s)"
    )
    table.add_column("what")
    table.add_column("value", justify="right")
    for outcome in ("completed", "cancelled", "disconnected", "failed", "lost"):
        table.add_row(outcome, str(counts.get(outcome, 0)))
    table.add_row("unequal to the target-only reference", f"{report['unequal']} of {report['greedy_checked']} checked")
    table.add_row("draft stubs killed (after n requests)", f"{kill['stubs_killed']} ({kill['after_requests']})")
    table.add_row("requests that fell back on draft_error", str(kill["requests_with_draft_error_fallback"]))
    table.add_row(
        "target stubs killed (after n requests)",
        ", ".join(f"{stubs} ({at})" for at, stubs in report["target_kills"].items()) or "none",
    )
    table.add_row(
        'trtspec_fallbacks_total{reason="draft_error"}',
        f"{kill['fallbacks_metric_before']:.0f} → {kill['fallbacks_metric_after']:.0f}",
    )
    first = kill["first_drafting_request_after_kill_s"]
    table.add_row("draft model drafting again after", "never" if first is None else f"{first:.1f} s")
    table.add_row(
        "draft-model requests after the kill: drafted / all",
        f"{kill['of_which_drafted']} / {kill['draft_model_requests_after_kill']}",
    )
    table.add_row(
        "server log: " + " / ".join(report["server_log"]), " / ".join(str(n) for n in report["server_log"].values())
    )
    table.add_row("engines idle after the last response", f"{report['idle_after_last_response_s']:.1f} s")
    table.add_row(
        "server memory: after warm-up / peak / after",
        f"{mib(memory['after_warmup'])} / {mib(memory['peak'])} / {mib(memory['after'])}",
    )
    table.add_row(
        "server ready / target / draft model ready at the end",
        f"{report['ready_after']} / {report['target_ready_after']} / {report['draft_ready_after']}",
    )
    console.print(table)
    processes = Table(title="resident memory by process")
    for col in ("process", "after warm-up", "after"):
        processes.add_column(col, justify="left" if col == "process" else "right")
    for name, (before, after) in report["memory_by_process"].items():
        processes.add_row(name, "-" if before is None else mib(before), "-" if after is None else mib(after))
    console.print(processes)
    for problem in report["problems"][:20]:
        console.print(problem, markup=False)


if __name__ == "__main__":
    sys.exit(main())
