"""The embedded engine: an engine dir served in process with the semantics of TRT-LLM's `tensorrt_llm` model.

- `generate`: up to `request_output_len` tokens after `input_ids` (greedy by default, sampling on request).
- verify: with `draft_input_ids`, the sequence and the draft go through the network in ONE forward pass and
  the draft is accepted inside the engine (see `sampling.accept_draft`), as TRT-LLM's
  `draft_tokens_external` mode does.
- KV-cache prefix reuse, as TRT-LLM's block reuse: the caches of recent sequences are kept within a memory
  budget and a request computes only the suffix it shares with none of them. The orchestrator re-sends the
  whole sequence every iteration, so without this every iteration would re-prefill it.

FP8 weights are dequantized to the compute dtype at load: CPUs have no FP8 matmul, so on CPU FP8 saves
disk and load I/O and reproduces FP8's rounding, not compute.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from trtspec.contract import (
    GenerationRequest, GenerationResult, request_to_tensors, result_to_tensors, tensors_to_request, tensors_to_result,
)
from trtspec.engine import fp8, subset_head
from trtspec.engine.manifest import EngineInfo, read_engine
from trtspec.engine.sampling import accept_draft, select
from trtspec.errors import EngineError, RequestError

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class _Entry:
    tokens: tuple[int, ...]   # the tokens whose keys and values the cache holds
    cache: object
    nbytes: int


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    evictions: int = 0


class PrefixCache:
    """KV caches of recent sequences, most recent first, within a byte budget.

    `take` hands out the cache with the longest common prefix, cropped to that prefix. A cache whose every
    token is a prefix of the request is moved out (the usual next iteration of the same sequence); one that
    only shares part (e.g. a system prompt) is copied, so the sequence it belongs to keeps it.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.entries: list[_Entry] = []
        self.stats = PrefixCacheStats()

    def take(self, ids: list[int], new_cache, max_cached: int):
        """Return (cache, n_cached): the cache holds ids[:n_cached], with n_cached <= max_cached."""
        self.stats.lookups += 1
        best, best_len = None, 0
        for entry in self.entries:
            n = _common_prefix(entry.tokens, ids)
            if n > best_len:
                best, best_len = entry, n
        if best is None:
            return new_cache(), 0
        keep = min(best_len, max_cached)
        if keep == len(best.tokens):
            self.entries.remove(best)
            cache = best.cache
        else:
            cache = copy.deepcopy(best.cache)
            _crop(cache, keep)
        self.stats.hits += 1
        return cache, keep

    def put(self, tokens: list[int], cache) -> None:
        if self.budget_bytes <= 0:
            return
        entry = _Entry(tuple(tokens), cache, _cache_nbytes(cache))
        self.entries.insert(0, entry)
        while self.entries and sum(e.nbytes for e in self.entries) > self.budget_bytes:
            self.entries.pop()
            self.stats.evictions += 1

    def clear(self) -> None:
        self.entries.clear()


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _cache_nbytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _crop(cache, length: int) -> None:
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)  # a negative count removes that many tokens in every transformers release we support


@dataclass
class EngineStats:
    requests: int = 0
    verify_requests: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    prefix: PrefixCacheStats = field(default_factory=PrefixCacheStats)


class Engine:
    """An engine dir loaded for in-process serving; thread-safe (requests run one at a time)."""

    def __init__(self, info: EngineInfo, model, device: torch.device):
        self.info = info
        self.model = model
        self.device = device
        extra = info.raw.get("trtspec", {})
        self.eos_token_id: int | None = extra.get("eos_token_id")
        self.pad_token_id: int | None = extra.get("pad_token_id")
        self.cache = PrefixCache(int(extra.get("kv_cache_reuse_mb", 512)) * 2**20)
        self.stats = EngineStats(prefix=self.cache.stats)
        self._lock = threading.Lock()

    # ---- loading -------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, engine_dir: str | Path, device: str = "cpu", dtype: str | None = None) -> "Engine":
        """Load an embedded-backend engine dir; `dtype` overrides the built compute dtype."""
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        info = read_engine(engine_dir)
        if info.backend != "torch":
            raise EngineError(f"{engine_dir} is a {info.backend} engine; the embedded engine loads only engines built with `backend: torch`")
        extra = info.raw["trtspec"]
        weights = Path(engine_dir) / extra.get("weights", "rank0.safetensors")
        if not weights.is_file():
            raise EngineError(f"{weights} is missing: the engine dir is incomplete; rebuild it with `trtspec build`")
        compute = TORCH_DTYPES[dtype or info.dtype]
        try:
            state = fp8.dequantize_state_dict(load_file(str(weights)), compute)
        except Exception as exc:  # safetensors raises its own error types on a corrupt file
            raise EngineError(f"cannot read {weights}: {exc}") from exc
        hf_config = AutoConfig.for_model(**extra["hf_config"])
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(hf_config, dtype=compute)
        subset_head.install(model)  # a draft whose head covers part of the vocabulary (FR-Spec)
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as exc:  # shapes that disagree with the config raise even with strict=False
            raise EngineError(f"{weights} does not match {info.architecture} as configured in {engine_dir}: {exc}") from exc
        missing = [m for m in missing if not _is_tied(model, m)]
        if missing or unexpected:
            raise EngineError(f"{weights} does not match {info.architecture}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        model.tie_weights()
        model.to(device).eval()
        return cls(info, model, torch.device(device))

    # ---- serving -------------------------------------------------------------------------------------------
    def generate(self, request: GenerationRequest) -> GenerationResult:
        self._check(request)
        with self._lock, torch.inference_mode():
            start = time.perf_counter()
            if request.draft_input_ids:
                result = self._verify(request)
            else:
                result = self._generate(request)
            result.seconds = time.perf_counter() - start
        self.stats.requests += 1
        if request.exclude_input_in_output:
            result.output_ids = list(result.new_tokens)
        return result

    def serve(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request in the tensor contract, as the `tensorrt_llm` model receives and answers it."""
        request = tensors_to_request(tensors)
        return result_to_tensors(self.generate(request), with_logits=request.return_generation_logits, with_perf=True)

    def _check(self, r: GenerationRequest) -> None:
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
                f"max_seq_len {limit}; ask for at most {max(limit - len(r.input_ids), 0)} tokens or rebuild with a larger engine.max_seq_len",
            )
        for name in ("end_id", "pad_id"):
            value = getattr(r, name)
            if value is not None and not -1 <= value < vocab:
                raise RequestError(name, f"{value} is outside the vocabulary [0, {vocab}) (-1 disables it)")
        if r.draft_input_ids:
            k = len(r.draft_input_ids)
            if not info.accepts_draft_tokens:
                raise RequestError(
                    "draft_input_ids", "this engine was built without speculative decoding (max_draft_len 0); "
                    "build the target with speculation.max_draft_len >= the number of draft tokens",
                )
            if k > info.max_draft_len:
                raise RequestError("draft_input_ids", f"{k} draft tokens exceed the engine's max_draft_len {info.max_draft_len}")
            bad = next((t for t in r.draft_input_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError("draft_input_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
            if r.draft_logits is not None:
                shape = tuple(r.draft_logits.shape)
                if len(shape) != 2 or shape[0] != k or shape[1] < vocab:
                    raise RequestError("draft_logits", f"shape {shape} does not match [{k} draft tokens, vocab {vocab}]")
        elif r.draft_logits is not None:
            raise RequestError("draft_logits", "given without draft_input_ids")

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

    def _forward(self, ids: list[int], n_logits: int):
        """Run `ids` through the network on top of the best cached prefix; logits [n_logits, V] of the last
        positions, and the cache, which then holds all of `ids`."""
        from transformers import DynamicCache

        # The positions whose logits are wanted must go through the network, even when their KV is cached.
        cache, cached = self.cache.take(ids, DynamicCache, max_cached=len(ids) - n_logits)
        suffix = torch.tensor([ids[cached:]], dtype=torch.long, device=self.device)
        out = self.model(input_ids=suffix, past_key_values=cache, use_cache=True, logits_to_keep=n_logits)
        self.cache.stats.reused_tokens += cached
        self.cache.stats.computed_tokens += suffix.shape[1]
        return out.logits[0].float(), out.past_key_values, cached, suffix.shape[1]

    def _generate(self, r: GenerationRequest) -> GenerationResult:
        end_id, gen = self._end_id(r), self._generator(r)
        seq = list(r.input_ids)
        logits, cache, reused, computed = self._forward(seq, 1)
        new, kept_logits = [], []
        while True:
            step = logits[-1]
            if end_id is not None and len(new) < r.min_tokens:
                step = step.clone()
                step[end_id] = float("-inf")
            token = select(step, r.sampling, gen)
            new.append(token)
            if r.return_generation_logits:
                kept_logits.append(logits[-1])
            if token == end_id or len(new) >= r.request_output_len:
                break
            out = self.model(input_ids=torch.tensor([[token]], device=self.device), past_key_values=cache, use_cache=True)
            logits, cache = out.logits[0].float(), out.past_key_values
            computed += 1
            self.cache.stats.computed_tokens += 1
        # The cache holds every token but the last emitted one, whose keys are computed next time.
        self.cache.put(seq + new[:-1], cache)
        return GenerationResult(
            output_ids=seq + new, new_tokens=new,
            generation_logits=torch.stack(kept_logits).numpy() if kept_logits else None,
            reused_tokens=reused, computed_tokens=computed,
        )

    def _verify(self, r: GenerationRequest) -> GenerationResult:
        end_id, gen = self._end_id(r), self._generator(r)
        seq = list(r.input_ids)
        # Never emit more than request_output_len tokens: a verify step emits up to len(draft) + 1.
        draft = list(r.draft_input_ids[: r.request_output_len - 1])
        draft_logits = None
        if r.draft_logits is not None and draft:
            draft_logits = torch.as_tensor(np.asarray(r.draft_logits))[: len(draft), : self.info.vocab_size].float()
        logits, cache, reused, computed = self._forward(seq + draft, len(draft) + 1)
        accepted, emitted = accept_draft(logits, draft, params=r.sampling, draft_logits=draft_logits, generator=gen)
        if end_id is not None and end_id in emitted:  # nothing follows an end token, even an accepted one
            emitted = emitted[: emitted.index(end_id) + 1]
            accepted = min(accepted, len(emitted))
        # Keep the KV of the sequence and the accepted draft tokens; rejected positions are cropped.
        kept = seq + emitted[:-1]
        _crop(cache, len(kept))
        self.cache.put(kept, cache)
        self.stats.verify_requests += 1
        self.stats.draft_tokens += len(draft)
        self.stats.accepted_draft_tokens += accepted
        return GenerationResult(
            output_ids=seq + emitted, new_tokens=emitted,
            generation_logits=logits[: len(emitted)].numpy() if r.return_generation_logits else None,
            num_draft_tokens=len(draft), num_accepted_draft_tokens=accepted,
            reused_tokens=reused, computed_tokens=computed,
        )


def _is_tied(model, name: str) -> bool:
    return name == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))


class InProcessClient:
    """An engine client that runs the engine in this process, through the same tensor conversions as Triton."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def generate(self, request: GenerationRequest) -> GenerationResult:
        out = self.engine.serve(request_to_tensors(request))
        return tensors_to_result(out, request.input_ids, request.exclude_input_in_output)
