"""The embedded engine: an engine dir served in process with the semantics of TRT-LLM's `tensorrt_llm` model.

- generation: up to `request_output_len` tokens after `input_ids` (greedy by default, sampling on request);
- verification: with `draft_input_ids`, the sequence and the draft go through the network in ONE forward
  pass and the draft is accepted inside the engine (see `sampling.accept_draft`), as TRT-LLM's
  `draft_tokens_external` mode does;
- in-flight batching (scheduler.py): calls of different requests that wait at the same time share each
  forward pass, whatever their lengths, drafts and sampling settings;
- KV caches within a byte budget, with prefix reuse (kv.py), as TRT-LLM's block reuse: the orchestrator
  re-sends the whole sequence every iteration, and a call computes only what no kept cache holds.

The network is `model.CompactModel` for the architectures trtspec builds (batch-invariant on CPU: see
kernels.py), or the transformers model itself (`forward="hf"`, the reference and a benchmark variant).
FP8 weights are dequantized to the compute dtype at load: CPUs have no fast FP8 product, and on an H100 the FP8 product
`torch._scaled_mm` at the 1-9 rows of a decode or verify pass, with the per-token quantization of its activations,
was slower than the bfloat16 product on twice the bytes (docs/notes/2026-11-24-h100.md). So FP8 saves disk and
load I/O and reproduces FP8's rounding; `fp8_matmul=True` runs the FP8 products instead.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from trtspec.contract import (
    GenerationRequest,
    GenerationResult,
    request_to_tensors,
    result_to_tensors,
    tensors_to_request,
    tensors_to_result,
)
from trtspec.engine import fp8, subset_head
from trtspec.engine.kv import KVPool, KVStats
from trtspec.engine.manifest import EngineInfo, read_engine
from trtspec.engine.model import COMPACT_ARCHITECTURES, CompactModel, HFModel, Segment
from trtspec.engine.paged import PagedModel
from trtspec.engine.scheduler import BatchStats, Job, Scheduler
from trtspec.errors import EngineError, RequestError

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FORWARDS = ("auto", "compact", "hf")
DEFAULT_KV_CACHE_MB = 1024
DEFAULT_KV_REUSE_MB = 512


@dataclass(kw_only=True)
class EngineStats:
    requests: int = 0
    verify_requests: int = 0
    num_draft_tokens: int = 0  # over the verifications
    num_accepted_tokens: int = 0
    prefix: KVStats = field(default_factory=KVStats)
    batching: BatchStats = field(default_factory=BatchStats)


class Engine:
    """An engine dir loaded for in-process serving; thread-safe. `generate` / `generate_many` run calls in the
    caller's thread; `start` runs them on a background thread instead (the Triton engine model)."""

    def __init__(self, info: EngineInfo, model, device: torch.device):
        self.info = info
        self.model = model
        self.device = device
        extra = info.raw.get("trtspec", {})
        self.eos_token_id: int | None = extra.get("eos_token_id")
        self.pad_token_id: int | None = extra.get("pad_token_id")
        budget = int(extra.get("kv_cache_mb", DEFAULT_KV_CACHE_MB)) * 2**20
        if isinstance(model, PagedModel):  # its caches are blocks of an arena allocated once, graphs captured then
            model.reserve(budget, max(1, info.max_batch_size), info.max_draft_len + 1)
            budget = max(0, budget - model.graph_bytes)  # the graphs' memory is counted in the KV budget
        self.cache = KVPool(
            model,
            budget,
            int(extra.get("kv_cache_reuse_mb", DEFAULT_KV_REUSE_MB)) * 2**20,
        )
        self.scheduler = Scheduler(model, self.cache, max(1, info.max_batch_size))
        self.stats = EngineStats(prefix=self.cache.stats, batching=self.scheduler.stats)
        self._stats_lock = threading.Lock()
        self.batch_invariant = False  # set by check_batch_invariance

    # ---- loading -------------------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        engine_dir: str | Path,
        device: str = "cpu",
        dtype: str | None = None,
        *,
        forward: str = "auto",
        fp8_matmul: bool = False,
        static: bool | None = None,
        graphs: bool | None = None,
        check_invariance: bool = True,
    ) -> Engine:
        """Load an embedded-backend engine dir. `dtype` overrides the built compute dtype; `forward` picks the
        network (auto: compact where supported); `fp8_matmul` (off by default, see the module docstring; CUDA
        SM89+, or torch's CPU `_scaled_mm`) multiplies FP8 weights in FP8 instead of dequantizing them. `static`
        (default: on CUDA) runs the compact forward with static shapes (trtspec.engine.paged), its decode and verify
        passes replayed as CUDA graphs where `graphs` (default: on CUDA)."""
        from transformers import AutoConfig

        if forward not in FORWARDS:
            raise EngineError(f"forward {forward!r} is not one of {', '.join(FORWARDS)}")
        info = read_engine(engine_dir)
        if info.backend != "torch":
            raise EngineError(
                f"{engine_dir} is a {info.backend} engine; the embedded engine loads only engines built with "
                "`backend: torch`"
            )
        extra = info.raw["trtspec"]
        weights = Path(engine_dir) / extra.get("weights", "rank0.safetensors")
        if not weights.is_file():
            raise EngineError(f"{weights} is missing: the engine dir is incomplete; rebuild it with `trtspec build`")
        compute = TORCH_DTYPES[dtype or info.dtype]
        dev = torch.device(device)
        try:
            state = load_file(str(weights))
        except Exception as exc:  # safetensors raises its own error types on a corrupt file
            raise EngineError(f"cannot read {weights}: {exc}") from exc
        hf_config = AutoConfig.for_model(**extra["hf_config"])
        if not getattr(hf_config, "architectures", None):
            hf_config.architectures = [info.architecture]
        compact = forward == "compact" or (forward == "auto" and hf_config.architectures[0] in COMPACT_ARCHITECTURES)
        if compact:
            _check_state(hf_config, state, weights, info)
            try:
                if static is None:  # on CUDA where the configuration allows it; on request elsewhere
                    static = dev.type == "cuda" and PagedModel.unsupported(hf_config) is None
                if static:
                    model = PagedModel(
                        hf_config,
                        state,
                        dtype=compute,
                        device=dev,
                        fp8_matmul=fp8_matmul,
                        max_positions=info.max_seq_len + info.max_draft_len + 1,
                        graphs=graphs if graphs is not None else dev.type == "cuda",
                    )
                else:
                    model = CompactModel(hf_config, state, dtype=compute, device=dev, fp8_matmul=fp8_matmul)
            except (KeyError, RuntimeError) as exc:
                raise EngineError(
                    f"{weights} does not match {info.architecture} as configured in {engine_dir}: {exc}"
                ) from exc
        else:
            model = HFModel(_hf_model(hf_config, state, compute, weights, info, engine_dir).to(dev).eval(), dev)
        engine = cls(info, model, dev)
        if check_invariance and compact:
            engine.batch_invariant = engine.check_batch_invariance()
        return engine

    def check_batch_invariance(self) -> bool:
        """Whether this model, on this machine, gives a sequence's logits bitwise the same computed in one pass,
        one position at a time, and batched behind another sequence (a 70-token probe crossing a key block)."""
        vocab = self.info.vocab_size
        ids = [(i * 7919 + 13) % vocab for i in range(70)]
        other = [(i * 104729 + 5) % vocab for i in range(13)]
        m = self.model
        with torch.inference_mode():
            whole = m.forward([Segment(ids, 0, m.new_kv(70), 6)])[0]
            kv = m.new_kv(70)
            m.forward([Segment(ids[:64], 0, kv, 1)])
            # cloned: the static-shape path's logits are a buffer the next pass reuses
            single = torch.cat([m.forward([Segment([ids[p]], p, kv, 1)])[0].clone() for p in range(64, 70)])
            batched = m.forward([Segment(other, 0, m.new_kv(13), 2), Segment(ids, 0, m.new_kv(70), 6)])[1]
        return torch.equal(whole, single) and torch.equal(whole, batched)

    # ---- serving -------------------------------------------------------------------------------------------
    def generate(self, request: GenerationRequest) -> GenerationResult:
        return self._outcome(self.generate_many([request])[0])

    def generate_many(self, requests: list[GenerationRequest]) -> list[GenerationResult | BaseException]:
        """Run calls together, batched step by step; each outcome is a result or the error it ended with.
        A request that fails its checks raises at once and nothing runs."""
        outcomes: list = [None] * len(requests)
        jobs = []
        for i, request in enumerate(requests):
            jobs.append(self._job(request, lambda out, i=i: outcomes.__setitem__(i, out)))
        with torch.inference_mode():
            self.scheduler.run(jobs)
        return [self._finished(r, out) for r, out in zip(requests, outcomes)]

    def submit(self, request: GenerationRequest, done, on_token=None, request_id: str = "") -> None:
        """Queue a call for the background worker; `done(result or exception)` is called from the worker, and
        `on_token(result so far)` (streaming) at each token of a plain generation as it is chosen, but the last.
        `request_id`: what `cancel` stops it by."""
        self.submit_all([(request, done, on_token)], request_id)

    def submit_all(self, calls: list[tuple], request_id: str = "") -> None:
        """Queue the calls (request, done, on_token) of one Triton request together, under `request_id`; refused
        together (EngineBusy) when the scheduler's queue cannot take them all."""
        jobs = []
        for request, done, on_token in calls:
            job = self._job(request, lambda out, r=request, d=done: d(self._finished(r, out)), request_id)
            job.on_token = on_token
            jobs.append(job)
        self.scheduler.submit_all(jobs, request_id)

    def cancel(self, request_id: str) -> int:
        """Stop the calls of the latest request submitted with `request_id` within one step; each ends with the
        tokens it has so far."""
        return self.scheduler.cancel(request_id)

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    def serve(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request in the tensor contract, as the `tensorrt_llm` model receives and answers it."""
        request = tensors_to_request(tensors)
        return self.result_tensors(request, self.generate(request))

    @staticmethod
    def result_tensors(request: GenerationRequest, result: GenerationResult) -> dict[str, np.ndarray]:
        return result_to_tensors(
            result,
            with_logits=request.return_generation_logits,
            with_perf=request.return_perf_metrics,
            input_tokens=len(request.input_ids) if request.return_num_input_tokens else None,
            output_tokens=request.return_num_output_tokens,
        )

    def _job(self, request: GenerationRequest, done, request_id: str = "") -> Job:
        self.check(request)
        return Job(
            request,
            done,
            end_id=self._end_id(request),
            generator=self._generator(request),
            vocab_size=self.info.vocab_size,
            request_id=request_id,
        )

    def _finished(self, request: GenerationRequest, outcome):
        if isinstance(outcome, BaseException):
            return outcome
        with self._stats_lock:
            self.stats.requests += 1
            if request.draft_input_ids:
                self.stats.verify_requests += 1
                self.stats.num_draft_tokens += outcome.num_draft_tokens
                self.stats.num_accepted_tokens += outcome.num_accepted_tokens
        if request.exclude_input_in_output:
            outcome.output_ids = list(outcome.new_tokens)
        return outcome

    @staticmethod
    def _outcome(outcome):
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def check(self, r: GenerationRequest) -> None:
        info, vocab = self.info, self.info.vocab_size
        if not r.input_ids:
            raise RequestError("input_ids", "is empty; give at least one token")
        bad = next((t for t in r.input_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError("input_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
        if r.request_output_len < 1:
            raise RequestError("request_output_len", f"must be >= 1, got {r.request_output_len}")
        limit = info.max_output_seq_len
        if len(r.input_ids) + r.request_output_len > limit:
            raise RequestError(
                "request_output_len",
                f"input of {len(r.input_ids)} tokens + {r.request_output_len} new tokens exceeds the engine's "
                f"max_seq_len {limit}; ask for at most {max(limit - len(r.input_ids), 0)} tokens or rebuild with a "
                "larger engine.max_seq_len",
            )
        for name in ("end_id", "pad_id"):
            value = getattr(r, name)
            if value is not None and not -1 <= value < vocab:
                raise RequestError(name, f"{value} is outside the vocabulary [0, {vocab}) (-1 disables it)")
        if r.draft_input_ids:
            k = len(r.draft_input_ids)
            if not info.accepts_draft_tokens:
                raise RequestError(
                    "draft_input_ids",
                    "this engine was built without speculative decoding (max_draft_len 0); "
                    "build the target with speculation.max_draft_len >= the number of draft tokens",
                )
            if k > info.max_draft_len:
                raise RequestError(
                    "draft_input_ids", f"{k} draft tokens exceed the engine's max_draft_len {info.max_draft_len}"
                )
            bad = next((t for t in r.draft_input_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError("draft_input_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
            if r.draft_logits is not None:
                shape = tuple(r.draft_logits.shape)
                if len(shape) != 2 or shape[0] != k or shape[1] < vocab:
                    raise RequestError(
                        "draft_logits", f"shape {shape} does not match [{k} draft tokens, vocab {vocab}]"
                    )
        elif r.draft_logits is not None:
            raise RequestError("draft_logits", "given without draft_input_ids")
        if r.min_tokens < 0:
            raise RequestError("min_tokens", f"must be >= 0, got {r.min_tokens}")
        if r.min_tokens > 0 and (r.end_id is None or r.end_id < 0):
            # TensorRT-LLM's min-length rule masks the logit of the request's end id (penaltyKernels.cu
            # batchApplyPenalty), whose absence is -1 at its decoder (createNewDecoderRequests.cpp, 1.2.0rc2 b35ac1b6:
            # mEndId.value_or(-1)); kernels without the `endIds[batchSlot] > -1` guard (3c44cb97) then write logits[-1],
            # and whether 1.2.1 has that guard is not known here. Refused, so nothing that passes here sends it.
            raise RequestError(
                "min_tokens",
                f"{r.min_tokens} with no end_id ({'none given' if r.end_id is None else r.end_id}): min_tokens holds "
                "back the end token, and there is none; send min_tokens 0 when end_id is -1 (ignore_eos)",
            )
        # As TensorRT-LLM's executor refuses them when it fetches the request (executorImpl.cpp: "Return context
        # logit need to build engine with gather_context_logits"; "To return generation logits,
        # gather_generation_logits must be enabled", which TrtGptModelInflightBatching::getGatherGenerationLogits
        # reads off the engine, the tensorrtllm backend never setting the ExecutorConfig's own flag)
        if r.return_context_logits and not info.gather_context_logits:
            raise RequestError(
                "return_context_logits",
                "this engine was built without gather_context_logits; set "
                "engine.gather_context_logits: true in the build config (torch backend) and rebuild",
            )
        if r.return_generation_logits and not info.gather_generation_logits:
            raise RequestError(
                "return_generation_logits",
                "this engine was built without gather_generation_logits; set "
                "engine.gather_generation_logits: true in the build config and rebuild",
            )
        if not r.penalties.repetition > 0:  # SamplingConfig::validate: repetitionPenalty > 0
            raise RequestError("repetition_penalty", f"must be > 0 (1: no penalty), got {r.penalties.repetition}")
        if not r.sampling.temperature >= 0:  # SamplingConfig::checkTemperature: temperature >= 0, which NaN fails
            raise RequestError("temperature", f"must be >= 0 (0: greedy), got {r.sampling.temperature}")
        for name, words in (("stop_words_list", r.stop_words), ("bad_words_list", r.bad_words)):
            bad = next((t for w in words for t in w if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(name, f"token id {bad} is outside the vocabulary [0, {vocab})")
        self.cache.check(
            len(r.input_ids) + max(r.request_output_len, len(r.draft_input_ids or ()) + 1), "request_output_len"
        )

    def _end_id(self, r: GenerationRequest) -> int | None:
        end = r.end_id if r.end_id is not None else self.eos_token_id
        return None if end is None or end < 0 else end

    def _generator(self, r: GenerationRequest) -> torch.Generator | None:
        if r.sampling.greedy:
            return None
        gen = torch.Generator()
        # The orchestrator re-sends a request at every iteration: mixing in the position keeps draws at
        # different positions independent while a seeded request stays reproducible.
        seed = r.sampling.seed if r.sampling.seed is not None else int(torch.randint(0, 2**62, ()))
        gen.manual_seed((seed * 1_000_003 + len(r.input_ids)) % 2**63)
        return gen


def _check_state(hf_config, state: dict, weights: Path, info: EngineInfo) -> None:
    """Every tensor the architecture needs is there, and nothing else: the same rule as loading the
    transformers model strictly (a tied output head may be absent)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    subset_head.install(skeleton)
    expected = {n: tuple(t.shape) for n, t in skeleton.state_dict().items()}
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    have = {n for n in state if not n.endswith(fp8.SCALE_SUFFIX)}
    missing = [n for n in expected if n not in have and not (tied and n == "lm_head.weight")]
    unexpected = [n for n in have if n not in expected]
    if missing or unexpected:
        raise EngineError(
            f"{weights} does not match {info.architecture}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    wrong = [
        f"{n} {tuple(state[n].shape)} (expected {expected[n]})" for n in have if tuple(state[n].shape) != expected[n]
    ]
    if wrong:
        raise EngineError(f"{weights} does not match {info.architecture} as configured: {', '.join(wrong[:3])}")


def _hf_model(hf_config, state: dict, compute: torch.dtype, weights: Path, info: EngineInfo, engine_dir):
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    head = state.get(fp8.HEAD)
    if head is not None and head.dtype == fp8.FP8_DTYPE and getattr(hf_config, "tie_word_embeddings", False):
        # quantize_lm_head: the head's FP8 values differ from the embedding it was tied to, so it is a tensor apart
        hf_config = copy.deepcopy(hf_config)
        hf_config.tie_word_embeddings = False
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(hf_config, dtype=compute)
    subset_head.install(model)  # a draft whose head covers part of the vocabulary (FR-Spec)
    try:
        missing, unexpected = model.load_state_dict(fp8.dequantize_state_dict(state, compute), strict=False)
    except RuntimeError as exc:  # shapes that disagree with the config raise even with strict=False
        raise EngineError(f"{weights} does not match {info.architecture} as configured in {engine_dir}: {exc}") from exc
    missing = [
        m for m in missing if not (m == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False))
    ]
    if missing or unexpected:
        raise EngineError(
            f"{weights} does not match {info.architecture}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    model.tie_weights()
    return model


class InProcessClient:
    """An engine client that runs the engine in this process, through the same tensor conversions as Triton."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def generate(self, request: GenerationRequest) -> GenerationResult:
        out = self.engine.serve(request_to_tensors(request))
        return tensors_to_result(out, request.input_ids, request.exclude_input_in_output)
