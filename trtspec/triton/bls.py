"""The `tensorrt_llm_bls` model: the speculative loop served by Triton's Python backend (decoupled).

It accepts the stock BLS request fields, checks them into a request, and runs it as a session of the deployment
(`trtspec.orchestrator.session`: what a request may do at the load, the loop, what its outcome teaches) with two
engine clients that call the `tensorrt_llm` and `tensorrt_llm_draft` models through BLS; it sends what the session
yields as responses. Requests run on a
thread pool, so many are served at once: a request waits for the engines, never for another request's
whole generation. Each failure becomes exactly one error response, and the model keeps serving.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from trtspec.calibration import CALIBRATION_ENV
from trtspec.capture import Capture, captured
from trtspec.checkpoint import declared_end_ids
from trtspec.contract import BLS_INPUTS, Penalties, SamplingParams, check_neutral
from trtspec.control import CONTROL_ENV
from trtspec.errors import Cancelled, DeadlineExceeded, EngineUnavailable, RequestError
from trtspec.orchestrator.detok import IncrementalDetokenizer
from trtspec.orchestrator.drafters.prediction import prediction_tokens, prediction_usage
from trtspec.orchestrator.loop import SpecRequest, Trace
from trtspec.orchestrator.session import Deployment, Request, Session, draft_length
from trtspec.orchestrator.stats import RequestStats
from trtspec.promote import DraftVersionWatch
from trtspec.request_limits import (
    check_prompt_chars,
    check_returned_logits,
    check_words,
    deadline_advice,
    deadline_ms,
    finite,
    utf8,
)
from trtspec.serving_settings import ServingSettings
from trtspec.stream_sender import Held, check_interval
from trtspec.triton.common import error_response, input_arrays, load_tokenizer, model_parameters
from trtspec.triton.engine_client import WATCH_SECONDS, BlsEngineClient
from trtspec.triton.kv_watch import METRICS_ENV, KvWatch
from trtspec.triton.metrics import Metrics
from trtspec.triton.recovery import Reloader
from trtspec.triton.stream_metrics import StreamCounters


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]
        self.batched = int(json.loads(args["model_config"]).get("max_batch_size", 0)) > 0
        self.settings = settings = ServingSettings.from_parameters(model_parameters(args))
        workers = settings.max_concurrent_requests
        # every engine call is read here (a request has at most a call and its stop open per engine); a call to a
        # model that died never ends and keeps its thread, hence the room
        self.calls = ThreadPoolExecutor(max_workers=8 * workers + 8, thread_name_prefix="engine-call")
        decoupled = settings.engine_decoupled_mode
        self.reloader = Reloader(self.name, Path(args["model_repository"]).parent)
        self.target = BlsEngineClient(
            settings.tensorrt_llm_model_name, calls=self.calls, reloader=self.reloader, decoupled=decoupled
        )
        draft_name = settings.tensorrt_llm_draft_model_name
        self.draft = (
            BlsEngineClient(
                draft_name,
                calls=self.calls,
                reloader=self.reloader,
                call_timeout_ms=settings.draft_timeout_ms,
                decoupled=decoupled,
            )
            if draft_name
            else None
        )
        self._peaks: dict[int, int] = {}  # requests in flight: the most requests in flight during each one's life
        self._active_lock = threading.Lock()
        self.tokenizer = load_tokenizer(settings.tokenizer_dir)
        # every token the target ends on (Llama 3.x Instruct declares three): the first is the engine's end_id
        self.end_ids = declared_end_ids(settings.tokenizer_dir, self.tokenizer.eos_token_id)
        self.metrics = Metrics(self.name, settings.build_info())
        self.draft_version = DraftVersionWatch(Path(args["model_repository"]).parent)
        # `trtspec serve --capture`: a sample of finished requests, encoded and written by a thread of its own
        self.capture = Capture.from_env(decode=self.tokenizer.decode, on_error=pb_utils.Logger.log_warn)
        self.streamed = StreamCounters(self.name, "bls")  # messages per token of the BLS's streamed responses
        self.reloader.health.on_change = self.metrics.engine_health  # the liveness signal (trtspec.engine_health)
        for engine in filter(None, (settings.tensorrt_llm_model_name, draft_name)):  # at 0 from the start
            self.metrics.engine_health(engine, None)
        self.metrics.gpu_memory_planned(settings.gpu_memory_planned_fraction)
        # costs, governors, the draft breaker and the control file, shared by this instance's requests
        self.deployment = Deployment(
            settings,
            self,
            draft_name=draft_name,
            control_file=os.environ.get(CONTROL_ENV),
            calibration_file=os.environ.get(CALIBRATION_ENV),
        )
        # KV-cache pressure on the target, from the server's own metrics (trtspec.triton.kv_watch)
        self.kv_watch = None
        if os.environ.get(METRICS_ENV):
            self.kv_watch = KvWatch(
                os.environ[METRICS_ENV],
                self.target.model_name,
                lambda fraction: (self.deployment.governor.kv_cache(fraction), self.metrics.kv_cache_usage(fraction)),
                on_problem=lambda message: pb_utils.Logger.log_warn(f"{self.name}: {message}"),
            )
        else:
            pb_utils.Logger.log_info(
                f"{self.name}: no {METRICS_ENV} (set by `trtspec serve`): the governor goes without the KV-cache signal"
            )
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bls")
        # beyond the requests being served and those allowed to wait, new ones are refused at once
        self.max_admitted = workers + settings.max_queued_requests
        self._admitted = 0  # requests being served or waiting for a thread

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            with self._active_lock:
                refuse = self._admitted >= self.max_admitted
                self._admitted += not refuse
                self._show_load()
            if refuse:
                busy = EngineUnavailable(
                    f"the server is busy ({self.settings.max_queued_requests} requests are already waiting, "
                    "max_queued_requests); retry later"
                )
                self.metrics.error("refused")
                sender.send(error_response(busy, self.name), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            self.pool.submit(self._serve, request, sender, time.monotonic())
        return None

    def finalize(self):
        if self.capture is not None:
            self.capture.close()  # what is queued is written
        if self.kv_watch is not None:
            self.kv_watch.close()
        self.reloader.close()
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.calls.shutdown(wait=False, cancel_futures=True)  # a call to a dead model must not hold up the unload

    # ---- one request ----------------------------------------------------------------------------------------
    def _serve(self, request, sender, arrived: float) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            self._run(request, sender, arrived)
        except Cancelled:
            error = pb_utils.TritonError("request cancelled", pb_utils.TritonError.CANCELLED)
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=final)
        except Exception as exc:  # the Triton edge: every failure becomes exactly one error response
            sender.send(error_response(exc, self.name), flags=final)
            self.metrics.error(error_kind(exc))
        finally:
            with self._active_lock:
                self._admitted -= 1
                self._show_load()

    def _show_load(self) -> None:  # vLLM's running and waiting gauges; the caller holds _active_lock, so in order
        self.metrics.requests_in_flight(len(self._peaks), self._admitted - len(self._peaks))

    def _run(self, request, sender, arrived: float) -> None:
        key = id(sender)
        with self._active_lock:
            self._peaks[key] = 0
            load = len(self._peaks)
            for k in self._peaks:
                self._peaks[k] = max(self._peaks[k], load)
            self._show_load()

        def peak_load() -> int:
            with self._active_lock:
                return self._peaks[key]

        try:
            self._generate(_Fields(request), sender, load, peak_load, arrived)
        finally:
            with self._active_lock:
                del self._peaks[key]

    def _generate(self, fields: _Fields, sender, load: int, peak_load, arrived: float) -> None:
        """Serve one request; `load`: the requests in flight when it started, itself included; `peak_load()`:
        the most in flight so far during its life; `arrived`: when Triton handed it over (its deadline counts
        from there, queueing included)."""
        timeout_ms, deployments = deadline_ms(fields.scalar("timeout_ms", int, 0), self.settings.request_timeout_ms)

        asked = [0.0, False]  # when Triton was last asked whether the client cancelled, and its answer

        def stop() -> bool:  # checked between iterations and while a target call runs: cancelled, or past the deadline
            now = time.monotonic()
            if timeout_ms and (now - arrived) * 1000 > timeout_ms:
                raise DeadlineExceeded(deadline_advice(timeout_ms, deployments))
            if now - asked[0] >= WATCH_SECONDS:  # each question is an IPC round trip to the server process
                asked[:] = [now, sender.is_cancelled()]
            return asked[1]

        deadline = arrived + timeout_ms / 1000 if timeout_ms else None
        plan = self._parse(fields)
        spec = plan.spec
        # a message carries what was read since the last one went (trtspec.stream_sender); interval: N at a time
        held = Held(check_interval(fields.scalar("stream_interval", int, self.settings.stream_interval)))
        draft = self.draft.for_request if self.draft is not None else None
        session = self.deployment.start(
            plan.request,
            load,
            target=self.target.for_request(plan.request_id, deadline, watch=stop),
            # the request's deadline does not bound a draft call (BlsEngineClient): it watches the client alone
            draft=(lambda: draft(plan.request_id, watch=sender.is_cancelled)) if draft else None,
            peak_load=peak_load,
            load_now=lambda: len(self._peaks),
            cancelled=stop,
            recover=self._recovery(deadline, stop),
            arrived=arrived,
        )
        try:
            detok = IncrementalDetokenizer(self.tokenizer, self.settings.skip_special_tokens)
            # Like TRT-LLM, a streamed response carries new text only; a single response repeats the prompt
            # unless exclude_input_in_output is set.
            prompt_text = "" if plan.exclude_input or spec.stream else fields.text("text_input")
            ids: list[int] = []
            text = []
            run = _Run(session, len(spec.prompt))
            for chunk in session.run():
                ids += chunk
                piece = detok.push(chunk)
                if spec.stream:
                    if (out := held.push(chunk, piece)) is not None:
                        sender.send(self._response(out[1], out[0], plan, run, held.tokens))
                else:
                    text.append(piece)
            rest = detok.flush()
            draft_version = self.draft_version.current()  # the draft model's, from `trtspec promote`
            self.metrics.record(session.stats, session.times_ns, draft_version)
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            if plan.prediction is not None:
                run.prediction_usage = prediction_usage(plan.prediction, ids)
            if spec.stream:
                last, before = held.take()
                sender.send(self._response(before + rest, last, plan, run, len(ids), final=True), flags=flags)
                self.streamed.add(held.sent, held.tokens)
            else:
                sender.send(
                    self._response(prompt_text + "".join(text) + rest, ids, plan, run, len(ids), final=True),
                    flags=flags,
                )
            if self.capture is not None:  # a sample for `trtspec distill`, written off the request path
                self.capture.offer(captured(self.name, spec, ids, session.stats, draft_version), store=plan.store)
        except Exception as exc:
            session.finish(exc)
            raise
        session.finish()

    # ---- the engine models' health ---------------------------------------------------------------------------
    def _recovery(self, deadline: float | None, stop):
        """The loop's `recover` for one request: reload the target if its process died and wait for it, within
        target_recovery_timeout_ms from the request's first wait and its own deadline; `stop` raises past the
        deadline and says whether the client left."""
        limit: list[float] = []

        def recover(cause: EngineUnavailable) -> None:
            model = self.target.model_name
            if not limit:
                limit.append(time.monotonic() + self.settings.target_recovery_timeout_ms / 1000)
                pb_utils.Logger.log_warn(
                    f"{self.name}: {str(cause).rstrip('.')}; the request waits for {model} to serve again"
                )

            def check() -> None:
                if stop():
                    raise Cancelled()

            until = min(limit[0], deadline) if deadline is not None else limit[0]
            if not self.reloader.wait(model, until, check):
                check()  # past the request's own deadline: that error, naming timeout_ms
                raise EngineUnavailable(
                    f"{model} is unavailable ({str(cause).rstrip('.')}) and was not serving again "
                    f"within {self.settings.target_recovery_timeout_ms} ms (target_recovery_timeout_ms); "
                    "retry the request"
                )

        return recover

    # ---- what the deployment reports (trtspec.orchestrator.session.Events) -----------------------------------
    def log(self, level: str, message: str) -> None:
        (pb_utils.Logger.log_warn if level == "warn" else pb_utils.Logger.log_info)(f"{self.name}: {message}")

    def governed(self, load: str, old: str, new: str, reason: str, cap: int) -> None:
        """A change of a load range's speculation level (judged, a floor's, or a force's): logged once, counted by
        reason, in the state gauge."""
        self.log("warn", f"speculation at load {load} {old} -> {new} ({reason}); draft-length cap now {cap}")
        self.metrics.governor_change(load, new, reason)
        self.metrics.governor(load, new, cap)

    def governor_state(self, load: str, state: str, cap: int) -> None:
        self.metrics.governor(load, state, cap)

    def break_even(self, loads: str, acceptance: float) -> None:
        self.metrics.break_even(loads, acceptance)

    def calibrated(self, calibration) -> None:
        self.metrics.calibration(calibration)

    def _parse(self, f: _Fields) -> _Plan:
        """A request's fields as a plan, checked in this order (a request with several problems is told the first):
        string inputs are UTF-8, neutral inputs, the prompt, max_tokens, the draft source and length, sampling, end
        and pad ids, the word lists, seed and min_tokens, the logits asked for, the penalties."""
        f.check_text()
        check_neutral(f.inputs, BLS_INPUTS)
        prompt = self._prompt(f)
        max_tokens = self._max_tokens(f, len(prompt))
        method, k = self._draft_length(f)
        temperature, top_k, top_p = self._sampling(f)
        end_id, other_end_ids, pad_id = self._end_and_pad_ids(f)
        stop_words, bad_words = self._words(f, "stop_words"), self._words(f, "bad_words")
        seed = f.scalar("seed", int, None)
        min_tokens = f.scalar("min_tokens", int, 0)
        if min_tokens < 0:
            raise RequestError("min_tokens", f"must be >= 0, got {min_tokens}")
        self._check_logits_wanted(f, len(prompt), max_tokens)
        penalties = self._penalties(f, len(prompt))
        prediction = None
        if f.has("prediction"):  # OpenAI's Predicted Outputs: a draft source, and its counts in the answer
            s = self.settings
            prediction = prediction_tokens(
                self.tokenizer, f.text("prediction"), max_chars=s.max_input_chars, max_tokens=s.max_seq_len
            )
        spec = SpecRequest(
            prompt=prompt,
            max_tokens=max_tokens,
            num_draft_tokens=k,
            sampling=SamplingParams(temperature, top_k, top_p, seed),
            end_id=None if end_id == -1 else end_id,
            pad_id=pad_id,
            stop_words=stop_words,
            other_end_ids=other_end_ids,
            stream=f.scalar("stream", bool, False),
            min_tokens=min_tokens,
            penalties=penalties,
            bad_words=bad_words,
            return_log_probs=f.scalar("return_log_probs", bool, False),
            return_context_logits=f.scalar("return_context_logits", bool, False),
            return_generation_logits=f.scalar("return_generation_logits", bool, False),
            return_perf_metrics=f.scalar("return_perf_metrics", bool, False),
        )
        return _Plan(
            spec=spec,
            method=method,
            use_logits=f.scalar("use_draft_logits", bool, self.settings.use_draft_logits_default),
            adaptive=f.scalar("adaptive_draft_length", bool, self.settings.adaptive_draft_length),
            want_perf=f.scalar("return_perf_metrics", bool, False),
            final_perf_only=f.scalar("final_perf_metrics_only", bool, False),
            exclude_input=f.scalar("exclude_input_in_output", bool, False),
            request_id=f.request_id,
            input_tokens=f.scalar("return_num_input_tokens", bool, False),
            output_tokens=f.scalar("return_num_output_tokens", bool, False),
            prediction=prediction,
            store=f.scalar("store", bool, None),
        )

    def _prompt(self, f: _Fields) -> list[int]:
        """text_input's token ids, within the deployment's max_input_len."""
        text = f.text("text_input")
        if not text:
            raise RequestError("text_input", "is required and must not be empty")
        check_prompt_chars(text, self.settings)
        prompt = self.tokenizer(text, add_special_tokens=self.settings.add_special_tokens)["input_ids"]
        limit = self.settings.max_input_len
        if len(prompt) > limit:
            raise RequestError(
                "text_input", f"the prompt is {len(prompt)} tokens; this deployment's max_input_len is {limit}"
            )
        return prompt

    def _max_tokens(self, f: _Fields, prompt_len: int) -> int:
        """max_tokens, required, within what max_seq_len leaves after the prompt."""
        max_tokens = f.scalar("max_tokens", int, None)
        if max_tokens is None:
            raise RequestError("max_tokens", "is required")
        budget = self.settings.max_seq_len - prompt_len
        if not 0 < max_tokens <= budget:
            raise RequestError(
                "max_tokens",
                f"must be between 1 and {budget} (max_seq_len {self.settings.max_seq_len} "
                f"minus the {prompt_len}-token prompt), got {max_tokens}",
            )
        return max_tokens

    def _draft_length(self, f: _Fields) -> tuple[str, int]:
        """The request's draft source and K (trtspec.orchestrator.session.draft_length has the rules)."""
        method, k = f.text("speculation") or None, f.scalar("num_draft_tokens", int, None)
        return draft_length(self.settings, method, k, has_draft_model=self.draft is not None)

    @staticmethod
    def _sampling(f: _Fields) -> tuple[float, int, float]:
        """temperature, top_k and top_p, checked. As TensorRT-LLM reads them (and NVIDIA's BLS passes them on):
        top_k 0 with top_p 0 is greedy whatever the temperature, so sampling from the whole distribution is top_p
        1.0 (SamplingParams)."""
        temperature = f.scalar("temperature", float, 0.0)
        top_k = f.scalar("top_k", int, 0)
        top_p = f.scalar("top_p", float, 0.0)
        if temperature < 0:
            raise RequestError("temperature", f"must be >= 0, got {temperature}")
        if top_k < 0:
            raise RequestError("top_k", f"must be >= 0, got {top_k}")
        if not 0.0 <= top_p <= 1.0:
            raise RequestError("top_p", f"must be within [0, 1], got {top_p}")
        return temperature, top_k, top_p

    def _end_and_pad_ids(self, f: _Fields) -> tuple[int | None, list[int], int | None]:
        """end_id, the other tokens generation ends on, and pad_id: the request's, else the tokenizer's. A client's
        end_id is the only one it ends on; -1 disables it."""
        end_id = f.scalar("end_id", int, self.end_ids[0] if self.end_ids else None)
        other_end_ids = [] if f.has("end_id") else self.end_ids[1:]
        pad_default = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else end_id
        pad_id = f.scalar("pad_id", int, pad_default)
        vocab = len(self.tokenizer)
        for name, value in (("end_id", end_id), ("pad_id", pad_id)):
            if value is not None and not -1 <= value < vocab:
                raise RequestError(name, f"{value} is outside the vocabulary [0, {vocab}) (-1 disables it)")
        return end_id, other_end_ids, pad_id

    def _words(self, f: _Fields, name: str) -> list[list[int]]:
        """stop_words or bad_words: each string one word, tokenized without special tokens (as NVIDIA's
        preprocessing does); empty strings and those without tokens are left out. How many and how long they may be
        is checked first, so the tokenizer never sees more than the deployment allows."""
        given = f.strings(name)
        check_words(name, given, self.settings)
        words = []
        for word in given:
            ids = self.tokenizer(word, add_special_tokens=False)["input_ids"] if word else []
            if ids:
                words.append(ids)
        return words

    def _check_logits_wanted(self, f: _Fields, prompt_len: int, max_tokens: int) -> None:
        """Logits the target engine was not built to gather are refused, as the engine refuses them; so are more
        than max_returned_logits of them (rows of the vocabulary: the prompt's for context logits, max_tokens for
        generation logits), before anything is generated."""
        built = {"context": self.settings.gather_context_logits, "generation": self.settings.gather_generation_logits}
        rows = {"context": prompt_len, "generation": max_tokens}
        wanted = {kind: rows[kind] for kind in built if f.scalar(f"return_{kind}_logits", bool, False)}
        for kind in wanted:
            if not built[kind]:
                only = " (torch backend only)" if kind == "context" else ""
                raise RequestError(
                    f"return_{kind}_logits",
                    f"the target engine was built without gather_{kind}_logits; a deployment whose "
                    f"clients read {kind} logits sets engine.gather_{kind}_logits: true in its build "
                    f"config and rebuilds{only}",
                )
        if wanted:  # rows of the tokenizer's vocabulary: an engine's may be a little wider (vocab_size_padded)
            check_returned_logits(wanted, len(self.tokenizer), self.settings)

    def _penalties(self, f: _Fields, prompt_len: int) -> Penalties:
        # every engine call's input is the prompt and the answer so far: the prompt's own length is what to skip
        ignore = min(max(f.scalar("prompt_ignore_length", int, 0), 0), prompt_len)
        penalties = Penalties(
            f.scalar("repetition_penalty", float, 1.0),
            f.scalar("presence_penalty", float, 0.0),
            f.scalar("frequency_penalty", float, 0.0),
            ignore,
        )
        counted = "presence_penalty" if penalties.presence else "frequency_penalty" if penalties.frequency else None
        if ignore and counted and not self.settings.engine_prompt_ignore_length:
            raise RequestError(
                counted,
                f"cannot skip the prompt's tokens (prompt_ignore_length {ignore}): this deployment's target engine "
                "takes no promptIgnoreLength (TensorRT-LLM 1.2.0 and 1.2.1 do, and the embedded engine); send "
                "prompt_ignore_length 0 to count the prompt's tokens too, as TensorRT-LLM does",
            )
        if not penalties.repetition > 0:
            raise RequestError("repetition_penalty", f"must be > 0 (1: no penalty), got {penalties.repetition}")
        return penalties

    def _response(self, text: str, ids: list[int], plan: _Plan, run: _Run, generated: int, final: bool = False):
        """One response: the text and ids of this chunk (or of the whole answer); the log probs and generation
        logits of its tokens when asked for (cum_log_probs: of every token so far); the token counts and perf
        metrics so far, on every response as NVIDIA's BLS forwards them from tensorrt_llm (or with the final response
        alone when the request says final_perf_metrics_only: each set is 19 tensors to a response); the context logits
        with the last. text_output is flat, one string per request, as NVIDIA's BLS sends it (its clients read
        text_output[0] as the text)."""

        def out(name, value, dtype, batch=True):
            arr = np.asarray(value, dtype=dtype)
            return pb_utils.Tensor(name, arr[None] if self.batched and batch else arr)

        spec, trace = plan.spec, run.trace
        tensors = [out("text_output", [text.encode()], np.object_, batch=False), out("output_ids", ids, np.int32)]
        if spec.return_log_probs:
            tensors += [
                out("output_log_probs", [trace.log_probs[run.sent :]], np.float32),
                out("cum_log_probs", [sum(trace.log_probs)], np.float32),
            ]
        if spec.return_generation_logits and len(trace.generation_logits) > run.sent:
            tensors.append(out("generation_logits", [np.stack(trace.generation_logits[run.sent :])], np.float32))
        run.sent = generated
        if final and spec.return_context_logits and trace.context_logits is not None:
            tensors.append(out("context_logits", trace.context_logits, np.float32))
        if final and run.prediction_usage is not None:
            for name, count in zip(("accepted_prediction_tokens", "rejected_prediction_tokens"), run.prediction_usage):
                tensors.append(out(name, [count], np.int32))
        if plan.input_tokens:
            tensors.append(out("num_input_tokens", [run.input_tokens], np.int32))
        if plan.output_tokens:
            tensors.append(out("num_output_tokens", [generated], np.int32))
        if plan.want_perf and (final or not plan.final_perf_only):
            stats = run.stats
            kv_new, kv_reused, kv_total = trace.kv_blocks
            arrival, scheduled, first, last = run.times_ns
            tensors += [
                out("kv_cache_alloc_new_blocks", [kv_new], np.int32),
                out("kv_cache_reused_blocks", [kv_reused], np.int32),
                out("kv_cache_alloc_total_blocks", [kv_total], np.int32),
                out("arrival_time_ns", [arrival], np.int64),
                out("first_scheduled_time_ns", [scheduled], np.int64),
                out("first_token_time_ns", [first or last or scheduled], np.int64),
                out("last_token_time_ns", [last or scheduled], np.int64),
                out("acceptance_rate", [stats.acceptance_rate], np.float32),
                out("total_accepted_draft_tokens", [stats.num_accepted_tokens], np.int32),
                out("total_draft_tokens", [stats.num_draft_tokens], np.int32),
                out("num_iterations", [stats.iterations], np.int32),
                out("draft_time_ms", [stats.draft_seconds * 1e3], np.float32),
                out("verify_time_ms", [stats.verify_seconds * 1e3], np.float32),
                out("accepted_per_position", stats.accepted_per_position, np.int32),
                out("drafted_per_position", stats.drafted_per_position, np.int32),
                out("finish_reason", [(stats.finish_reason or "").encode()], np.object_),
                out("fallbacks", [sum(stats.fallbacks.values())], np.int32),
                out("fallback_reasons", [f"{r}:{n}".encode() for r, n in stats.fallbacks.items()], np.object_),
                out("draft_sources", [f"{r}:{n}".encode() for r, n in stats.sources.items()], np.object_),
            ]
        return pb_utils.InferenceResponse(output_tensors=tensors)


def error_kind(exc: Exception) -> str:
    """The kind a failed request is counted as (trtspec_request_errors_total; a cancelled one is not a failure)."""
    if isinstance(exc, Cancelled):
        return "cancelled"
    if isinstance(exc, DeadlineExceeded):
        return "timeout"
    if isinstance(exc, RequestError):
        return "bad_request"
    return "engine_error"


@dataclasses.dataclass
class _Run:
    """A request in progress, as its responses report it."""

    session: Session
    input_tokens: int
    sent: int = 0  # tokens whose log probs / logits went out in earlier responses
    prediction_usage: tuple[int, int] | None = None  # accepted and rejected prediction tokens, for the final response

    @property
    def stats(self) -> RequestStats:
        return self.session.stats

    @property
    def trace(self) -> Trace:  # the target's log probs and logits of the emitted tokens, KV blocks
        return self.session.trace

    @property
    def times_ns(self) -> list[int]:  # arrival, first target call, first token, last token (steady clock)
        return self.session.times_ns


@dataclasses.dataclass
class _Plan:
    """A validated request: what to generate and how."""

    spec: SpecRequest
    method: str
    use_logits: bool
    adaptive: bool
    want_perf: bool
    final_perf_only: bool  # final_perf_metrics_only: a streamed request's perf metrics on its final response alone
    exclude_input: bool
    request_id: str
    input_tokens: bool = False  # return_num_input_tokens
    output_tokens: bool = False  # return_num_output_tokens
    prediction: list[int] | None = None  # the `prediction` input's tokens
    store: bool | None = None  # false: the client asked that nothing be kept (never captured)

    @property
    def request(self) -> Request:
        """What the session runs."""
        return Request(
            self.spec, self.method, self.adaptive, self.use_logits, self.request_id, prediction=self.prediction
        )


class _Fields:
    """Typed access to a request's optional input tensors (batch dim, if any, is one request)."""

    def __init__(self, request):
        self.inputs = input_arrays(request)
        # the client's id, or a new one as NVIDIA's BLS makes (uuid4): the engine calls of one request share it
        self.request_id = request.request_id() or str(uuid.uuid4())

    def _get(self, name):
        return self.inputs.get(name)

    def has(self, name: str) -> bool:
        return self._get(name) is not None

    def scalar(self, name: str, kind, default):
        arr = self._get(name)
        if arr is None:
            return default
        flat = arr.reshape(-1)
        if flat.size != 1:
            raise RequestError(name, f"expected one value, got {flat.size}")
        value = flat[0]
        try:
            value = bool(value) if kind is bool else kind(value)
        except (TypeError, ValueError) as exc:
            raise RequestError(name, f"cannot read {value!r} as {kind.__name__}") from exc
        return finite(name, value) if kind is float else value

    def check_text(self) -> None:
        """Every string input is UTF-8, the only text the tokenizer takes, else the request's fault naming it."""
        for name, arr in self.inputs.items():
            if arr.dtype == np.object_:
                for value in arr.reshape(-1):
                    if isinstance(value, bytes):
                        utf8(name, value)

    def strings(self, name: str) -> list[str]:
        arr = self._get(name)
        if arr is None:
            return []
        return [v.decode() if isinstance(v, bytes) else str(v) for v in arr.reshape(-1)]

    def text(self, name: str) -> str:
        values = self.strings(name)
        return values[0] if values else ""
