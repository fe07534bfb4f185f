"""The KV cache each trtllm engine gets: the memory its GPU has left after the engines' fixed memory (not the bare
max_batch_size x max_seq_len), split between engines that share a GPU so that the caps bind whichever loads last, and
the BLS's concurrency that follows from it. TensorRT-LLM allocates the smaller of max_tokens_in_paged_kv_cache and
kv_cache_free_gpu_mem_fraction x the free memory at load (kvCacheManager.cpp calculateFreeMemBytes and
calculateMaxNumBlocks, b35ac1b6; tensorrtllm_backend docs/model_config.md, 4575a5d)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtspec import environment
from trtspec.compile import trtllm
from trtspec.compile.memory import (
    GIB,
    TOKENS_PER_BLOCK,
    TOTAL_KV_FRACTION,
    USABLE_FRACTION,
    MemoryPlan,
    ModelShape,
    engine_memory,
)
from trtspec.config import load_config
from trtspec.environment import Gpu, Package
from trtspec.serving_settings import CONCURRENT_REQUESTS_PER_BATCH_SLOT

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "70b": ROOT / "build_configs" / "llama-3.1-70b_llama-3.2-1b_4xh100.yaml",
    "405b": ROOT / "build_configs" / "llama-3.1-405b_llama-3.1-8b_8xh200.yaml",
    "qwen": ROOT / "build_configs" / "qwen2.5-14b_qwen2.5-0.5b_1xh100.yaml",
}


@pytest.fixture(autouse=True)
def no_gpus_no_trtllm(monkeypatch):
    monkeypatch.setattr(environment, "detect_gpus", lambda: environment.GpuReport([], ["test: none"]))
    monkeypatch.setattr(environment, "installed_trtllm", lambda: Package("tensorrt_llm", None, None))


def check_split(plan: MemoryPlan) -> None:
    """On every GPU two engines share: the caps take TOTAL_KV_FRACTION of the free memory (to a block each), the same
    multiple of each one's bare need, and each engine's fraction lets its cap bind whether it loads first or last."""
    gpus = {g.index: g.memory_gib * GIB for g in plan.gpus}
    fractions = plan.kv_fractions()
    for device in plan.devices():
        on = [e for e in plan.engines if device in e.devices]
        if len(on) < 2:
            continue
        free = gpus[device] - sum(e.fixed for e in on)
        kv = sum(e.kv_planned for e in on)
        assert kv <= TOTAL_KV_FRACTION * free
        # (the shared GPU is the fullest one of each engine here, so its caps use all of it)
        assert kv >= TOTAL_KV_FRACTION * free - sum(TOKENS_PER_BLOCK * e.kv_bytes_per_token for e in on)
        for e in on:
            first = gpus[device] - e.fixed
            last = gpus[device] - sum(o.fixed + o.kv_planned for o in on if o is not e) - e.fixed
            assert 0 < fractions[e.role] < 1
            assert fractions[e.role] * first >= e.kv_planned and fractions[e.role] * last >= e.kv_planned, e.role


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_production_plans_give_the_kv_cache_what_the_gpus_have_left(name, tmp_path):
    plan = trtllm.plan(load_config(EXAMPLES[name], plan_only=True), tmp_path).memory
    assert plan.problems() == []
    check_split(plan)
    target, draft = (next(e for e in plan.engines if e.role == role) for role in ("target", "draft"))
    # the BLS admits CONCURRENT_REQUESTS_PER_BATCH_SLOT x the batch: all of them fit at full length, and more
    for e in (target, draft):
        assert e.kv_cap_tokens % TOKENS_PER_BLOCK == 0
        assert e.kv_cap_tokens >= CONCURRENT_REQUESTS_PER_BATCH_SLOT * e.kv_tokens
        assert e.kv_cap_tokens >= 5 * e.kv_tokens  # 5.5x (405B/8B) to 8.1x (Qwen) in these plans
    # target and draft keep the same number of sequences (to a block)
    assert abs(target.kv_cap_tokens / target.kv_tokens - draft.kv_cap_tokens / draft.kv_tokens) < 0.01
    # the shared GPU is used, within what the plan allows (no ~40 GiB left idle on the 70B/1B's GPU 0)
    shared = sorted(set(target.devices) & set(draft.devices))[0]
    memory = next(g for g in plan.gpus if g.index == shared).memory_gib * GIB
    assert 0.85 * memory < plan.planned(shared) <= USABLE_FRACTION * memory


def test_the_70b_plan_in_numbers(tmp_path):
    plan = trtllm.plan(load_config(EXAMPLES["70b"], plan_only=True), tmp_path).memory
    caps = {e.role: (e.kv_tokens, e.kv_cap_tokens) for e in plan.engines}
    # bare need: 16 sequences x 8224 tokens (8192 + 10 draft tokens, in 32-token blocks); planned: 6.8 times it
    assert caps["target"][0] == caps["draft"][0] == 16 * 8224
    assert caps["target"][1] == caps["draft"][1] == 896064
    assert plan.kv_fractions() == {"target": 0.87, "draft": 0.72}


def _engine(role, devices, *, batch=16, seq=8192, tp=1):
    shape = ModelShape(4096, 32, 32, 8, 128, 14336, 128256, False, False)
    return engine_memory(
        role,
        shape,
        devices=devices,
        tp_size=tp,
        pp_size=1,
        dtype="bfloat16",
        quantization="fp8",
        kv_cache_dtype="fp8",
        max_batch_size=batch,
        max_seq_len=seq,
        max_num_tokens=8192,
        gather_generation_logits=False,
        max_draft_len=0,
    )


def _gpus(n, gib):
    return [Gpu(i, "test", gib, 90, "config") for i in range(n)]


def test_an_engine_over_several_gpus_takes_the_multiple_of_its_fullest():
    # the target over GPUs 0 and 1 and the draft on GPU 0: GPU 1 has more room, but one cap serves every rank
    plan = MemoryPlan([_engine("target", [0, 1], tp=2), _engine("draft", [0])], _gpus(2, 80))
    target, draft = plan.engines
    assert target.kv_cap_tokens / target.kv_tokens == pytest.approx(draft.kv_cap_tokens / draft.kv_tokens, rel=0.01)
    check_split(plan)
    alone = MemoryPlan([_engine("target", [0, 1], tp=2)], _gpus(2, 80))
    assert alone.engines[0].kv_cap_tokens > target.kv_cap_tokens and alone.kv_fractions() == {"target": 0.9}


def test_a_gpu_without_room_to_spare_keeps_the_bare_need():
    tight = MemoryPlan([_engine("target", [0]), _engine("draft", [0])], _gpus(1, 24))
    assert all(e.kv_cap_tokens == e.kv_tokens for e in tight.engines)
    assert all(f <= TOTAL_KV_FRACTION for f in tight.kv_fractions().values())
    # without GPUs to plan on: the bare need, the fraction split by it
    unknown = MemoryPlan([_engine("target", [0]), _engine("draft", [0], batch=8)], [])
    assert all(e.kv_cap_tokens == e.kv_tokens for e in unknown.engines)
    assert unknown.kv_fractions() == pytest.approx({"target": 0.6, "draft": 0.3})
