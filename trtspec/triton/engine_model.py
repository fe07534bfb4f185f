"""The engine models (`tensorrt_llm`, `tensorrt_llm_draft`) on the embedded torch backend.

Each request's tensors are those of TRT-LLM's `tensorrt_llm` model (trtspec.contract.ENGINE_INPUTS /
ENGINE_OUTPUTS). `execute` only checks and queues: the engine's scheduler runs on its own thread and batches
every queued call into each forward pass (in-flight batching, trtspec.engine.scheduler), and each request is
answered through its response sender as soon as its call ends, so a short verification never waits for a
long generation that shares its steps. As TensorRT-LLM's backend: a request of batch size B > 1 needs a decoupled
model, and becomes B calls, each answered by its own response with its `batch_index`; `streaming` needs a
decoupled model too, and then each token goes out as it is chosen. A request with `stop` true stops the calls
of the latest request that carried its request id, as TensorRT-LLM's backend maps ids (trtspec.engine.scheduler):
they end within one step with the tokens they have. Calls wait for a batch slot in a queue bounded as the backend
bounds it, by the config's `dynamic_batching { default_queue_policy { max_queue_size } }` (none: no bound; the
repository writes one); a request whose rows would take it past that is refused at once, UNAVAILABLE (HTTP 503).
Metrics: `trtspec_engine_calls_total` (calls queued, one per row: TensorRT-LLM's executor requests),
`trtspec_engine_tokens_total` (tokens the calls returned) and `trtspec_engine_running_calls` (calls holding a batch
slot now).
Parameters: `engine_dir`, `device` ("cpu" or "cuda[:N]"), `enable_kv_cache_reuse`, `forward` (auto, compact, hf).
"""

from __future__ import annotations

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from trtspec.contract import KV_TOKENS_PER_BLOCK, tensors_to_request
from trtspec.errors import EngineError, RequestError
from trtspec.interfaces import ENGINE_INPUT_NAMES
from trtspec.triton.common import (
    METRIC_CALLS,
    bool_parameter,
    error_response,
    input_arrays,
    model_parameters,
    parameter,
)

REPORT_SECONDS = 0.25  # how stale the metrics may be (the governor reads the KV gauges once a second)


class TritonPythonModel:
    def initialize(self, args):
        import torch

        params = model_parameters(args)
        self.name = args.get("model_name", "tensorrt_llm")
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.max_queue_size = max_queue_size(config)
        device = parameter(params, "device", "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineError(
                f"{self.name}: device '{device}' is configured but no CUDA device is available; "
                "regenerate the repository with `trtspec deploy --device cpu`"
            )
        # One thread loads the engine and then runs every forward pass (see Scheduler.serve); `execute` only
        # checks and queues, so requests join the running batch at every step.
        self.engine = None
        self.metrics = _Metrics(self.name, str(args.get("model_version", "1")))
        loaded, failure = threading.Event(), []
        threading.Thread(
            target=self._run, args=(params, device, loaded, failure), name="trtspec-engine", daemon=True
        ).start()
        loaded.wait()
        if failure:
            raise failure[0]
        pb_utils.Logger.log_info(
            f"{self.name}: {type(self.engine.model).__name__} on {device}, linears {self.engine.model.kernel_summary}, "
            "batch-invariant logits: "
            f"{'yes' if self.engine.batch_invariant else 'no (validation classifies near-ties)'}"
        )

    def _run(self, params, device: str, loaded: threading.Event, failure: list) -> None:
        from trtspec.engine.runtime import Engine

        try:
            engine = Engine.load(parameter(params, "engine_dir"), device, forward=parameter(params, "forward", "auto"))
            if not bool_parameter(params, "enable_kv_cache_reuse", True):
                engine.cache.reuse = False  # nothing is kept: every request computes its whole sequence
            engine.scheduler.max_queue_size = self.max_queue_size
            block = KV_TOKENS_PER_BLOCK * engine.model.kv_bytes_per_token
            pool = engine.scheduler.pool
            self.metrics.watch(
                max(1, engine.cache.budget_bytes // block),
                lambda: (len(engine.scheduler.running), -(-pool.running_bytes // block)),
            )
            self.engine = engine
        except BaseException as exc:  # reported by initialize, which fails the model's load
            failure.append(exc)
            return
        finally:
            loaded.set()
        engine.scheduler.serve()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except Exception as exc:  # the Triton edge: every failure becomes exactly one error response
                sender.send(error_response(exc, self.name), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _submit(self, request, sender) -> None:
        self._queue(engine_inputs(request), sender, request.request_id())

    def _queue(self, tensors: dict[str, np.ndarray], sender, request_id: str) -> None:
        if "stop" in tensors and np.any(tensors["stop"]):
            return self._stop(request_id, sender)
        calls = [tensors_to_request(row) for row in split_rows(tensors)]
        if len(calls) > 1 and not self.decoupled:
            # TensorRT-LLM's backend refuses it: "Batch size > 1 requires the tensorrt_llm backend to be using
            # decoupled transaction policy" (model_instance_state.cc, 1.2.0rc8)
            raise RequestError(
                "input_ids",
                f"a batch of {len(calls)} requests needs a decoupled model, as TensorRT-LLM's "
                "backend does; send one request at a time, or redeploy with "
                "`trtspec deploy --decoupled-mode true` (the default)",
            )
        for call in calls:  # every row is checked before any is queued
            self.engine.check(call)
        if "streaming" in tensors and np.any(tensors["streaming"]):
            return self._stream(calls, tensors, sender, request_id)
        if len(calls) == 1:

            def respond(outcome):
                sender.send(self._response(calls[0], outcome), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

            return self._submit_all([(calls[0], respond, None)], request_id)
        # a batch (decoupled only): one response per row as it ends, with its batch_index, as TensorRT-LLM answers
        left, lock = [len(calls)], threading.Lock()

        def done(i, outcome):  # called on the engine's thread as each row's call ends
            response = self._response(calls[i], outcome, batch_index=i)
            with lock:
                left[0] -= 1
                last = not left[0]
            sender.send(response)
            if last:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

        self._submit_all(
            [(call, lambda outcome, i=i: done(i, outcome), None) for i, call in enumerate(calls)], request_id
        )

    def _submit_all(self, calls: list[tuple], request_id: str) -> None:
        """Queue a request's calls (request, done, on_token) together: all of them, or none when the engine's queue
        is full (EngineBusy: the request gets UNAVAILABLE)."""
        self.engine.submit_all(calls, request_id)
        self.metrics.count("calls", len(calls))

    def _stop(self, request_id: str, sender) -> None:
        """A stop request: the calls of the latest request with this id end within one step, each with a final
        response holding what it has; the stop itself gets one empty final response. An id with no call running is
        no error (the call may have ended), as TensorRT-LLM's handleStopRequest (model_instance_state.cc, 1.2.0rc8),
        which also refuses a stop without an id: "Trying to stop a request but request ID is not provided"."""
        if not request_id:
            raise RequestError(
                "request_id",
                "a stop request (stop: true) must carry the request id of the call to stop; "
                "Trying to stop a request but request ID is not provided",
            )
        self.engine.cancel(request_id)
        sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _stream(self, calls, tensors, sender, request_id: str) -> None:
        """streaming: one response per token, each with that token alone (output_ids [1, 1, 1], sequence_length 1),
        the last one with the final flag and the request's other outputs (no token, when the call was stopped
        between two), as TensorRT-LLM streams: only the tokens since the last response, exclude_input_in_output or
        not (LlmRequest::createResult)."""
        if not self.decoupled:  # TensorRT-LLM refuses it: "Streaming is only supported if model is deployed using
            # decoupled mode." (utils.cc createRequestsFromInputTensors, 1.2.0rc8)
            raise RequestError(
                "streaming",
                "needs a decoupled model; this one is deployed with decoupled_mode false "
                "(redeploy with `trtspec deploy --decoupled-mode true`, the default, or leave streaming false)",
            )
        if len(calls) != 1:
            raise RequestError(
                "streaming", f"streams one request at a time, got a batch of {len(calls)}; send each row alone"
            )
        call, streamed = calls[0], [0]

        def part(result, final: bool):
            """The tokens since the last response and their logits, the log probs of all so far, the other outputs
            (perf metrics on every response, as TensorRT-LLM writes them)."""
            out = self.engine.result_tensors(call, result)
            start, streamed[0] = streamed[0], len(result.new_tokens)
            rest = result.new_tokens[start:]
            out["output_ids"] = np.asarray([[rest]], dtype=np.int32)
            out["sequence_length"] = np.asarray([[len(rest)]], dtype=np.int32)
            # output_log_probs stays whole: TensorRT-LLM sends the log probs of every token so far with each
            # response (llmRequest.cpp createResult, 89fd9b74: logProbs unsliced, unlike outputTokenIds), and
            # cum_log_probs their sum
            if "generation_logits" in out:
                out["generation_logits"] = out["generation_logits"][:, :, start:]
            if not final:
                out.pop("context_logits", None)  # once, with the last response
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
            sender.send(
                pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor(n, np.ascontiguousarray(v)) for n, v in out.items()]
                ),
                flags=flags,
            )

        def done(outcome):
            if isinstance(outcome, BaseException):
                sender.send(error_response(outcome, self.name), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                self.metrics.count("tokens", len(outcome.new_tokens))
                part(outcome, True)

        def token(result):
            part(result, False)

        self._submit_all([(call, done, None if call.draft_input_ids else token)], request_id)

    def _response(self, call, outcome, batch_index: int | None = None):
        if isinstance(outcome, BaseException):
            return error_response(outcome, self.name)
        self.metrics.count("tokens", len(outcome.new_tokens))
        outputs = self.engine.result_tensors(call, outcome)
        if batch_index is not None:
            outputs["batch_index"] = np.asarray([[batch_index]], dtype=np.int32)
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor(name, np.ascontiguousarray(value)) for name, value in outputs.items()]
        )

    def finalize(self):
        if self.engine is not None:
            self.engine.stop()
        self.engine = None
        self.metrics.stop()


class _Metrics:
    """The engine model's metrics, sent to the server every REPORT_SECONDS from a thread of their own. Each update
    is a message to the server process (0.1 ms each, measured in the stub); sent as things happened, three lay on
    every call's path (its count, its tokens, the running calls before its first step) and more followed on the
    forward thread after it."""

    def __init__(self, model: str, version: str):
        labels = {"model": model}
        self._families = [  # a family must outlive its metrics
            pb_utils.MetricFamily(
                name="trtspec_engine_calls_total",
                kind=pb_utils.MetricFamily.COUNTER,
                description="Engine calls queued (one per request row; stop requests not counted)",
            ),
            pb_utils.MetricFamily(
                name="trtspec_engine_tokens_total",
                kind=pb_utils.MetricFamily.COUNTER,
                description="Tokens the engine's calls returned (a stopped call's included)",
            ),
            pb_utils.MetricFamily(
                name="trtspec_engine_running_calls",
                kind=pb_utils.MetricFamily.GAUGE,
                description="Engine calls holding a batch slot",
            ),
        ]
        calls, tokens, self._running = (f.Metric(labels=labels) for f in self._families)
        self._counters = {"calls": calls, "tokens": tokens}
        # TensorRT-LLM's backend reports its KV cache under this family (custom_metrics_reporter.cc: labels model,
        # version, kv_cache_block_type); the embedded engine reports its budget the same way, in blocks of
        # KV_TOKENS_PER_BLOCK tokens, so one rule, one panel and the governor read either.
        kv = pb_utils.MetricFamily(
            name="nv_trt_llm_kv_cache_block_metrics",
            kind=pb_utils.MetricFamily.GAUGE,
            description="TRT LLM KV cache block metrics",
        )
        self._families.append(kv)
        kv_labels = {"model": model, "version": version}
        self._kv = {
            kind: kv.Metric(labels=kv_labels | {"kv_cache_block_type": kind})
            for kind in ("max", "free", "used", "tokens_per", "fraction")
        }
        self._lock = threading.Lock()
        self._pending = dict.fromkeys(self._counters, 0)
        self._state = None  # () -> (running calls, KV blocks in use), once the engine is loaded
        self._shown: tuple | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def count(self, kind: str, n: int) -> None:
        with self._lock:
            self._pending[kind] += n

    def watch(self, blocks: int, state) -> None:
        """Report the engine's KV budget (`blocks`) and, from now on, its `state()`, starting with the present."""
        self._blocks, self._state = blocks, state
        with METRIC_CALLS:
            self._kv["max"].set(blocks)
            self._kv["tokens_per"].set(KV_TOKENS_PER_BLOCK)
        self.flush()
        self._thread = threading.Thread(target=self._run, name="trtspec-metrics", daemon=True)
        self._thread.start()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, dict.fromkeys(self._counters, 0)
        with METRIC_CALLS:  # flushed by the loader's thread once, then by the metrics thread
            for kind, n in pending.items():
                if n:
                    self._counters[kind].increment(n)
            if self._state is None:
                return
            running, used = self._state()
            used = min(self._blocks, used)
            if (running, used) != self._shown:
                self._shown = (running, used)
                self._running.set(running)
                for kind, value in (("free", self._blocks - used), ("used", used), ("fraction", used / self._blocks)):
                    self._kv[kind].set(value)

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
        self.flush()

    def _run(self) -> None:
        while not self._stopped.wait(REPORT_SECONDS):
            self.flush()


def max_queue_size(config: dict) -> int:
    """The bound on calls waiting for a batch slot, where TensorRT-LLM's backend reads it
    (model_instance_state.cc getExecutorConfigFromParams: dynamic_batching.default_queue_policy.max_queue_size, into
    ExecutorConfig maxQueueSize); 0, or no dynamic_batching, is no bound, as there."""
    policy = (config.get("dynamic_batching") or {}).get("default_queue_policy") or {}
    return int(policy.get("max_queue_size") or 0)


def engine_inputs(request) -> dict[str, np.ndarray]:
    """The `tensorrt_llm` inputs a request carries, by name."""
    return {name: value for name, value in input_arrays(request).items() if name in ENGINE_INPUT_NAMES}


def split_rows(tensors: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """A request's tensors [B, ...] -> B single-row requests [1, ...]."""
    sizes = {name: np.asarray(v).shape[0] if np.ndim(v) else 1 for name, v in tensors.items()}
    batch = max(sizes.values(), default=1)
    uneven = [name for name, size in sizes.items() if size != batch]
    if uneven:
        raise RequestError(uneven[0], f"has batch size {sizes[uneven[0]]}, other inputs have {batch}")
    if batch == 1:
        return [tensors]
    return [{name: np.asarray(v)[i : i + 1] for name, v in tensors.items()} for i in range(batch)]
