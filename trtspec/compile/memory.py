"""The memory plan of a trtllm build: does each GPU hold its engines' weights and KV cache, and can calibration run?

Everything comes from the Hugging Face config.json (no weights are loaded) and the build config:

- parameters: embedding + per layer (q, k, v, o projections with their biases, the gated MLP's three matrices, two
  norms) + final norm + lm_head (once more unless tied); they agree with the published sizes (tests check 70.6B,
  1.24B, 405.9B, 14.8B and 0.49B).
- weights per GPU: ModelOpt FP8 stores the decoder's linear weights in 1 byte (per-tensor scales), and keeps the
  embedding, lm_head and norms in the model dtype (2 bytes for BF16/FP16); without quantization everything is in the
  dtype. Linear weights split over tp x pp; the embedding is replicated on every rank and lm_head splits over tp
  (counted on every rank: conservative for pp > 1).
- KV cache per GPU: 2 (K and V) x layers/pp x ceil(kv_heads/tp) x head_dim x (1 byte FP8, else the dtype) per
  token. The plan must hold the bare need, max_batch_size sequences at the engine's max_seq_len (the target's
  includes max_draft_len) in blocks of 32 tokens: every scheduled sequence at full length at once. It then gives the
  KV cache what the GPU has left (`plan_kv_caches`), because the orchestrator re-sends each sequence every
  iteration and relies on its blocks still being there: a cache of only the bare need evicts the prefixes of the
  requests between their calls, and each verification re-prefills its whole sequence.
- activations: max_num_tokens x (2 x intermediate/tp + 4 x hidden) x 4 bytes (close to TensorRT-LLM's reported
  execution-context memory), generation logits in FP32 when gathered, and RUNTIME_OVERHEAD_GIB per engine and GPU
  (CUDA context, cuBLAS/NCCL workspaces: each engine runs in its own process in orchestrator mode).
- calibration (TensorRT-LLM's workflow doc: "a LLaMA 70B BF16 takes 140G memory, if we make FP8 quantization,
  then, another 70G is needed"): parameters x (dtype bytes + 1) over all GPUs, one model at a time; more than the
  GPUs hold spills to CPU memory (accelerate's device_map="auto"), which is slow but works if the host has room.

A GPU is full at USABLE_FRACTION of its memory (the bare KV need counts there). The numbers are planning estimates,
not measurements.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from trtspec.environment import Gpu

GIB = 2**30
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
TOKENS_PER_BLOCK = 32
RUNTIME_OVERHEAD_GIB = 2.0
USABLE_FRACTION = 0.95
# TensorRT-LLM's default kv_cache_free_gpu_mem_fraction (executor KvCacheConfig::kDefaultGpuMemFraction): the share
# of the memory free after the engines load that the KV caches on a GPU take together
TOTAL_KV_FRACTION = 0.9
CALIBRATION_OVERHEAD_GIB = 2.0  # per GPU: CUDA context and calibration activations


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer, from its Hugging Face config.json."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int | None = None

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelShape:
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
        try:
            hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
            shape = cls(
                hidden_size=hidden,
                num_layers=int(text["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(text.get("num_key_value_heads") or heads),
                head_dim=int(text.get("head_dim") or hidden // heads),
                intermediate_size=int(text["intermediate_size"]),
                vocab_size=int(text["vocab_size"]),
                tied_embeddings=bool(text.get("tie_word_embeddings", False)),
                # Qwen2 has q/k/v biases without saying so in its config; Llama says attention_bias.
                qkv_bias=bool(text.get("attention_bias", text.get("model_type") == "qwen2")),
                max_position_embeddings=text.get("max_position_embeddings"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"the Hugging Face config lacks a size trtspec plans with: {exc}") from exc
        return shape

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def linear_params_per_layer(self) -> int:
        attention = self.hidden_size * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden_size
        return attention + 3 * self.hidden_size * self.intermediate_size

    @property
    def linear_params(self) -> int:
        """The decoder's matrices: what ModelOpt FP8 quantizes."""
        return self.num_layers * self.linear_params_per_layer

    @property
    def small_params(self) -> int:
        """Norms and biases, kept in the model dtype."""
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        return self.num_layers * (2 * self.hidden_size + bias) + self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def param_count(self) -> int:
        """As Hugging Face counts them: a tied lm_head is the embedding."""
        lm_head = 0 if self.tied_embeddings else self.embedding_params
        return self.linear_params + self.small_params + self.embedding_params + lm_head


@dataclass
class EngineMemory:
    """One engine's share of each of its GPUs, in bytes."""

    role: str
    devices: list[int]
    tp_size: int
    pp_size: int
    weights: int
    kv_cache: int
    kv_tokens: int
    kv_bytes_per_token: int
    activations: int
    logits: int
    overhead: int
    kv_cache_dtype: str
    # the KV cache the plan gives it (plan_kv_caches), in tokens; 0: not planned, the bare need
    kv_cap_tokens: int = 0

    @property
    def fixed(self) -> int:
        """Everything but the KV cache: what is in use before TensorRT-LLM sizes the cache from the free memory."""
        return self.weights + self.activations + self.logits + self.overhead

    @property
    def total(self) -> int:
        """With the bare KV need: what must fit."""
        return self.fixed + self.kv_cache

    @property
    def kv_planned(self) -> int:
        return self.kv_bytes_per_token * max(self.kv_cap_tokens, self.kv_tokens)

    @property
    def planned_total(self) -> int:
        """With the planned KV cache: what the GPU holds in steady use."""
        return self.fixed + self.kv_planned


@dataclass
class Calibration:
    role: str
    needed: int  # bytes over all GPUs together
    gpu_total: int
    host: int | None  # CPU memory it may spill to, when known

    @property
    def fits_on_gpus(self) -> bool:
        return self.needed <= self.gpu_total

    @property
    def fits(self) -> bool:
        return self.fits_on_gpus or (self.host is not None and self.needed <= self.gpu_total + self.host)


@dataclass
class MemoryPlan:
    engines: list[EngineMemory]
    gpus: list[Gpu]
    calibrations: list[Calibration] = field(default_factory=list)
    gpu_source: str = ""  # where the GPU list came from

    def __post_init__(self):
        plan_kv_caches(self.engines, self.gpus)

    def used(self, device: int) -> int:
        return sum(e.total for e in self.engines if device in e.devices)

    def planned(self, device: int) -> int:
        return sum(e.planned_total for e in self.engines if device in e.devices)

    def kv_fractions(self) -> dict[str, float]:
        """kv_cache_free_gpu_mem_fraction per role (see kv_fractions)."""
        return kv_fractions(self.engines, self.gpus)

    def devices(self) -> list[int]:
        return sorted({d for e in self.engines for d in e.devices})

    def problems(self) -> list[str]:
        """Every way the plan does not fit, with the numbers."""
        problems = []
        by_index = {g.index: g for g in self.gpus}
        for device in self.devices():
            gpu = by_index.get(device)
            if gpu is None:
                problems.append(
                    f"GPU {device} is needed but only {len(self.gpus)} GPU(s) are available ({self.gpu_source})"
                )
                continue
            budget = gpu.memory_gib * GIB * USABLE_FRACTION
            used = self.used(device)
            if used > budget:
                parts = ", ".join(
                    f"{e.role}: weights {gib(e.weights)} + KV cache {gib(e.kv_cache)} ({e.kv_tokens} tokens) + "
                    f"activations {gib(e.activations + e.logits)} + runtime {gib(e.overhead)}"
                    for e in self.engines
                    if device in e.devices
                )
                problems.append(
                    f"GPU {device} ({gpu.name}, {gpu.memory_gib:.1f} GiB) needs {gib(used)} but holds "
                    f"{gib(budget)} ({USABLE_FRACTION:.0%} of it): {parts}. Raise tp_size, lower "
                    f"engine.max_batch_size or engine.max_seq_len, use FP8, or plan for larger GPUs"
                )
        for c in self.calibrations:
            if not c.fits:
                host = (
                    f" + {gib(c.host)} CPU memory"
                    if c.host is not None
                    else " (CPU memory unknown: set gpu.host_memory_gb)"
                )
                problems.append(
                    f"{c.role} calibration needs {gib(c.needed)} (BF16 weights + the FP8 copy) but the GPUs hold "
                    f"{gib(c.gpu_total)}{host}. Calibrate on more GPUs, or quantize elsewhere and build from there"
                )
        return problems

    def warnings(self) -> list[str]:
        return [
            f"{c.role} calibration needs {gib(c.needed)}, more than the GPUs' {gib(c.gpu_total)}: part of the model is "
            "placed in CPU memory during calibration (slow)"
            for c in self.calibrations
            if c.fits and not c.fits_on_gpus
        ]


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def engine_memory(
    role: str,
    shape: ModelShape,
    *,
    devices: list[int],
    tp_size: int,
    pp_size: int,
    dtype: str,
    quantization: str,
    kv_cache_dtype: str,
    max_batch_size: int,
    max_seq_len: int,
    max_num_tokens: int,
    gather_generation_logits: bool,
    max_draft_len: int,
) -> EngineMemory:
    """One engine's memory on each of its GPUs. `max_seq_len` is the engine's (the target's includes the draft
    allowance)."""
    dtype_bytes = DTYPE_BYTES[dtype]
    linear_bytes = 1 if quantization == "fp8" else dtype_bytes
    ranks = tp_size * pp_size
    weights = (
        math.ceil(shape.linear_params / ranks) * linear_bytes
        + math.ceil(shape.small_params / pp_size) * dtype_bytes
        + shape.embedding_params * dtype_bytes  # replicated on every rank
        + math.ceil(shape.embedding_params / tp_size) * dtype_bytes
    )  # lm_head, split over tp (even when tied)
    kv_bytes = 1 if kv_cache_dtype in ("fp8", "int8") else dtype_bytes
    kv_heads = math.ceil(shape.num_kv_heads / tp_size)
    kv_per_token = 2 * math.ceil(shape.num_layers / pp_size) * kv_heads * shape.head_dim * kv_bytes
    tokens = max_batch_size * math.ceil(max_seq_len / TOKENS_PER_BLOCK) * TOKENS_PER_BLOCK
    activations = max_num_tokens * (2 * math.ceil(shape.intermediate_size / tp_size) + 4 * shape.hidden_size) * 4
    logits = max_batch_size * (max_draft_len + 1 if gather_generation_logits else 1) * shape.vocab_size * 4
    return EngineMemory(
        role,
        list(devices),
        tp_size,
        pp_size,
        weights,
        kv_per_token * tokens,
        tokens,
        kv_per_token,
        activations,
        logits,
        int(RUNTIME_OVERHEAD_GIB * GIB),
        kv_cache_dtype,
    )


def calibration_memory(
    role: str, shape: ModelShape, *, dtype: str, quantization: str, gpus: list[Gpu], host_bytes: int | None
) -> Calibration:
    copy = 1 if quantization == "fp8" else 0
    needed = shape.param_count * (DTYPE_BYTES[dtype] + copy) + int(CALIBRATION_OVERHEAD_GIB * GIB) * max(len(gpus), 1)
    return Calibration(role, needed, int(sum(g.memory_gib for g in gpus) * GIB), host_bytes)


def host_memory_bytes() -> int | None:
    """This machine's physical memory (Linux), for calibration that spills off the GPUs."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


# ---- the KV cache each engine gets ----------------------------------------------------------------------------


def plan_kv_caches(engines: list[EngineMemory], gpus: list[Gpu]) -> None:
    """Set each engine's kv_cap_tokens (max_tokens_in_paged_kv_cache) from the memory its GPUs have left.

    On each GPU, the KV caches together get TOTAL_KV_FRACTION of what the engines' fixed memory leaves, as TensorRT-LLM
    sizes one engine's cache alone (kvCacheManager.cpp calculateFreeMemBytes at b35ac1b6, 1.2.0rc2: the free memory
    after loading x kv_cache_free_gpu_mem_fraction). The engines on a GPU share it in proportion to their bare need,
    i.e. each holds the same multiple of max_batch_size full-length sequences: target and draft see the same
    sequences, so the draft's cache should keep as many of them as the target's. An engine over several GPUs takes
    its smallest multiple (TensorRT-LLM takes the minimum block count over the ranks, calculateMaxNumBlocks), and
    never less than its bare need. Caps are whole 32-token blocks, and the caps on one GPU sum below its free memory,
    so the order in which the engines load does not matter. Without GPUs to plan on, each keeps its bare need."""
    multiple = {}
    by_index = {g.index: g for g in gpus}
    for device in sorted({d for e in engines for d in e.devices}):
        gpu = by_index.get(device)
        on = [e for e in engines if device in e.devices]
        need = sum(e.kv_cache for e in on)
        if gpu is None or need <= 0:
            continue
        free = gpu.memory_gib * GIB - sum(e.fixed for e in on)
        multiple[device] = TOTAL_KV_FRACTION * free / need
    for e in engines:
        known = [multiple[d] for d in e.devices if d in multiple]
        k = max(1.0, min(known)) if known else 1.0
        e.kv_cap_tokens = max(e.kv_tokens, int(k * e.kv_tokens) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK)


def kv_fractions(engines: list[EngineMemory], gpus: list[Gpu]) -> dict[str, float]:
    """kv_cache_free_gpu_mem_fraction per role, set so that the cap (max_tokens_in_paged_kv_cache) is what binds
    whichever engine loads last on a shared GPU. TensorRT-LLM takes the smaller of the two (model_config.md,
    "KV cache allocation is the min of max_tokens_in_paged_kv_cache and value derived from
    kv_cache_free_gpu_mem_fraction"); the engine that loads last sees the free memory less the other caches, so its
    fraction is its cap over that, rounded up. An engine alone on its GPUs keeps TOTAL_KV_FRACTION. At most
    TOTAL_KV_FRACTION: a plan without room left binds on the fraction, not on an out-of-memory error."""
    by_index = {g.index: g for g in gpus}
    fractions = {}
    for e in engines:
        fraction = 0.0
        for device in e.devices:
            others = [o for o in engines if o is not e and device in o.devices]
            gpu = by_index.get(device)
            if not others:
                continue
            if gpu is None:  # nothing to plan on: split by bare need, as the caps are
                share = e.kv_cache / max(e.kv_cache + sum(o.kv_cache for o in others), 1)
                fraction = max(fraction, TOTAL_KV_FRACTION * share)
                continue
            free_last = gpu.memory_gib * GIB - e.fixed - sum(o.fixed + o.kv_planned for o in others)
            fraction = max(fraction, e.kv_planned / free_last if free_last > 0 else TOTAL_KV_FRACTION)
        fractions[e.role] = min(math.ceil(fraction * 100) / 100, TOTAL_KV_FRACTION) if fraction else TOTAL_KV_FRACTION
    return fractions


def built_engine_memory(role: str, info, devices: list[int]) -> EngineMemory:
    """An engine's memory from its built engine dir (trtspec.engine.manifest.EngineInfo of a trtllm engine: the
    pretrained_config and build_config TensorRT-LLM writes), for `trtspec deploy`. Weights are the larger of the
    estimate and the largest rank file."""
    pc = info.raw.get("pretrained_config") or {}
    bc = info.raw.get("build_config") or {}
    mapping = pc.get("mapping") or {}
    heads = int(pc.get("num_attention_heads", 1))
    hidden = int(pc.get("hidden_size", 0))
    shape = ModelShape(
        hidden_size=hidden,
        num_layers=int(pc.get("num_hidden_layers", 0)),
        num_heads=heads,
        num_kv_heads=int(pc.get("num_key_value_heads") or heads),
        head_dim=int(pc.get("head_size") or pc.get("head_dim") or hidden // max(heads, 1)),
        intermediate_size=int(pc.get("intermediate_size", 0)),
        vocab_size=int(pc.get("vocab_size") or info.vocab_size),
        tied_embeddings=False,
        qkv_bias=bool(pc.get("attn_bias") or pc.get("bias")),
    )
    memory = engine_memory(
        role,
        shape,
        devices=devices,
        tp_size=int(mapping.get("tp_size", 1)),
        pp_size=int(mapping.get("pp_size", 1)),
        dtype=info.dtype if info.dtype in DTYPE_BYTES else "bfloat16",
        quantization="fp8" if info.quant_algo == "FP8" else "none",
        kv_cache_dtype=(info.kv_cache_quant_algo or "").lower() or "auto",
        max_batch_size=info.max_batch_size,
        max_seq_len=info.max_seq_len,
        max_num_tokens=int(bc.get("max_num_tokens") or info.max_seq_len),
        gather_generation_logits=info.gather_generation_logits,
        max_draft_len=info.max_draft_len,
    )
    ranks = [f for f in Path(info.path).glob("rank*.engine") if f.is_file()]
    memory.weights = max(memory.weights, max((f.stat().st_size for f in ranks), default=0))
    return memory
