"""Running a benchmark: the interleaved schedule of blocks, the clients that send them, the environment
record, and the report of a run."""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import random
import shlex
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from trtspec import __version__
from trtspec.bench.cells import (
    RequestRecord,
    analyse,
    output_digest,
    record_from_completion,
    summarize_cell,
)
from trtspec.bench.prompts import BUILTIN, Prompts
from trtspec.bench.report import cell_label
from trtspec.bench.tuning import tune
from trtspec.errors import BenchError

BLS_MODEL = "tensorrt_llm_bls"


# ---- the run ------------------------------------------------------------------------------------------------

PROBE = -1  # the K of a prefill probe block (K = 0, max_tokens = 1)


DRAFT_LENGTHS = ("fixed", "adaptive", "both")


def variants(ks: Sequence[int], draft_length: str = "fixed") -> list[tuple[int, bool]]:
    """The (K, adaptive) cells of each concurrency: K = 0 once, and each K > 0 with a fixed draft length, with the
    deployment's adaptive draft length bounded by K, or both."""
    if draft_length not in DRAFT_LENGTHS:
        raise BenchError(f"--draft-length must be one of {', '.join(DRAFT_LENGTHS)}, got '{draft_length}'")
    modes = {"fixed": (False,), "adaptive": (True,), "both": (False, True)}[draft_length]
    return [(k, adaptive) for k in sorted(set(ks)) for adaptive in ((False,) if k == 0 else modes)]


@dataclass(frozen=True)
class Block:
    """`concurrency` requests of cell (concurrency, k, adaptive) sent at once, with these prompts (indices);
    k = PROBE: the round's prefill probes of those prompts."""

    round: int
    concurrency: int
    k: int | None  # None: the request names no K, the deployment's for its draft source
    prompts: tuple[int, ...]
    adaptive: bool = False


def schedule(
    concurrencies: Sequence[int],
    cells: Sequence[tuple[int, bool]],
    requests: int,
    num_prompts: int,
    seed: int = 0,
    *,
    probes: bool = True,
) -> list[Block]:
    """The interleaved plan: round r holds one block of every (K, adaptive) cell of each concurrency C that has
    more than r rounds (ceil(requests / C) rounds, so each cell gets `requests` rounded up to a multiple of C)
    and, with `probes`, a prefill probe block per concurrency, in an order shuffled with `seed` + r. Within a
    round every cell of a concurrency gets the same prompts."""
    rounds = {c: max(1, math.ceil(requests / c)) for c in concurrencies}
    blocks = []
    for r in range(max(rounds.values(), default=0)):
        this_round = []
        for c in concurrencies:
            if r >= rounds[c]:
                continue
            prompts = tuple((r * c + j) % num_prompts for j in range(c))
            this_round += [Block(r, c, k, prompts, adaptive) for k, adaptive in cells]
            this_round += [Block(r, c, PROBE, prompts)] if probes else []
        random.Random(seed + r).shuffle(this_round)
        blocks += this_round
    return blocks


@dataclass
class BenchSettings:
    url: str | None
    protocol: str = "http"
    model: str = BLS_MODEL
    prompts_source: str = BUILTIN + "chat"
    tokenizer: str | None = None
    concurrencies: tuple[int, ...] = (1, 4, 8)
    ks: tuple[int, ...] = (0, 2, 4, 6, 8)
    draft_length: str = "fixed"  # K > 0 cells: "fixed" K, "adaptive" with K as its bound, or "both"
    max_tokens: int = 64
    requests: int = 8
    stream: bool = False
    speculation: str | None = None  # the draft source of K > 0 cells; None: the deployment's default
    numbered: bool = True
    seed: int = 0
    timeout: float = 600.0
    warmup: bool = True


class _Clients:
    """One SpecClient per concurrent slot, made on first use and closed at the end."""

    def __init__(self, settings: BenchSettings):
        self.settings = settings
        self._clients: list = []

    def get(self, i: int):
        from trtspec.client import SpecClient

        while len(self._clients) <= i:
            s = self.settings
            self._clients.append(SpecClient(s.url, protocol=s.protocol, model=s.model, timeout=s.timeout))
        return self._clients[i]

    def close(self) -> None:
        for client in self._clients:
            client.close()


class _Numbers:
    """A thread-safe counter: each request's own prompt number. It starts at a random number, so that a run does not
    find the prompts of an earlier run on the same server in its prefix cache either."""

    def __init__(self, start: int | None = None):
        self._next = random.SystemRandom().randrange(10_000, 100_000) * 100 if start is None else start
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            self._next += 1
            return self._next


def run_block(
    clients: _Clients,
    block: Block,
    prompts: Prompts,
    settings: BenchSettings,
    *,
    numbers: _Numbers,
    request_fields: Mapping[str, object] | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
    keep_ids: bool = False,
) -> tuple[list[RequestRecord], float]:
    """Send the block's requests at once (one thread and client each); return their records and the wall time.
    `keep_ids`: record a fingerprint of each output's token ids."""
    from trtspec.client import ClientError

    probe = block.k == PROBE
    k = 0 if probe else block.k
    texts = [prompts.text(i, numbers.take()) for i in block.prompts]  # made before the clock starts
    fields = dict(request_fields or {})
    if "adaptive_draft_length" in fields:
        fields["adaptive_draft_length"] = block.adaptive
    if settings.speculation and (k is None or k > 0 or settings.speculation == "none"):
        fields["speculation"] = settings.speculation
    stream = settings.stream and not probe

    def one(slot: int) -> RequestRecord:
        index = block.prompts[slot]
        try:
            predicted = {"prediction": prompts.predictions[index]} if prompts.predictions and k != 0 else {}
            completion = clients.get(slot).generate(
                texts[slot],
                max_tokens=1 if probe else settings.max_tokens,
                num_draft_tokens=k,
                stream=stream,
                return_perf_metrics=True,
                **fields,
                **predicted,  # the K > 0 cells draft from it; the target-only cells are the target alone
            )
            rec = record_from_completion(
                completion,
                concurrency=block.concurrency,
                k=block.k,
                round=block.round,
                prompt=index,
                streamed=stream,
                adaptive=block.adaptive,
            )
            if keep_ids:
                rec.output_digest = output_digest(completion.token_ids)
        except ClientError as exc:
            rec = RequestRecord(block.concurrency, block.k, block.round, index, block.adaptive, error=str(exc))
        if on_done is not None:
            on_done(rec)
        return rec

    for slot in range(block.concurrency):
        clients.get(slot)
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=block.concurrency, thread_name_prefix="bench") as pool:
        records = list(pool.map(one, range(block.concurrency)))
    return records, time.perf_counter() - start


def request_options(inputs: Sequence[str], adaptive: bool = False) -> dict[str, object]:
    """The fields of trtspec's own that every measured request sends, where the deployment's BLS has the input: the
    draft length's kind, and perf metrics with the final response alone. Perf metrics on every response would cost
    each streamed response 19 more tensors, which a plain stretch pays at every token and a speculative iteration
    once for all its tokens, so target-only would pay more per token than speculation; the OpenAI front asks for
    them the same way (final only)."""
    fields: dict[str, object] = {}
    if "adaptive_draft_length" in inputs:
        fields["adaptive_draft_length"] = adaptive
    if "final_perf_metrics_only" in inputs:
        fields["final_perf_metrics_only"] = True
    return fields


def deployment_info(client) -> dict:
    """What the deployment says about itself: the BLS's inputs and parameters, the server's version (best effort)."""
    from trtspec.client import ClientError

    info: dict = {}
    try:
        config = client.model_config(client.model)
        info["inputs"] = [i.get("name") for i in config.get("input", [])]
        info["parameters"] = {
            k: v.get("string_value", "") for k, v in config.get("parameters", {}).items() if k != "tokenizer_dir"
        }
    except (ClientError, AttributeError) as exc:
        info["config_error"] = str(exc)
    try:
        meta = client._triton().get_server_metadata(**({"as_json": True} if client.protocol == "grpc" else {}))
        info["server"] = {"name": meta.get("name"), "version": meta.get("version")}
    except Exception as exc:  # metadata is a nicety: a server that refuses it still gets measured
        info["server_error"] = str(exc)
    return info


def environment() -> dict:
    import numpy

    env = {
        "trtspec": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "numpy": numpy.__version__,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        from importlib.metadata import version

        env["tritonclient"] = version("tritonclient")
    except Exception:  # not installed from a distribution: leave it out
        pass
    if hasattr(os, "getloadavg"):
        env["load_average_start"] = list(os.getloadavg())
    return env


def finish_environment(env: dict, started: float) -> dict:
    """`environment()` completed at the end of a run that began at time.perf_counter() `started`."""
    if hasattr(os, "getloadavg"):
        env["load_average_end"] = list(os.getloadavg())
    env["seconds"] = time.perf_counter() - started
    return env


def run_bench(
    settings: BenchSettings, prompts: Prompts, *, progress=None, command: Sequence[str] | None = None
) -> dict:
    """Measure every cell, interleaved (see `schedule`), and return the report (a JSON-able dict).

    `progress`: a rich Progress (or None); a task on it advances by one per finished request."""
    if 0 not in settings.ks:
        raise BenchError("the draft lengths must include 0, the target-only baseline")
    env = environment()
    clients = _Clients(settings)
    numbers = _Numbers()
    cell_kinds = variants(settings.ks, settings.draft_length)
    blocks = schedule(settings.concurrencies, cell_kinds, settings.requests, len(prompts), settings.seed)
    keys = [(c, k, adaptive) for c in settings.concurrencies for k, adaptive in cell_kinds]
    records: dict[tuple[int, int, bool], list[RequestRecord]] = {key: [] for key in keys}
    walls: dict[tuple[int, int, bool], float] = {key: 0.0 for key in keys}
    probes: dict[tuple[int, int, int], float] = {}  # (concurrency, round, prompt) -> first-iteration ms
    started = time.perf_counter()
    try:
        info = deployment_info(clients.get(0))
        inputs = info.get("inputs") or []
        if settings.speculation and inputs and "speculation" not in inputs:
            raise BenchError(
                f"{settings.model} has no `speculation` input: this deployment cannot choose the draft source"
            )
        # Each cell says whether K is fixed or the bound of an adaptive draft length; a deployment without that
        # input (NVIDIA's BLS) always keeps K fixed.
        adaptive_input = "adaptive_draft_length" in inputs
        if not adaptive_input and inputs and any(adaptive for _, adaptive in cell_kinds):
            raise BenchError(
                f"{settings.model} has no `adaptive_draft_length` input: measure it with --draft-length fixed"
            )
        if prompts.predictions and inputs and "prediction" not in inputs:
            raise BenchError(f"{settings.model} has no `prediction` input: redeploy with this trtspec")
        fields = request_options(inputs)
        if settings.warmup:  # the first requests of a fresh server pay for its warm-up: keep them out
            for k, adaptive in cell_kinds:
                block = Block(-1, 1, k, (0,), adaptive)
                recs, _ = run_block(
                    clients,
                    block,
                    prompts,
                    dataclasses.replace(settings, max_tokens=min(settings.max_tokens, 8)),
                    numbers=numbers,
                    request_fields=fields,
                )
                if recs[0].error:
                    raise BenchError(f"warm-up request of cell {cell_label(k, adaptive)} failed: {recs[0].error}")
        total = sum(b.concurrency for b in blocks)
        task = progress.add_task("measuring", total=total) if progress is not None else None
        lock = threading.Lock()

        def done(_rec: RequestRecord) -> None:
            if progress is not None:
                with lock:
                    progress.advance(task)

        for block in blocks:
            if progress is not None:
                what = "prefill probes" if block.k == PROBE else f"K={block.k}"
                progress.update(task, description=f"round {block.round + 1}: C={block.concurrency} {what}")
            block_start = time.perf_counter() - started
            recs, wall = run_block(
                clients, block, prompts, settings, numbers=numbers, request_fields=fields, on_done=done
            )
            for rec in recs:
                rec.started_s = block_start
            if block.k == PROBE:
                probes.update({(r.concurrency, r.round, r.prompt): r.verify_ms for r in recs if r.error is None})
                continue
            records[(block.concurrency, block.k, block.adaptive)] += recs
            walls[(block.concurrency, block.k, block.adaptive)] += wall
    finally:
        clients.close()
    for recs in records.values():
        for r in recs:
            r.first_ms = probes.get((r.concurrency, r.round, r.prompt))
    finish_environment(env, started)
    cells = analyse(
        [summarize_cell(records[key], walls[key], concurrency=key[0], k=key[1], adaptive=key[2]) for key in keys]
    )
    for cell in cells:
        cell["request_records"] = [_record_json(r) for r in records[(cell["concurrency"], cell["k"], cell["adaptive"])]]
    s = settings
    return {
        "command": shlex.join(command) if command else None,
        "settings": {
            "url": s.url,
            "protocol": s.protocol,
            "model": s.model,
            "prompts": s.prompts_source,
            "num_prompts": len(prompts),
            "chat_template_from": s.tokenizer,
            "numbered_prompts": s.numbered,
            "concurrency": list(s.concurrencies),
            "num_draft_tokens": list(s.ks),
            "max_tokens": s.max_tokens,
            "draft_length": s.draft_length,
            "requests": s.requests,
            "stream": s.stream,
            "speculation": s.speculation,
            "seed": s.seed,
            "order": "interleaved rounds with prefill probes (trtspec.bench.schedule)",
        },
        "environment": env,
        "deployment": info,
        "cells": cells,
        "tuning": tune(cells),
    }


def _record_json(r: RequestRecord) -> dict:
    d = asdict(r)
    intervals = d.pop("intervals")
    d["itl_ms_mean"] = sum(intervals) / len(intervals) * 1e3 if intervals else None
    for key in ("concurrency", "k", "adaptive"):
        d.pop(key)
    return d


def command_line(ctx) -> list[str]:
    """The command as given: `trtspec`, the subcommand and each option that did not come from its default (click
    context)."""
    from click.core import ParameterSource

    names, node = [], ctx
    while node.parent is not None:  # the root's own name depends on how the program was started
        names.insert(0, node.info_name)
        node = node.parent
    words = ["trtspec", *names]
    for param in ctx.command.params:
        if ctx.get_parameter_source(param.name) in (ParameterSource.DEFAULT, None) or not param.opts:
            continue
        value = ctx.params[param.name]
        if getattr(param, "is_flag", False):
            words.append(param.opts[0] if value else (param.secondary_opts or [param.opts[0]])[0])
        else:
            words += [param.opts[0], str(value)]
    return words
