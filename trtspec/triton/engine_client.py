"""The BLS's engine client: calls a `tensorrt_llm`-contract model (the target or the draft) through BLS, for one
request, and gives every call up when the request is over or the model is gone."""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_for

import numpy as np
import triton_python_backend_utils as pb_utils

from trtspec.contract import (
    ENGINE_OUTPUT_NAMES,
    GenerationRequest,
    GenerationResult,
    StreamedResults,
    request_to_tensors,
    tensors_to_result,
)
from trtspec.errors import Cancelled, EngineBusy, EngineError, EngineUnavailable
from trtspec.stream_sender import merge_results
from trtspec.triton.recovery import Reloader, unavailable

# How often a call that is waiting on its engine looks at the client and the request's deadline: a call given up
# on is stopped at the engine at most this long after the reason arose (about one decode step).
WATCH_SECONDS = 0.02
# How long a stop request may take before the BLS gives up on it (a model whose process died never answers), and how
# long a request waits for a call it stopped to end.
STOP_TIMEOUT_SECONDS = 2.0
# A stopped call that has not ended this long after its stop gets the stop again: a stop and its call are on their way
# at once, and a stop that reaches the engine first finds nothing to stop (TensorRT-LLM's handleStopRequest cancels
# only ids it has enqueued, model_instance_state.cc at 0c8de69a), so the call would run its whole budget.
RESTOP_SECONDS = 0.1
# A unary call given up on that has not ended when the request stops waiting for it (STOP_TIMEOUT_SECONDS: on a busy
# server it may not have reached its engine yet) gets its stop again from a thread of its own, less and less often,
# for at most this long, so that it still ends within a step of arriving instead of running its whole budget.
LATE_STOP_SECONDS = 60.0
# A call silent this long asks whether its model is still alive (see BlsEngineClient.lost).
SILENT_SECONDS = 1.0
# How much of the client's request id an engine call's id keeps (for the engine's logs; the rest is random).
CLIENT_ID_CHARS = 64
# What an engine says when its queue is full: the embedded engine names max_queue_size; TensorRT-LLM's executor
# says "Maximum queue size of N has been reached, please try again later" (executorImpl.cpp enqueueRequests, sent
# as INTERNAL by the backend's enqueue); Triton's own scheduler says "Exceeds maximum queue size" (UNAVAILABLE).
_QUEUE_FULL_SIGNS = ("max_queue_size", "maximum queue size")


class _Flight:
    """Where one engine call is: the thread that sends it asks `depart()` first, and a stop asked for before that keeps
    it from being sent at all; `stop()` says whether it has left (then only a stop request at the engine ends it)."""

    def __init__(self, cid: str):
        self.cid = cid
        self._lock = threading.Lock()
        self.left = self.stopped = False

    def depart(self) -> bool:
        with self._lock:
            self.left = not self.stopped
            return self.left

    def stop(self) -> bool:
        with self._lock:
            self.stopped = True
            return self.left


def call_id(request_id: str) -> str:
    """An engine call's own Triton request id: the client's id (shortened) for the logs, and a random part, so
    that this call's stop can reach no other call. TensorRT-LLM's backend maps an id to the latest request that
    carried it and its `stop` cancels that one (model_instance_state.cc `enqueue`, `handleStopRequest`), and clients
    choose ids freely (often a constant): with the client's id as it is, one client's stop would end another's call."""
    random = uuid.uuid4().hex
    return f"{request_id[:CLIENT_ID_CHARS]}:{random}" if request_id else random


class BlsEngineClient:
    """An engine client that calls a `tensorrt_llm`-contract model through BLS, on behalf of one request
    (`request_id`: the client's id, for the logs). Each call carries an id of its own (`call_id`), by which the
    engine can stop it and nothing else.

    While a call runs, the request watches: `watch()` (the client cancelled: True; the request's deadline passed:
    it raises), `call_timeout_ms` (the deployment's `draft_timeout_ms`, for the draft model) and `deadline` (a
    `time.monotonic()` instant: the request's `timeout_ms`, for the target; a draft call past the request's
    deadline is not the draft model's failure, and the target call after it ends the request). A call given up on
    is stopped at the engine with a `stop` request carrying that call's id (NVIDIA's send_cancellation_request
    in triton_decoder.py; the backend's handleStopRequest), so its batch slot and KV blocks are freed within an
    engine step, and the request waits for it to end (sending the stop again while it runs: RESTOP_SECONDS); a call
    given up on before it was sent is not sent. The request gets Cancelled, or an EngineError naming the bound. An
    engine whose queue is full refuses a call (EngineBusy: the request ends with UNAVAILABLE, the server's failure,
    not the client's).

    A call is read on a thread of `calls` while the request waits on it, because a call to a model whose process
    died never ends: with Triton's Python backend (2.51 to 2.71) a decoupled model's open calls get no further
    response, not even an error. The request gives such a call up (EngineUnavailable) once `reloader` has seen the
    model dead since the call began, which a silent call finds out by probing the model (`lost`)."""

    def __init__(
        self,
        model_name: str,
        request_id: str = "",
        *,
        calls: ThreadPoolExecutor,
        reloader: Reloader,
        call_timeout_ms: int = 0,
        deadline: float | None = None,
        decoupled: bool = False,
        watch=None,
    ):
        self.model_name, self.request_id = model_name, request_id
        self.calls, self.reloader = calls, reloader
        self.call_timeout_ms, self.deadline = call_timeout_ms, deadline
        self.decoupled = decoupled  # the model streams its responses (NVIDIA's decoupled_mode)
        self.watch = watch
        # A call and its responses hold their tensors in this model's shared-memory region (freed when the last
        # reference goes, python_backend shm_manager.h; the region only grows). A call (its inputs: the whole
        # sequence) is let go once answered. Its responses (new tokens only: exclude_input_in_output) live as long as
        # the request: Triton's Python backend before 2.54 (python_backend b771f4f, PbTensor::~PbTensor) lets go of a
        # tensor's numpy array without the GIL, and the stub's own cleanup thread can hold the last reference to a
        # BLS response (a decoupled call's response iterator keeps every response until that thread erases it), so
        # a response the BLS let go first dies on that thread and corrupts the stub's heap ("malloc(): unaligned
        # tcache chunk detected"); held to the request's end, the BLS's is the last reference.
        self.kept: list = []

    @property
    def streams(self) -> bool:
        return self.decoupled

    def for_request(self, request_id: str, deadline: float | None = None, watch=None) -> BlsEngineClient:
        return BlsEngineClient(
            self.model_name,
            request_id,
            calls=self.calls,
            reloader=self.reloader,
            call_timeout_ms=self.call_timeout_ms,
            deadline=deadline,
            decoupled=self.decoupled,
            watch=watch,
        )

    def generate(self, request: GenerationRequest) -> GenerationResult:
        call, flight = self._call(request, streaming=False)
        tensors = self._bounded(lambda: self._exec(call, flight), flight)
        return tensors_to_result(tensors, request.input_ids, request.exclude_input_in_output)

    def stream(self, request: GenerationRequest) -> _Stream:
        if not self.decoupled:
            raise EngineError(f"{self.model_name}: streaming needs a decoupled engine model")
        return _Stream(self, *self._call(request, streaming=True))

    def failure(self, error) -> EngineError:
        """An engine model's error (a TritonError or its message) as the request's: EngineUnavailable when the
        model cannot serve now (its process died, it is being loaded again), EngineError otherwise. A model seen
        dead is reloaded (trtspec.triton.recovery)."""
        message = error if isinstance(error, str) else error.message()
        refused = not isinstance(error, str) and error.code() == pb_utils.TritonError.INVALID_ARG
        if not refused and any(sign in message.lower() for sign in _QUEUE_FULL_SIGNS):
            return EngineBusy(f"{self.model_name} is busy: {message}")
        if refused:
            return EngineError(f"{self.model_name}: {message}")
        exc = (EngineUnavailable if unavailable(message) else EngineError)(f"{self.model_name}: {message}")
        self.reloader.notice(self.model_name, exc)
        self.reloader.failed(self.model_name)  # the engine's own failure: the liveness signal (engine_health)
        return exc

    def lost(self, since: float, silent_since: float) -> bool:
        """Whether the model died after `since` (a call's start): seen dead by any request, or, for a call silent
        since `silent_since` for SILENT_SECONDS, by a probe (a stop for an id nobody uses: answered at once by a
        live model, with "not healthy" by a dead one)."""
        if self.reloader.died_since(self.model_name, since):
            return True
        if time.monotonic() - silent_since >= SILENT_SECONDS and self.reloader.may_probe(self.model_name):
            try:
                self._stop(f"probe-{uuid.uuid4()}")
            except EngineError:
                pass  # a dead model's answer is noticed by `failure`
            return self.reloader.died_since(self.model_name, since)
        return False

    def _call(self, request: GenerationRequest, *, streaming: bool):
        """The call's InferenceRequest and its _Flight."""
        tensors = request_to_tensors(request)
        if streaming:
            tensors["streaming"] = np.ones((1, 1), np.bool_)
        wanted = [n for n in ENGINE_OUTPUT_NAMES if n != "generation_logits" or request.return_generation_logits]
        cid = call_id(self.request_id)
        call = pb_utils.InferenceRequest(
            model_name=self.model_name,
            requested_output_names=wanted,
            inputs=[pb_utils.Tensor(n, v) for n, v in tensors.items()],
            request_id=cid,
        )
        return call, _Flight(cid)

    def _exec(self, call, flight: _Flight) -> dict[str, np.ndarray]:
        """A unary call's output tensors. A decoupled model answers a request without `streaming` with one response
        and a final flag, which may come on an empty response of its own. Not sent when stopped before it left."""
        if not flight.depart():
            raise Cancelled()  # nobody waits for this: the request has given the call up
        self.reloader.opened(self.model_name, 1)
        try:
            responses = list(call.exec(decoupled=True)) if self.decoupled else [call.exec()]
        except pb_utils.TritonModelException as exc:  # e.g. a model that is not loaded
            raise self.failure(str(exc)) from None
        finally:
            self.reloader.opened(self.model_name, -1)
        self.kept += responses
        tensors: dict[str, np.ndarray] = {}
        for response in responses:
            if response.has_error():
                raise self.failure(response.error())
            # copies: a decoupled response's tensors are views of shared memory that is released with it
            tensors.update({t.name(): t.as_numpy().copy() for t in response.output_tensors()})
        if "output_ids" not in tensors:
            raise EngineError(f"{self.model_name}: answered without output_ids")
        self.reloader.answered(self.model_name)
        return tensors

    def _bounded(self, run, flight: _Flight):
        self.check(lambda: None)  # a request already over sends nothing
        bound = self._bound()
        if bound is not None and bound[0] <= 0:
            raise EngineError(f"{self.model_name}: no answer within {bound[1]}; not sent, no time was left")
        started = time.monotonic()
        expires = started + bound[0] if bound else None
        future = self.calls.submit(run)
        while True:
            wait = WATCH_SECONDS if expires is None else min(WATCH_SECONDS, expires - time.monotonic())
            try:
                return future.result(timeout=max(wait, 0.0))
            except FutureTimeout:
                pass
            self.check(lambda: self._give_up(flight, future, started))
            if expires is not None and time.monotonic() >= expires and not future.done():
                self._give_up(flight, future, started)
                raise EngineError(f"{self.model_name}: no answer within {bound[1]}; stopped it")
            if not future.done() and self.lost(started, started):
                raise self._gone()

    def _give_up(self, flight: _Flight, future: Future, started: float) -> None:
        """Stop a unary call the request no longer waits for and wait (STOP_TIMEOUT_SECONDS at most) until it has
        ended, which it does within an engine step of a stop that finds it; the stop goes again every RESTOP_SECONDS,
        for the one that overtook its call, and after that wait from a thread of its own (`_stop_late`). A call not sent
        yet is not sent."""
        if not flight.stop():
            return
        until = time.monotonic() + STOP_TIMEOUT_SECONDS
        while not future.done():
            self.send_stop(flight.cid)
            wait_for([future], timeout=RESTOP_SECONDS)
            if self.lost(started, started):
                return
            if time.monotonic() >= until:
                late = threading.Thread(target=self._stop_late, args=(flight.cid, future, started), daemon=True)
                late.start()
                return

    def _stop_late(self, cid: str, future: Future, started: float) -> None:
        """Send the stop of a call the request no longer waits for until it ends (at most LATE_STOP_SECONDS), at
        doubling intervals: a call that reaches its engine after its stops is stopped when it does."""
        until, interval = time.monotonic() + LATE_STOP_SECONDS, RESTOP_SECONDS
        while not future.done() and time.monotonic() < until and not self.lost(started, started):
            self.send_stop(cid)
            wait_for([future], timeout=interval)
            interval = min(2 * interval, STOP_TIMEOUT_SECONDS)

    def check(self, stop) -> None:
        """Raise Cancelled (or the watch's own error) when the request is over, after `stop()` (of its call)."""
        try:
            if self.watch is not None and self.watch():
                raise Cancelled()
        except BaseException:
            stop()
            raise

    def send_stop(self, cid: str) -> None:
        """Stop the call `cid` at the engine (it may have ended: no error). Waits for the stop's own answer, so that
        the call's slot is free before the request goes on."""
        try:
            self._stop(cid)
        except Exception as exc:  # the call it stops ends with its model anyway; the request goes on
            pb_utils.Logger.log_warn(f"could not stop {self.model_name} call {cid} of request {self.request_id}: {exc}")

    def _stop(self, request_id: str) -> None:
        """A stop request: the tensors of NVIDIA's send_cancellation_request (input_ids, input_lengths,
        request_output_len 0, stop true) with `request_id`; EngineError when the model refuses it."""
        inputs = [
            pb_utils.Tensor("input_ids", np.zeros((1, 1), np.int32)),
            pb_utils.Tensor("input_lengths", np.zeros((1, 1), np.int32)),
            pb_utils.Tensor("request_output_len", np.zeros((1, 1), np.int32)),
            pb_utils.Tensor("stop", np.ones((1, 1), np.bool_)),
        ]
        call = pb_utils.InferenceRequest(
            model_name=self.model_name, inputs=inputs, requested_output_names=[], request_id=request_id
        )

        def run():
            responses = list(call.exec(decoupled=True)) if self.decoupled else [call.exec()]
            self.kept += responses
            for response in responses:
                if response.has_error():
                    raise self.failure(response.error())

        try:
            self.calls.submit(run).result(timeout=STOP_TIMEOUT_SECONDS)
        except FutureTimeout:
            raise EngineError(f"{self.model_name}: no answer to a stop within {STOP_TIMEOUT_SECONDS:g} s") from None

    def _gone(self) -> EngineUnavailable:
        return EngineUnavailable(f"{self.model_name}: its process died while this request's call was open")

    def _bound(self) -> tuple[float, str] | None:
        """(seconds left, what bounds it) of the tightest bound on a call now, or None."""
        bounds = []
        if self.call_timeout_ms:
            bounds.append((self.call_timeout_ms / 1000, f"{self.call_timeout_ms} ms (draft_timeout_ms)"))
        if self.deadline is not None:
            bounds.append((self.deadline - time.monotonic(), "the request's timeout_ms"))
        return min(bounds) if bounds else None


_END = object()  # the pump's last item


class _Stream:
    """A streaming call as the loop reads it (trtspec.orchestrator.loop.EngineStream): each item holds the tokens of
    every response that has come since the previous item (a streaming engine sends only the tokens since its previous
    response; TensorRT-LLM's sends one response per token): while the request was busy sending its own response,
    the engine's responses gather and the next read takes them all as one, so the request's next response carries
    them together. A thread of the client's `calls` reads
    the call's responses into a queue, which the request reads with WATCH_SECONDS waits: between responses it
    checks the client's watch, the request's bound (a timer stops the call there) and whether the model died. A
    stopped call is still read to its final response, which the engine sends within a step; until it comes, the stop
    goes again every RESTOP_SECONDS (see RESTOP_SECONDS). A call stopped before it left is not sent."""

    def __init__(self, client: BlsEngineClient, call, flight: _Flight):
        self.client, self.call, self.flight, self.cid = client, call, flight, flight.cid
        self.finished = self.stopping = self.expired = False
        self.ending = False  # stopped by stop_soon: read on to the last response
        self.stopped_at: float | None = None  # when a stop last went to the engine
        self.results = StreamedResults()  # the log probs of every token so far come with each response

    def __iter__(self):
        client = self.client
        client.check(lambda: None)  # a request already over sends nothing
        bound = client._bound()
        if bound is not None and bound[0] <= 0:
            raise EngineError(f"{client.model_name}: no answer within {bound[1]}; not sent, no time was left")
        timer = threading.Timer(bound[0], self._expire) if bound else None
        if timer is not None:
            timer.daemon = True
            timer.start()
        items: queue.SimpleQueue = queue.SimpleQueue()

        def pump():
            if not self.flight.depart():
                self.call = None
                items.put(_END)
                return
            client.reloader.opened(client.model_name, 1)
            responses: list = []
            try:
                for response in self.call.exec(decoupled=True):
                    responses.append(response)
                    items.put(response)
            except Exception as exc:  # pb_utils.TritonModelException: e.g. a model that is not loaded
                items.put(exc)
            finally:
                client.reloader.opened(client.model_name, -1)
                self.call = None  # its inputs: the whole sequence
                client.kept += responses
            items.put(_END)

        started = heard = checked = time.monotonic()
        client.calls.submit(pump)
        ahead: deque = deque()  # what the last gathering read past: the call's end or a failure
        try:
            while True:
                try:
                    item = ahead.popleft() if ahead else items.get(timeout=WATCH_SECONDS)
                except queue.Empty:
                    item = None
                now = time.monotonic()
                if item is _END:
                    self.finished = True
                    break
                if item is None:  # silence
                    if client.lost(started, heard):
                        self.finished = True  # nothing more will come, and there is no one to stop
                        raise client._gone()
                elif isinstance(item, Exception):
                    self.finished = True
                    raise client.failure(str(item))
                else:
                    heard = now
                    if item.has_error():
                        self.finished = True  # an error is the call's last response: nothing left to stop
                        raise client.failure(item.error())
                    client.reloader.answered(client.model_name)
                    results = [self._result(item)]
                    while (more := _ready(items)) is not None:  # every response already here, as one item
                        if isinstance(more, Exception) or more is _END or more.has_error():
                            ahead.append(more)
                            break
                        results.append(self._result(more))
                    if not self.stopping:
                        yield merge_results(results)
                self._restop(now)
                if not self.stopping and now - checked >= WATCH_SECONDS:
                    checked = now
                    try:
                        client.check(self._stop_call)  # stops the call first when the request is over
                    except BaseException:
                        self.stopping = True
                        raise
        finally:
            if timer is not None:
                timer.cancel()
            if not self.finished and self.stopping:
                self._drain(items, started)
        if self.expired:
            raise EngineError(f"{client.model_name}: no answer within {bound[1]}; stopped it")

    def _result(self, response) -> GenerationResult:
        return self.results({t.name(): t.as_numpy().copy() for t in response.output_tensors()})

    def _drain(self, items: queue.SimpleQueue, started: float) -> None:
        """Wait for a stopped call's last response (it comes within an engine step), unless its model died."""
        heard = time.monotonic()
        while True:
            try:
                item = items.get(timeout=WATCH_SECONDS)
            except queue.Empty:
                if self.client.lost(started, heard):
                    return
                self._restop(time.monotonic())
                continue
            if item is _END:
                self.finished = True
                return
            heard = time.monotonic()
            self._restop(heard)

    def _expire(self) -> None:
        self.expired = True
        self.stop()

    def stop(self) -> None:
        if not self.finished and not self.stopping:
            self.stopping = True
            if not self.ending:
                self._stop_call()

    def stop_soon(self) -> None:
        if not self.finished and not self.stopping and not self.ending:
            self.ending = True
            self._stop_call()

    def _stop_call(self) -> None:
        if self.flight.stop():  # it has left: only the engine can end it
            self.stopped_at = time.monotonic()
            self.client.send_stop(self.cid)

    def _restop(self, now: float) -> None:
        """The stop again, for a call still going RESTOP_SECONDS after it."""
        if self.stopped_at is not None and not self.finished and now - self.stopped_at >= RESTOP_SECONDS:
            self.stopped_at = now
            self.client.send_stop(self.cid)


def _ready(items: queue.SimpleQueue):
    """The next item if one is waiting, else None."""
    try:
        return items.get_nowait()
    except queue.Empty:
        return None
