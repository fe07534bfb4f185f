"""Measure a running deployment's engine costs through Triton (trtspec.calibration.Calibration).

Every call goes to the engine models themselves (`tensorrt_llm`, `tensorrt_llm_draft`) over one gRPC stream, with
`return_perf_metrics`: the engine's own timestamps (arrival, first scheduled, first token, last token; steady clock)
time the passes, so the client's overhead is not counted as engine time. A batch of B is ONE Triton request of B
rows: the engine model queues a request's rows together, as TensorRT-LLM's backend does (model_instance_state.cc at
c2e65b8: createExecutorRequests makes one executor request per row, one enqueueRequests call enqueues them all), so
they share their passes; B separate requests would arrive over several passes.

- plain step at batch B: B rows of `PLAIN_TOKENS` tokens; from the last first token to the last token, per step;
- verifying pass at batch B of k draft tokens: B rows with k draft tokens each, asking for k + 1 tokens as the loop
  does; from their scheduling to their last token (one pass of k + 1 rows each, and its acceptance);
- draft call of k tokens: one row to the draft model, scheduling to last token;
- round trip: a one-token call's wall time (send to answer) minus the engine's arrival-to-last-token span: what a
  call costs outside the engine (measured from this process, so a little above what the BLS pays in-server);
- at a long context (batch 1, a prompt of `LONG_CONTEXT` tokens or as long as the engines take): the plain step,
  each verifying pass and each draft call again, for what a long prompt adds (attention reads every cached token).

Prompts are fixed pseudo-random token ids, one per row, sent once first so their prefix is in the KV cache (each
pass then computes the rows it is measured for, not a prefill). Draft tokens are random: most are rejected, which
changes what a verification emits, not the pass it costs. Each figure is the least of `REPEATS` (other work on the
machine only adds time). Measuring stops at a time budget: the larger batches are then left out (the cost model
clamps to the largest measured), and the caller is told.
"""

from __future__ import annotations

import contextlib
import queue
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tritonclient.utils import np_to_triton_dtype

from trtspec.calibration import Calibration, engine_identity, machine_identity
from trtspec.contract import GenerationRequest, SamplingParams, request_to_tensors
from trtspec.errors import BenchError

PROMPT_TOKENS = 48
LONG_CONTEXT = 1024  # the long prompt's tokens, where the engines take that many (a summarization or RAG prompt's size)
PLAIN_TOKENS = 8
REPEATS = 3  # each figure is the least of its repeats: other work on the machine only ever adds time
DEFAULT_BUDGET_S = 60.0
_TIMES = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")


@dataclass(frozen=True)
class Target:
    """What to measure: read from a deployed repository (`from_repository`)."""

    max_batch: int
    max_draft_len: int
    has_draft: bool
    vocab_size: int
    engines: str  # engine_identity
    max_input_len: int = 0  # the target engine's longest prompt (0: unknown, no long-context measurement)
    max_output_seq_len: int = 0  # its longest prompt + output

    def long_context(self) -> int:
        """The long prompt's tokens (0: the engines take none long enough to tell)."""
        room = min(self.max_input_len, self.max_output_seq_len - max(PLAIN_TOKENS, self.max_draft_len + 1))
        tokens = min(LONG_CONTEXT, room)
        return tokens if tokens >= 4 * PROMPT_TOKENS else 0

    def batches(self) -> list[int]:
        """1, 2, 4, ... up to the engine's batch, which is measured too."""
        out, b = [], 1
        while b < self.max_batch:
            out.append(b)
            b *= 2
        return [*out, self.max_batch]

    def draft_lengths(self) -> list[int]:
        """1, 2, 4, ... up to max_draft_len (enough for the cost model's line; between them it interpolates)."""
        out, k = [], 1
        while k < self.max_draft_len:
            out.append(k)
            k *= 2
        return [*out, self.max_draft_len] if self.max_draft_len else []


def from_repository(repo: str | Path) -> Target:
    """The batch, draft length and engines of a repository written by `trtspec deploy`."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from trtspec.deploy.writer import BLS_MODEL, DRAFT_MODEL, ENGINE_DIR_PARAMETER, TARGET_MODEL

    repo = Path(repo)

    def config(model: str):
        path = repo / model / "config.pbtxt"
        if not path.is_file():
            return None
        try:
            return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
        except text_format.ParseError as exc:
            raise BenchError(f"{path} does not parse as a Triton model config: {exc}") from None

    target, draft, bls = config(TARGET_MODEL), config(DRAFT_MODEL), config(BLS_MODEL)
    if target is None or bls is None:
        raise BenchError(f"{repo} has no {TARGET_MODEL} or {BLS_MODEL} model: calibrate a repository from `deploy`")

    def param(cfg, key: str) -> str:
        return cfg.parameters[key].string_value if key in cfg.parameters else ""

    longest = param(bls, "max_draft_len")
    dirs, pbtxts = [], [repo / TARGET_MODEL / "config.pbtxt"]
    if draft is not None:
        pbtxts.append(repo / DRAFT_MODEL / "config.pbtxt")
    for cfg in (target, draft):
        if cfg is not None:
            # the backend's own parameter first (a stand-in may run TensorRT-LLM's config under another backend)
            names = [ENGINE_DIR_PARAMETER.get(cfg.backend, "engine_dir"), *ENGINE_DIR_PARAMETER.values()]
            value = next((param(cfg, name) for name in names if param(cfg, name)), "")
            if value:
                dirs.append(Path(value) if Path(value).is_absolute() else Path.cwd() / value)
    vocab, input_len, seq_len = 32000, 0, 0
    for path in dirs[:1]:
        try:
            from trtspec.engine.manifest import read_engine

            info = read_engine(path)
            vocab, input_len, seq_len = info.vocab_size, info.max_input_len, info.max_output_seq_len
        except Exception:  # a TensorRT engine dir this machine cannot read: ids below 32000 are in any vocabulary
            pass
    return Target(
        max_batch=max(1, target.max_batch_size),
        max_draft_len=int(longest) if longest.isdigit() else 0,
        has_draft=draft is not None,
        vocab_size=vocab,
        engines=engine_identity([p for p in dirs if p.is_dir()] + pbtxts),
        max_input_len=input_len,
        max_output_seq_len=seq_len,
    )


class _Stream:
    """One gRPC stream to Triton, kept open for every call it makes (opening one per call would be timed too)."""

    def __init__(self, url: str, headers: dict[str, str], timeout: float):
        import tritonclient.grpc as grpcclient

        from trtspec.keys import GRPC_PREFIX

        self.timeout = timeout
        self.client = grpcclient.InferenceServerClient(url, channel_args=[("grpc.enable_http_proxy", 0)])
        self.responses: queue.SimpleQueue = queue.SimpleQueue()
        self.client.start_stream(
            callback=lambda result, error: self.responses.put((result, error)),
            headers={GRPC_PREFIX + k: v for k, v in headers.items()},
        )
        self._input = grpcclient.InferInput

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.stop_stream()
            self.client.close()

    def call(self, model: str, requests: list[GenerationRequest]) -> tuple[list[dict[str, int]], float]:
        """One Triton request of len(requests) rows (the engine queues a batch's rows together, so they share
        their passes, as TensorRT-LLM's backend enqueues them); each row's engine timestamps, and the wall seconds
        of the call on this process's clock."""
        rows = [request_to_tensors(r) for r in requests]
        inputs = []
        for name in rows[0]:
            value = np.concatenate([row[name] for row in rows])
            inp = self._input(name, list(value.shape), np_to_triton_dtype(value.dtype))
            inp.set_data_from_numpy(value)
            inputs.append(inp)
        started = time.monotonic_ns()
        self.client.async_stream_infer(model, inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True)
        times: dict[int, dict[str, int]] = {}
        while True:
            try:
                result, error = self.responses.get(timeout=self.timeout)
            except queue.Empty:
                raise BenchError(f"{model} gave no final response within {self.timeout:g} s") from None
            if error is not None:
                raise BenchError(f"{model} refused a calibration call: {error}")
            response = result.get_response()
            if response.outputs:
                names = {o.name for o in response.outputs}
                missing = [n for n in _TIMES if n not in names]
                if missing:
                    raise BenchError(
                        f"{model} returned no {missing[0]} with return_perf_metrics: its engine cannot be timed"
                    )
                index = int(result.as_numpy("batch_index").reshape(-1)[0]) if "batch_index" in names else 0
                times[index] = {n: int(result.as_numpy(n).reshape(-1)[0]) for n in _TIMES}
            final = response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
        wall = (time.monotonic_ns() - started) / 1e9
        if len(times) != len(requests):
            raise BenchError(f"{model} answered {len(times)} of a batch of {len(requests)} calibration calls")
        return [times[i] for i in sorted(times)], wall


def measure(
    grpc_url: str,
    headers: dict[str, str],
    target: Target,
    *,
    budget_s: float = DEFAULT_BUDGET_S,
    progress: Callable[[str, float], None] | None = None,
    timeout: float = 120.0,
) -> tuple[Calibration, list[str]]:
    """The deployment's Calibration, and what was left out for the time budget. `progress(what, fraction)`."""
    from trtspec.deploy.writer import DRAFT_MODEL, TARGET_MODEL

    began = time.monotonic()
    rng = random.Random(20261127)
    high = min(target.vocab_size, 32000)
    low = min(100, high // 2)  # clear of the special tokens at the start of most vocabularies
    prompts = [[rng.randrange(low, high) for _ in range(PROMPT_TOKENS)] for _ in range(target.max_batch)]
    long_tokens = target.long_context()
    if long_tokens:  # the last: batch 1 uses the first
        prompts.append([rng.randrange(low, high) for _ in range(long_tokens)])
    batches, ks = target.batches(), target.draft_lengths() or [1]
    drafted = len(ks) if target.has_draft else 0
    steps = len(batches) * (1 + len(ks)) + drafted + 2 + (2 + len(ks) + drafted if long_tokens else 0)
    done, skipped = 0, []
    greedy = SamplingParams(temperature=1.0, top_k=1)

    def request(i: int, n: int, draft: list[int] | None = None) -> GenerationRequest:
        return GenerationRequest(
            prompts[i],
            n,
            end_id=-1,
            pad_id=0,
            sampling=greedy,
            draft_input_ids=draft,
            exclude_input_in_output=True,
            return_perf_metrics=True,
        )

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(what, min(done / steps, 1.0))

    stream = _Stream(grpc_url, headers, timeout)
    try:
        # the prompts' prefixes into both engines' caches, once
        stream.call(TARGET_MODEL, [request(i, 1) for i in range(target.max_batch)])
        if target.has_draft:
            stream.call(DRAFT_MODEL, [request(i, 1) for i in range(target.max_batch)])
        tick("warm-up")
        trips = []
        for _ in range(REPEATS):
            (t,), wall = stream.call(TARGET_MODEL, [request(0, 1)])
            trips.append(max(wall - (t["last_token_time_ns"] - t["arrival_time_ns"]) / 1e9, 0.0))
        round_trip = min(trips)
        tick("round trip")
        plain: dict[int, float] = {}
        verify: dict[int, dict[int, float]] = {}
        for batch in batches:
            if plain and time.monotonic() - began > budget_s:
                skipped.append(f"batch {batch} and above (past the {budget_s:.0f} s budget)")
                break
            rows = [request(i, PLAIN_TOKENS) for i in range(batch)]
            plain[batch] = _least(lambda rows=rows: _plain_step(stream.call(TARGET_MODEL, rows)[0]))
            tick(f"plain step, batch {batch}")
            verify[batch] = {}
            for k in ks:

                def verifying(k=k, batch=batch):
                    drafts = [[rng.randrange(low, high) for _ in range(k)] for _ in range(batch)]
                    return _whole_call(
                        stream.call(TARGET_MODEL, [request(i, k + 1, drafts[i]) for i in range(batch)])[0]
                    )

                if verify[batch] and batch > 1 and time.monotonic() - began > budget_s:
                    break  # a batch half measured is left out whole (the table's batches have every k)
                verify[batch][k] = _least(verifying)
                tick(f"verify {k} tokens, batch {batch}")
            if len(verify[batch]) < len(ks):
                del plain[batch], verify[batch]
                skipped.append(f"batch {batch} and above (past the {budget_s:.0f} s budget)")
                break
        drafts: dict[int, float] = {}
        for k in ks if target.has_draft else ():
            drafts[k] = _least(lambda k=k: _whole_call(stream.call(DRAFT_MODEL, [request(0, k)])[0]))
            tick(f"draft {k} tokens")
        long: dict = {}
        if long_tokens and time.monotonic() - began > budget_s:
            skipped.append(f"the {long_tokens}-token context (past the {budget_s:.0f} s budget)")
        elif long_tokens:
            try:
                long = _long_context(stream, target, ks, len(prompts) - 1, request, rng, (low, high), tick)
            except BenchError as exc:  # an engine that refuses the long prompt: the table stands without it
                skipped.append(f"the {long_tokens}-token context ({exc})")
    finally:
        stream.close()
    calibration = Calibration(
        plain_seconds=plain,
        verify_seconds=verify,
        draft_seconds=drafts,
        round_trip_seconds=round_trip,
        machine=machine_identity(),
        engines=target.engines,
        measured_at=time.time(),
        took_seconds=time.monotonic() - began,
        **long,
    ).monotone()
    return calibration, skipped


def _long_context(stream: _Stream, target: Target, ks: list[int], i: int, request, rng, ids, tick) -> dict:
    """The long_* figures of a Calibration, at batch 1 on prompt `i` (the long one)."""
    from trtspec.deploy.writer import DRAFT_MODEL, TARGET_MODEL

    tokens = target.long_context()
    models = [TARGET_MODEL, *([DRAFT_MODEL] if target.has_draft else [])]
    for model in models:  # its prefill, once
        stream.call(model, [request(i, 1)])
    tick(f"{tokens}-token context")
    long = {"short_context_tokens": PROMPT_TOKENS, "context_tokens": tokens}
    long["long_plain_seconds"] = _least(lambda: _plain_step(stream.call(TARGET_MODEL, [request(i, PLAIN_TOKENS)])[0]))
    tick(f"plain step, {tokens} tokens")

    def verifying(k: int) -> float:
        draft = [rng.randrange(*ids) for _ in range(k)]
        return _whole_call(stream.call(TARGET_MODEL, [request(i, k + 1, draft)])[0])

    long["long_verify_seconds"], long["long_draft_seconds"] = {}, {}
    for k in ks:
        long["long_verify_seconds"][k] = _least(lambda k=k: verifying(k))
        tick(f"verify {k} tokens, {tokens} tokens")
    for k in ks if target.has_draft else ():
        long["long_draft_seconds"][k] = _least(lambda k=k: _whole_call(stream.call(DRAFT_MODEL, [request(i, k)])[0]))
        tick(f"draft {k} tokens, {tokens} tokens")
    return long


def _least(measure_once: Callable[[], float]) -> float:
    return min(measure_once() for _ in range(REPEATS))


def _plain_step(times: list[dict[str, int]]) -> float:
    """Seconds per decode step: the batch's rows decode together from their first token to their last."""
    return (
        (max(t["last_token_time_ns"] for t in times) - max(t["first_token_time_ns"] for t in times))
        / (PLAIN_TOKENS - 1)
        / 1e9
    )


def _whole_call(times: list[dict[str, int]]) -> float:
    """Seconds from the batch's scheduling to its last token: a verification's one pass with its acceptance, as a
    plain step counts its sampling (the loop asks a verification for k + 1 tokens, as here)."""
    return (max(t["last_token_time_ns"] for t in times) - min(t["first_scheduled_time_ns"] for t in times)) / 1e9


# ---- at start-up (`trtspec serve`) and after `trtspec bench --apply` -------------------------------------------


def calibration_path(repo: str | Path) -> Path:
    """Where a deployment's calibration is kept: beside its generated keys (trtspec.keys.state_dir)."""
    from trtspec.calibration import FILE_NAME
    from trtspec.keys import state_dir

    return state_dir(repo) / FILE_NAME


def stored_for(repo: str | Path) -> Calibration | None:
    """The stored calibration when it was measured on this repository's engines on this machine; a stale one is
    removed (a BLS must never start from another engine's costs)."""
    from trtspec.calibration import CalibrationError

    path = calibration_path(repo)
    if not path.exists():
        return None
    try:
        stored = Calibration.load(path)
        if stored.matches(from_repository(repo).engines):
            return stored
    except (CalibrationError, BenchError):
        pass
    path.unlink(missing_ok=True)
    return None


def calibrate_deployment(
    repo: str | Path,
    grpc_url: str,
    headers: dict[str, str],
    console,
    *,
    measure_now: bool = True,
    budget_s: float = DEFAULT_BUDGET_S,
) -> Calibration | None:
    """Measure (or, with `measure_now` False, reuse what is stored for these engines), store it where the BLS reads
    it, and print its table. A calibration that cannot be made is said, not fatal: the BLS then starts from its
    configured costs, as before calibration existed."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    path = calibration_path(repo)
    if not measure_now:
        stored = stored_for(repo)
        if stored is None:
            console.print(
                "calibration: none stored for these engines on this machine (--no-calibrate): the deployment starts "
                "from its configured costs",
                highlight=False,
            )
            return None
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(stored.measured_at))
        console.print(f"calibration: reused, measured {when} (--no-calibrate)", highlight=False)
        print_table(stored, console)
        return stored
    try:
        target = from_repository(repo)
        with Progress(
            TextColumn("calibrating {task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as progress:
            task = progress.add_task("", total=1.0)
            calibration, skipped = measure(
                grpc_url,
                headers,
                target,
                budget_s=budget_s,
                progress=lambda what, fraction: progress.update(task, description=what, completed=fraction),
            )
        calibration.save(path)
    except (BenchError, OSError) as exc:
        console.print(
            f"[yellow]calibration failed:[/yellow] {exc}; the deployment starts from its configured costs",
            highlight=False,
        )
        return None
    console.print(f"calibration: measured in {calibration.took_seconds:.1f} s, stored in {path}", highlight=False)
    for line in skipped:
        console.print(f"  left out: {line}", highlight=False)
    print_table(calibration, console)
    return calibration


def print_table(calibration: Calibration, console) -> None:
    from rich.table import Table

    rows = calibration.table()
    table = Table(*rows[0], title="engine costs on this machine (c, d0, v0, b: the cost model in plain steps)")
    for row in rows[1:]:
        table.add_row(*row)
    console.print(table)
    console.print(f"  {calibration.summary()}", highlight=False)


def refresh(repo: str | Path, url: str | None, protocol: str, console) -> Calibration | None:
    """`trtspec bench --apply REPO`: measure the running deployment at `url` again and store it where its BLS reads
    it (a BLS started by `trtspec serve --repo REPO` on this machine applies it at its next request). The engine
    models are called over gRPC: `url` itself with --protocol grpc, else the HTTP port + 1 (serve's layout)."""
    from trtspec.client import default_url, split_url
    from trtspec.keys import client_headers

    _scheme, host, port = split_url(url or default_url(protocol), 8000)
    host = f"[{host}]" if ":" in host else host
    grpc_url = f"{host}:{port if protocol == 'grpc' else port + 1}"
    return calibrate_deployment(repo, grpc_url, client_headers(grpc_url), console)
