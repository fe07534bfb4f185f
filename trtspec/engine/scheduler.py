"""In-flight batching: every engine call waiting at the same time runs in one forward pass per step.

A call (`Job`) is a plain generation of `request_output_len` tokens or a verification of draft tokens. Its
first step computes the tokens its KV cache does not hold yet (all of them, or the suffix past a reused
prefix) and reads the logits of its last position, or of the draft positions and one past; a generation then
takes one row per step until it ends. Calls join the batch at any step and leave it as soon as they end, so
a long plain stretch never holds back a verification that arrives meanwhile: TensorRT-LLM's in-flight
batching, at the granularity of one forward pass.

Admission is first come, first served, up to `max_batch_size` running calls and within the KV budget
(trtspec.engine.kv): a call that fits the budget but not beside the running ones waits for one to end.

A call can be stopped (`cancel`, TensorRT-LLM's cancelRequest): a waiting one leaves the queue at once, a running
one before the next step, so its batch slot and KV lease are free within one forward pass. It ends with a normal
result holding the tokens chosen so far, the token of the step in progress when the stop came included (streamed
with the last response). TensorRT-LLM is less kind, and so is the scheduler with `clear_cancelled` (the stand-in
of its backend sets it): forwardSync ends a cancelled request after the step in flight with
`clearGeneratedTokens()`, which cuts its tokens back to the prompt (trtGptModelInflightBatching.cpp, b35ac1b6; the
executor's loop runs terminateCancelledRequests, forwardSync, then populateNewResponses), so that step's token is
never sent: a stopped streaming call's last response holds no token, a stopped unary call returns the prompt alone,
and the log probs stay (clearGeneratedTokens leaves them). A request id names the calls of the
LATEST request that carried it, as TensorRT-LLM's Triton backend maps ids (model_instance_state.cc `enqueue`:
`mTritonRequestIdToRequestIds[tritonRequestId] = *requestIdsSet`, replacing what an earlier request with that id
left there; `handleStopRequest` cancels what it finds there), so a stop never reaches an earlier call with the id.

The waiting queue is bounded by `max_queue_size` (0: no bound), as TensorRT-LLM's executor bounds its queue
(ExecutorConfig maxQueueSize; executorImpl.cpp `enqueueRequests`: a request whose rows would take the queued ones
past it is refused whole, "Maximum queue size of N has been reached, please try again later").
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trtspec.contract import GenerationRequest, GenerationResult, StopWords
from trtspec.engine.kv import KVPool, Lease
from trtspec.engine.model import Segment
from trtspec.engine.sampling import Rules, accept_draft, log_prob, prepare, select
from trtspec.errors import EngineBusy, EngineError

# unconfigured, a warning still reaches stderr (Python's last-resort handler), which Triton's log holds
log = logging.getLogger("trtspec.engine")


@dataclass
class BatchStats:
    steps: int = 0
    rows: int = 0  # token rows through the network
    calls: int = 0  # call-steps: a call's share of a step
    max_calls_in_step: int = 0


class Job:
    """One engine call as it moves through the steps of the scheduler."""

    def __init__(
        self,
        request: GenerationRequest,
        done: Callable[[GenerationResult | BaseException], None],
        *,
        end_id: int | None,
        generator: torch.Generator | None,
        vocab_size: int,
        request_id: str = "",
    ):
        self.request, self.done, self.request_id = request, done, request_id
        self.stopped = False  # cancelled: ends before the next step (its step in progress streams nothing)
        self.end_id, self.generator = end_id, generator
        self.seq = list(request.input_ids)
        # Never emit more than request_output_len tokens: a verification emits up to len(draft) + 1.
        self.draft = list(request.draft_input_ids[: request.request_output_len - 1]) if request.draft_input_ids else []
        self.draft_logits = None
        if request.draft_logits is not None and self.draft:
            self.draft_logits = torch.as_tensor(request.draft_logits)[: len(self.draft), :vocab_size].float()
        self.tokens = self.seq + self.draft  # what the first step must have in the cache
        self.rules = Rules(request.penalties, request.bad_words, request.return_log_probs)
        self.stop_words = StopWords(request.stop_words)
        self.step_rows = len(self.draft) + 1  # logits rows that choose tokens in the first step
        # context logits need every prompt position through the network, so nothing cached is reused
        self.first_logits = len(self.tokens) if request.return_context_logits else self.step_rows
        self.context_logits = None
        self.log_probs: list[float] = []
        self.on_token: Callable[[GenerationResult], None] | None = None  # streaming: hears the result so far
        # at each token but the last
        # room for every position this call may write: the sequence, then up to request_output_len tokens
        self.capacity = len(self.seq) + max(request.request_output_len, len(self.draft) + 1)
        self.lease: Lease | None = None
        # the next step's rows (its Segment): the ids to run, the position of the first, and how many of the last
        # rows' logits are wanted
        self.pending: list[int] = []
        self.start = 0
        self.n_logits = 0
        # what the call has produced
        self.new: list[int] = []  # the tokens chosen so far
        self.kept_logits: list[torch.Tensor] = []  # their logits, when asked for
        self.num_accepted_tokens = 0  # of the draft, after a verification
        self.computed = 0  # tokens that went through the network
        self.began = 0.0  # admission (perf_counter), for the result's seconds
        # steady-clock times (ns), as TensorRT-LLM's perf outputs report them; 0: not yet
        self.arrived_ns = time.monotonic_ns()
        self.scheduled_ns = 0  # first scheduled
        self.first_token_ns = 0

    def admitted(self, lease: Lease) -> None:
        self.lease = lease
        self.pending, self.start, self.n_logits = self.tokens[lease.cached :], lease.cached, self.first_logits
        self.began = time.perf_counter()
        self.scheduled_ns = time.monotonic_ns()

    def segment(self) -> Segment:
        return Segment(self.pending, self.start, self.lease.kv, self.n_logits)

    def advance(self, logits: torch.Tensor) -> bool:
        """Take this step's logits [n_logits, V]; True when the call is complete."""
        self.computed += len(self.pending)
        self.first_token_ns = self.first_token_ns or time.monotonic_ns()
        if self.request.return_context_logits and self.context_logits is None:
            self.context_logits = logits[: len(self.seq)].clone()  # a step's logits may be a reused buffer
            logits = logits[len(logits) - self.step_rows :]
        if self.draft:
            return self._verified(logits)
        r = self.request
        token = self._choose(logits[-1], len(self.new))
        if token == self.end_id:
            # the end token ends the call and is not returned, nor its log prob or logits: TensorRT-LLM's executor
            # "will stop at the endId, but not include it in the output" (NVIDIA/TensorRT-LLM issue 2190)
            if r.return_log_probs:
                self.log_probs.pop()
            return True
        self.new.append(token)
        if r.return_generation_logits:
            self.kept_logits.append(logits[-1].clone())
        if len(self.new) >= r.request_output_len or (
            self.stop_words and self.stop_words.completed_by(self.seq + self.new)
        ):
            return True
        if self.on_token is not None and not self.stopped:
            self.on_token(self.result())
        self.pending, self.start, self.n_logits = [token], len(self.seq) + len(self.new) - 1, 1
        return False

    def _blocked(self, generated: int) -> int | None:
        """The end token while fewer than min_tokens have been generated."""
        return self.end_id if self.end_id is not None and generated < self.request.min_tokens else None

    def _choose(self, logits: torch.Tensor, generated: int) -> int:
        """The token at one position of a plain generation (`generated` tokens before it in this call)."""
        r = self.request
        history = self.seq + self.new if self.rules.active else []
        row, params = prepare(logits, r.sampling, self.rules, history, self._blocked(generated))
        token = select(row, params, self.generator)
        if r.return_log_probs:
            self.log_probs.append(log_prob(row, token))
        return token

    def _verified(self, logits: torch.Tensor) -> bool:
        r = self.request
        raw, params, draft_params = logits, r.sampling, None
        if self.rules.active or (self.end_id is not None and r.min_tokens > 0):
            # each position is prepared with the draft tokens before it as its history, as if they had been
            # generated one by one: accepted tokens are then exactly what plain decoding would choose
            rows = [
                prepare(logits[i], r.sampling, self.rules, self.seq + self.draft[:i], self._blocked(i))
                for i in range(len(logits))
            ]
            logits, params, draft_params = torch.stack([row for row, _ in rows]), rows[0][1], r.sampling
        accepted, emitted = accept_draft(
            logits,
            self.draft,
            params=params,
            draft_logits=self.draft_logits,
            generator=self.generator,
            draft_params=draft_params,
        )
        if self.end_id is not None and self.end_id in emitted:  # the end token and what follows are not returned
            emitted = emitted[: emitted.index(self.end_id)]
        if self.stop_words:  # nor a completed stop word
            end = next(
                (i + 1 for i in range(len(emitted)) if self.stop_words.completed_by(self.seq + emitted[: i + 1])),
                None,
            )
            emitted = emitted[:end] if end else emitted
        accepted = min(accepted, len(emitted))
        self.new, self.num_accepted_tokens = emitted, accepted
        if r.return_generation_logits:
            self.kept_logits = list(raw[: len(emitted)].clone())
        if r.return_log_probs:
            self.log_probs = [log_prob(logits[i], t) for i, t in enumerate(emitted)]
        return True

    @property
    def kept_tokens(self) -> list[int]:
        """The tokens whose KV the cache holds when the call ends: all but the last emitted token, whose keys
        the next call computes (a verification's rejected positions are dropped); only the reused prefix for a
        call stopped before its first step."""
        if not self.computed:
            return self.tokens[: self.lease.cached] if self.lease else []
        return (self.seq + self.new)[:-1]

    def result(self, cleared: bool = False) -> GenerationResult:
        """`cleared`: as TensorRT-LLM's clearGeneratedTokens leaves a cancelled request, its tokens (and their
        logits) gone, its log probs kept."""
        new = [] if cleared else list(self.new)
        return GenerationResult(
            output_ids=self.seq + new,
            new_tokens=new,
            generation_logits=torch.stack(self.kept_logits).numpy() if self.kept_logits and not cleared else None,
            log_probs=list(self.log_probs) if self.request.return_log_probs else None,
            context_logits=self.context_logits.float().numpy() if self.context_logits is not None else None,
            num_draft_tokens=len(self.draft),
            num_accepted_tokens=self.num_accepted_tokens,
            reused_tokens=self.lease.cached if self.lease else 0,
            computed_tokens=self.computed,
            seconds=time.perf_counter() - self.began,
            times_ns=(self.arrived_ns, self.scheduled_ns, self.first_token_ns, time.monotonic_ns()),
        )


class Scheduler:
    def __init__(self, model, pool: KVPool, max_batch_size: int, max_queue_size: int = 0):
        self.model, self.pool, self.max_batch_size = model, pool, max_batch_size
        self.max_queue_size = max_queue_size  # calls that may wait for a batch slot; 0: no bound
        self.clear_cancelled = False  # a stopped running call loses its tokens, as in TensorRT-LLM (module doc)
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self._latest: dict[str, list[Job]] = {}  # request id -> the unfinished calls of the latest request with it
        self.stats = BatchStats()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._step_lock = threading.Lock()  # one driver at a time: the worker thread or a synchronous caller
        self._worker: threading.Thread | None = None
        self._stop = False

    # ---- feeding ------------------------------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        self.submit_all([job], job.request_id)

    def submit_all(self, jobs: list[Job], request_id: str = "") -> None:
        """Queue the calls of one request (its rows) under `request_id`, which from now on names these calls and no
        earlier ones. Refused whole (EngineBusy, nothing queued) when they would take the waiting queue past
        max_queue_size."""
        with self._wake:
            if self.max_queue_size and len(self.waiting) + len(jobs) > self.max_queue_size:
                raise EngineBusy(
                    f"the engine's queue is full: {len(self.waiting)} calls wait for a batch slot and this request "
                    f"adds {len(jobs)}, beyond max_queue_size {self.max_queue_size}; retry later"
                )
            for job in jobs:
                job.request_id = request_id
            self.waiting.extend(jobs)
            if request_id:
                self._latest[request_id] = list(jobs)
            self._wake.notify()

    def cancel(self, request_id: str) -> int:
        """Stop the calls of the latest request with `request_id`: a waiting one ends now, a running one before the
        next step (the step in progress, if any, completes first; with clear_cancelled its tokens are then dropped,
        as TensorRT-LLM drops them). Returns how many calls it stopped; an id with
        none is no error (its calls may have ended already), as for TensorRT-LLM's handleStopRequest."""
        with self._wake:
            latest = [job for job in self._latest.get(request_id, ()) if not job.stopped]
            queued = [job for job in latest if job in self.waiting]
            for job in queued:
                self.waiting.remove(job)
            running = [job for job in latest if job in self.running]
            for job in running:
                job.stopped = True
            self._wake.notify()
        for job in queued:
            self._deliver(job, job.result())
        return len(queued) + len(running)

    def run(self, jobs: list[Job]) -> None:
        """Submit `jobs` and drive steps in this thread until every one of them is done."""
        if not jobs:
            return
        finished = threading.Event()
        remaining = [len(jobs)]
        for job in jobs:
            inner = job.done

            def done(outcome, inner=inner):
                inner(outcome)
                remaining[0] -= 1
                if remaining[0] == 0:
                    finished.set()

            job.done = done
        for job in jobs:
            self.submit(job)
        while not finished.is_set():
            if self._worker is not None:
                finished.wait(0.05)
            elif not self.step():
                raise EngineError("scheduler idle with calls outstanding")  # cannot happen: every call ends

    # ---- the step ---------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit what fits, run one forward pass over every running call; False when there was nothing to do."""
        with self._step_lock:
            for job in [job for job in self.running if job.stopped]:
                self._finish(job, job.result(cleared=self.clear_cancelled))
            self._admit()
            if not self.running:
                return False
            jobs = list(self.running)
            try:
                logits = self.model.forward([job.segment() for job in jobs])
            except Exception as exc:  # a failed pass fails its calls, never the engine
                for job in jobs:
                    self._finish(job, EngineError(f"forward pass failed: {exc}"))
                return True
            self.stats.steps += 1
            self.stats.calls += len(jobs)
            self.stats.rows += sum(len(job.pending) for job in jobs)
            self.stats.max_calls_in_step = max(self.stats.max_calls_in_step, len(jobs))
            self.pool.stats.computed_tokens += sum(len(job.pending) for job in jobs)
            for job, lg in zip(jobs, logits):
                try:
                    complete = job.advance(lg)
                except Exception as exc:
                    self._finish(job, EngineError(f"sampling failed: {exc}"))
                    continue
                if complete:
                    self._finish(job, job.result())
            return True

    def _admit(self) -> None:
        refused = []
        with self._lock:
            while self.waiting and len(self.running) < self.max_batch_size:
                job = self.waiting[0]
                lease = self.pool.acquire(job.tokens, job.capacity, max_cached=len(job.tokens) - job.first_logits)
                if lease is None:
                    if not self.running:  # cannot happen after pool.check; guard against waiting forever
                        refused.append(self.waiting.popleft())
                        continue
                    break  # first come, first served: later calls wait behind this one
                self.waiting.popleft()
                job.admitted(lease)
                self.running.append(job)
        for job in refused:
            self._deliver(job, EngineError("KV cache budget exhausted with nothing running"))

    def _finish(self, job: Job, outcome) -> None:
        with self._lock:
            self.running.remove(job)
        if job.lease is not None:
            self.pool.release(job.lease, job.kept_tokens if not isinstance(outcome, BaseException) else [])
        self._deliver(job, outcome)

    def _deliver(self, job: Job, outcome) -> None:
        with self._lock:  # an ended call leaves its id's map, as the backend's WaitForResponse erases it
            latest = self._latest.get(job.request_id)
            if latest is not None and job in latest:
                latest.remove(job)
                if not latest:
                    del self._latest[job.request_id]
        try:
            job.done(outcome)
        except Exception as exc:  # a response that cannot be delivered (client gone) must not stop the others
            log.warning("could not deliver a result: %s", exc)

    # ---- background worker (the Triton engine model) ------------------------------------------------------------
    def start(self) -> None:
        """Serve queued calls on a new thread until `stop`."""
        if self._worker is None:
            threads = torch.get_num_threads()
            self._worker = threading.Thread(target=self.serve, args=(threads,), name="trtspec-engine", daemon=True)
            self._worker.start()

    def serve(self, threads: int | None = None) -> None:
        """Serve queued calls on the calling thread until `stop`. The thread that runs the forward passes should
        be the only one in the process that ever runs torch's parallel work: with GNU OpenMP a second thread
        that does gets a team that runs small products several times slower (seen: a 30 us bmm took 100 us)."""
        self._worker = self._worker or threading.current_thread()
        self._stop = False
        if threads:
            torch.set_num_threads(threads)  # OpenMP's thread count is per calling thread
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not self._stop and not self.waiting and not self.running:
                        self._wake.wait()
                    if self._stop:
                        return
                try:
                    self.step()
                except Exception as exc:  # a fault outside the forward pass: its calls fail, never the engine
                    self._fail_in_flight(EngineError(f"engine step failed: {exc}"))

    def _fail_in_flight(self, error: EngineError) -> None:
        """End every running and waiting call with `error`, releasing their caches (after a fault the engine cannot
        tell which call caused it; left alone, they would wait forever)."""
        traceback.print_exc()
        with self._lock:
            jobs = [*self.running, *self.waiting]
            self.running.clear()
            self.waiting.clear()
        for job in jobs:
            if job.lease is not None:
                self.pool.release(job.lease, [])
            self._deliver(job, error)

    def stop(self) -> None:
        worker = self._worker
        if worker is None:
            return
        with self._wake:
            self._stop = True
            self._wake.notify()
        if worker is not threading.current_thread():
            worker.join()
        self._worker = None
