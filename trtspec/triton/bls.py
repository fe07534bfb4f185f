"""The `tensorrt_llm_bls` model: the speculative loop served by Triton's Python backend (decoupled).

It accepts the stock BLS request fields and runs `trtspec.orchestrator.loop.speculate` with two engine
clients that call the `tensorrt_llm` and `tensorrt_llm_draft` models through BLS. Requests run on a
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

from trtspec.checkpoint import declared_end_ids
from trtspec.contract import BLS_INPUTS, Penalties, SamplingParams, check_neutral
from trtspec.control import CONTROL_ENV, Watcher
from trtspec.errors import Cancelled, DeadlineExceeded, EngineUnavailable, RequestError
from trtspec.interfaces import SPECULATION_METHODS
from trtspec.orchestrator.adaptive import LOOKUP, AdaptiveDraftLength, CostModel, DeploymentCosts, FixedDraftLength
from trtspec.orchestrator.breaker import DraftBreaker, GuardedDrafter
from trtspec.orchestrator.detok import IncrementalDetokenizer
from trtspec.orchestrator.drafters import make_drafter
from trtspec.orchestrator.governor import LoadGovernors, Outcome
from trtspec.orchestrator.loop import SpecRequest, Trace, speculate
from trtspec.orchestrator.stats import RequestStats
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
from trtspec.triton.common import error_response, input_arrays, load_tokenizer, model_parameters
from trtspec.triton.engine_client import WATCH_SECONDS, BlsEngineClient
from trtspec.triton.kv_watch import METRICS_ENV, KvWatch
from trtspec.triton.metrics import Metrics, seconds_per_output_token
from trtspec.triton.recovery import Reloader


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
        self.draft_breaker = DraftBreaker(on_down=self._draft_down, on_up=self._draft_up)
        self.costs = DeploymentCosts(
            CostModel(settings.draft_cost_ratio, settings.verify_cost_per_token, settings.verify_cost_fixed),
            lookup_share=0.0 if draft_name else 1.0,
        )
        self._peaks: dict[int, int] = {}  # requests in flight: the most requests in flight during each one's life
        self._active_lock = threading.Lock()
        self.tokenizer = load_tokenizer(settings.tokenizer_dir)
        # every token the target ends on (Llama 3.x Instruct declares three): the first is the engine's end_id
        self.end_ids = declared_end_ids(settings.tokenizer_dir, self.tokenizer.eos_token_id)
        self.metrics = Metrics(self.name, settings.build_info())
        self.reloader.health.on_change = self.metrics.engine_health  # the liveness signal (trtspec.engine_health)
        for engine in filter(None, (settings.tensorrt_llm_model_name, draft_name)):  # at 0 from the start
            self.metrics.engine_health(engine, None)
        self.metrics.break_even(*self.costs.break_even_at(1, self.settings.max_draft_len))
        self.metrics.gpu_memory_planned(settings.gpu_memory_planned_fraction)
        # the deployment's rollback, per load range: full draft length, reduced, plain (trtspec.orchestrator.governor)
        self.governor = LoadGovernors(
            settings.default_num_draft_tokens or settings.speculation_num_draft_tokens,
            hold_seconds=settings.governor_hold_seconds,
            on_change=self._governed,
        )
        self._show_governors()
        # an operator's or Alertmanager's force, through `trtspec serve --control-port` (trtspec.control)
        self.control, self._control_lock = Watcher(os.environ.get(CONTROL_ENV)), threading.Lock()
        # KV-cache pressure on the target, from the server's own metrics (trtspec.triton.kv_watch)
        self.kv_watch = None
        if os.environ.get(METRICS_ENV):
            self.kv_watch = KvWatch(
                os.environ[METRICS_ENV],
                self.target.model_name,
                self.governor.kv_cache,
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

    def _run(self, request, sender, arrived: float) -> None:
        key = id(sender)
        with self._active_lock:
            self._peaks[key] = 0
            load = len(self._peaks)
            for k in self._peaks:
                self._peaks[k] = max(self._peaks[k], load)

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
        stats = RequestStats()
        limit = self.settings.max_speculative_concurrency  # 0: no limit
        if spec.num_draft_tokens > 0 and limit and load > limit:
            spec.num_draft_tokens = 0
            stats.fallbacks["load"] = 1
        self._controlled()
        cap, probe, admitted = self.governor.admit(load)
        if cap < self.governor.k_full:  # rolled back: every draft source drafts at most `cap`
            plan.cap = cap
            if spec.num_draft_tokens > cap:
                spec.num_draft_tokens = cap
                stats.fallbacks["governor"] = 1
        times_ns = [int(arrived * 1e9), time.monotonic_ns(), 0, 0]
        try:
            drafter = policy = None
            if spec.num_draft_tokens > 0:
                drafter = self._drafter(plan, watch=sender.is_cancelled)
                # auto: prompt lookup, which costs no draft call, drafts up to max_draft_len (the model up to K)
                bound = (
                    max(spec.num_draft_tokens, self._lookup_k(plan)) if plan.method == "auto" else spec.num_draft_tokens
                )
                policy = (
                    self.costs.policy(bound, model_drafts=plan.model_drafts, load=load)
                    if plan.adaptive
                    else FixedDraftLength(spec.num_draft_tokens)
                )
            detok = IncrementalDetokenizer(self.tokenizer, self.settings.skip_special_tokens)
            # Like TRT-LLM, a streamed response carries new text only; a single response repeats the prompt
            # unless exclude_input_in_output is set.
            prompt_text = "" if plan.exclude_input or spec.stream else fields.text("text_input")
            ids: list[int] = []
            text = []
            run = _Run(stats, Trace(), times_ns, len(spec.prompt))
            target = self.target.for_request(plan.request_id, deadline, watch=stop)
            recover = self._recovery(deadline, stop)
            # past admission a heavier range than its own, that of the most requests it has run beside, caps it
            # where that range rolled back (a burst's first requests are admitted at a lighter load than the one
            # they run at); its own range capped it at admission, and a probe keeps its length
            own = self.governor.at(load)

            def cap() -> int | None:
                heavier = self.governor.at(peak_load())
                return None if probe or heavier is own else heavier.rolled_back_cap()

            for chunk in speculate(
                spec,
                target,
                drafter,
                policy=policy,
                stats=stats,
                cancelled=stop,
                trace=run.trace,
                recover=recover,
                cap=cap,
            ):
                now = time.monotonic_ns()  # one reading: tokens that came in one piece have first == last
                run.times_ns[2] = run.times_ns[2] or now
                run.times_ns[3] = now
                ids += chunk
                piece = detok.push(chunk)
                if spec.stream:
                    if piece or chunk:
                        sender.send(self._response(piece, chunk, plan, run, len(ids)))
                else:
                    text.append(piece)
            rest = detok.flush()
            # what it measured belongs to the most requests it ran beside, not to those at its start or end: its
            # costs are learned there, and that load range's governor judges it
            load = peak_load()
            if isinstance(policy, AdaptiveDraftLength):
                self.costs.learn(policy, model_drafts=plan.model_drafts, load=load)
            self.costs.drafted(
                load=load, lookup_tokens=stats.source_tokens.get(LOOKUP, 0), draft_tokens=stats.num_draft_tokens
            )
            self.metrics.record(stats, run.times_ns)
            flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
            if spec.stream:
                sender.send(self._response(rest, [], plan, run, len(ids), final=True), flags=flags)
            else:
                sender.send(
                    self._response(prompt_text + "".join(text) + rest, ids, plan, run, len(ids), final=True),
                    flags=flags,
                )
        except Exception as exc:
            if error_kind(exc) in ("engine_error", "timeout"):  # the server's failures, not the clients'
                load = peak_load()
                self._govern(Outcome(False, None, failed=True, probe=probe, admitted_at=admitted), load)
            raise
        self._govern(
            Outcome(
                bool(stats.num_drafts),
                seconds_per_output_token(times_ns, stats.generated_tokens),
                num_draft_tokens=stats.num_draft_tokens,
                num_accepted_tokens=stats.num_accepted_tokens,
                probe=probe,
                admitted_at=admitted,
            ),
            load,
        )

    def _drafter(self, plan: _Plan, watch):
        """`watch`: whether the client left (the request's deadline does not bound a draft call: see
        BlsEngineClient)."""
        lookup = make_drafter("prompt_lookup", max_matching_ngram_size=self.settings.max_matching_ngram_size)
        model = None
        if plan.model_drafts:
            s = plan.spec
            client = self.draft.for_request(plan.request_id, watch=watch)
            model = GuardedDrafter(
                make_drafter(
                    "draft_model",
                    client=client,
                    sampling=s.sampling,
                    end_id=s.end_id,
                    pad_id=s.pad_id,
                    use_logits=plan.use_logits,
                ),
                self.draft_breaker,
            )
        if plan.method == "draft_model":
            return model
        # prompt lookup alone is auto without a model: it offers its match at each token of a plain stretch
        lookup_k = self._lookup_k(plan) if plan.method == "auto" else plan.spec.num_draft_tokens
        return make_drafter("auto", model=model, lookup=lookup, model_k=plan.spec.num_draft_tokens, lookup_k=lookup_k)

    def _lookup_k(self, plan: _Plan) -> int:
        """How far prompt lookup drafts under `auto`: max_draft_len, or the governor's cap when it rolled back."""
        return self.settings.max_draft_len if plan.cap is None else plan.cap

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

    def _govern(self, outcome: Outcome, load: int) -> None:
        """A finished request to its load range's governor, with the break-even of that load's costs (also the
        gauge's); `load`: the most requests in flight during its life."""
        loads, even = self.costs.break_even_at(load, self.settings.max_draft_len)
        self.metrics.break_even(loads, even)
        self.governor.observe(outcome, even, load)
        self._show_governors()  # probing starts without a change of level, and a range may be new

    def _show_governors(self) -> None:
        for label, gov in self.governor.ranges():
            self.metrics.governor(label, gov.state, gov.cap())

    def _controlled(self) -> None:
        """Apply a force the control file gained or lost since the last request."""
        with self._control_lock:
            changed, force = self.control.poll()
            if not changed:
                return
            if force is not None:
                pb_utils.Logger.log_warn(
                    f"{self.name}: speculation forced to {force.mode} for {force.remaining():.0f} s "
                    f"by the {force.source}: {force.reason}"
                )
                self.governor.force(force.mode, force.remaining(), reason=force.source)
            else:
                self.governor.force(None, reason="force")

    def _governed(self, load: str, old: str, new: str, reason: str, cap: int) -> None:
        """A change of a load range's speculation level (judged, a floor's, or a force's): logged once, counted by
        reason, in the state gauge."""
        pb_utils.Logger.log_warn(
            f"{self.name}: speculation at load {load} {old} -> {new} ({reason}); draft-length cap now {cap}"
        )
        self.metrics.governor_change(load, new, reason)
        self.metrics.governor(load, new, cap)

    def _draft_down(self, cause: Exception) -> None:
        """The first failure of an outage: say so once (a model whose process died is being reloaded: see
        trtspec.triton.recovery)."""
        pb_utils.Logger.log_warn(
            f"{self.name}: {self.draft.model_name} failed ({cause}); requests decode without it "
            "and it is tried again after a cool-down"
        )
        self.governor.draft_down(True)

    def _draft_up(self) -> None:
        pb_utils.Logger.log_info(f"{self.name}: {self.draft.model_name} answers again; speculation with it resumes")
        self.governor.draft_down(False)

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
        penalties = self._penalties(f)
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
            has_draft_model=self.draft is not None,
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
        """The request's draft source and the most tokens to draft per iteration (K).

        K is the first of: the request's num_draft_tokens; the deployment's speculation_num_draft_tokens when the
        request names a `speculation` method; the deployment's default_num_draft_tokens (0 decodes plainly, as
        NVIDIA's BLS does). The source is the request's `speculation`, else the deployment's default_speculation.
        K lies within the target engine's max_draft_len, the source none drafts nothing, and a K > 0 from the
        draft model needs a deployment that has one. Prompt lookup costs no draft call, so where the request names
        no K it drafts up to max_draft_len, as it does under auto (the deployment's K is the draft model's)."""
        method = f.text("speculation") or None
        if method is not None and method not in SPECULATION_METHODS:
            raise RequestError("speculation", f"must be one of {', '.join(SPECULATION_METHODS)}, got {method!r}")
        k = f.scalar("num_draft_tokens", int, None)
        named = k is not None
        if k is None:
            k = self.settings.speculation_num_draft_tokens if method else self.settings.default_num_draft_tokens
        method = method or self.settings.default_speculation
        if method == "prompt_lookup" and not named and k > 0:
            k = self.settings.max_draft_len
        if k < 0 or k > self.settings.max_draft_len:
            raise RequestError(
                "num_draft_tokens",
                f"must be between 0 and the target engine's max_draft_len {self.settings.max_draft_len}, got {k}",
            )
        if method == "none":
            k = 0
        if k > 0 and method == "draft_model" and self.draft is None:
            raise RequestError(
                "speculation",
                "this deployment has no draft model; use speculation: prompt_lookup, or num_draft_tokens 0",
            )
        return method, k

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

    @staticmethod
    def _penalties(f: _Fields) -> Penalties:
        penalties = Penalties(
            f.scalar("repetition_penalty", float, 1.0),
            f.scalar("presence_penalty", float, 0.0),
            f.scalar("frequency_penalty", float, 0.0),
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

    stats: RequestStats
    trace: Trace  # the target's log probs and logits of the emitted tokens, KV blocks
    times_ns: list[int]  # arrival, first target call, first token, last token (steady clock)
    input_tokens: int
    sent: int = 0  # tokens whose log probs / logits went out in earlier responses


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
    has_draft_model: bool = False  # the deployment has one
    cap: int | None = None  # the governor's draft-length cap, when it rolled speculation back

    @property
    def model_drafts(self) -> bool:
        """Whether the draft model drafts (alone, or in auto beside prompt lookup)."""
        return self.has_draft_model and self.method in ("draft_model", "auto")


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
