"""The embedded engine on CUDA: the compact forward against Hugging Face for each supported architecture, the FP8
product (`torch._scaled_mm`) against the dequantized one, greedy speculative decoding against target-only through
the orchestrator loop (with differences classified as near-ties or mismatches), and the KV-cache budget.

These run wherever CUDA is present and skip elsewhere. cuBLAS picks kernels by shape, so on a GPU a position's
logits may differ in the last bits between a decode step and a verify pass: outputs are compared token by token
and every difference is classified with the target's own logits (trtspec.validate.classify), as
`trtspec validate outputs` does on a deployment.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from test_engine_batching import ARCHITECTURES, MAX_DRAFT_LEN, _hf_model, _ids
from test_paged import passes

from trtspec.contract import GenerationRequest, SamplingParams
from trtspec.engine import fp8, kernels
from trtspec.engine.model import CompactModel, Segment
from trtspec.engine.paged import PagedModel
from trtspec.engine.runtime import DEFAULT_KV_CACHE_MB, Engine, InProcessClient
from trtspec.errors import RequestError
from trtspec.orchestrator.drafters.draft_model import DraftModelDrafter
from trtspec.orchestrator.loop import SpecRequest, speculate
from trtspec.validate import MISMATCH, classify

CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]
FP8_PRODUCT = CUDA and torch.cuda.get_device_capability() >= (8, 9)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_compact_forward_equals_hugging_face_on_cuda(kind, dtype, tolerance):
    """Logits of a prefill and of the following one-row steps against the transformers model in float64 on the
    CPU: float32 (TF32 off, torch's default for matmul) within 1e-5 relative, bfloat16 within 3e-2 (8-bit
    mantissas, two layers deep); the argmax agrees wherever the reference's top two are apart by more than the
    tolerance."""
    hf = _hf_model(kind)
    reference_model = hf.double()
    ids = _ids(100, 1)  # crosses a key block (64) and, for mistral, the 40-token window
    with torch.inference_mode():
        reference = reference_model(torch.tensor([ids])).logits[0]
    model = CompactModel(
        hf.config, {k: v.float() for k, v in hf.state_dict().items()}, dtype=dtype, device=torch.device("cuda")
    )
    with torch.inference_mode():
        kv = model.new_kv(100)
        first = model.forward([Segment(ids[:70], 0, kv, 70)])[0]
        steps = [model.forward([Segment([ids[p]], p, kv, 1)])[0] for p in range(70, 100)]
    got = torch.cat([first, *steps])
    assert _relative(got, reference) < tolerance
    top2 = reference.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > tolerance * reference.abs().amax(dim=-1).clamp(min=1)
    assert torch.equal(got.argmax(-1)[clear], reference.argmax(-1)[clear])


@pytest.mark.skipif(not FP8_PRODUCT, reason="needs a CUDA GPU of compute capability 8.9 or newer (torch._scaled_mm)")
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_fp8_product_equals_the_dequantized_product(rows, per_channel):
    """Fp8Linear against its definition computed in float64: the E4M3 weight times its scale, times the activations
    rounded to E4M3 per token. What remains is the bfloat16 output's rounding (2^-9 relative per element)."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    w = torch.randn(256, 512, device="cuda", generator=g) * torch.linspace(0.1, 2.0, 256, device="cuda")[:, None]
    x = torch.randn(rows, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    q, scale = fp8.quantize(w, per_channel=per_channel)
    linear = kernels.Fp8Linear(q, scale, None, torch.bfloat16)
    got = linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 256)
    x_scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / fp8.E4M3_MAX
    xq = (x.float() / x_scale).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(fp8.FP8_DTYPE)
    exact = (xq.double() * x_scale.double()) @ fp8.dequantize(q, scale, torch.float64).T
    assert _relative(got, exact) < 4e-3
    # and the whole FP8 path against the product in the compute dtype: the activations' E4M3 rounding
    dense = x.double() @ fp8.dequantize(q, scale, torch.float64).T
    assert _relative(got, dense) < 5e-2


@pytest.mark.skipif(not FP8_PRODUCT, reason="needs a CUDA GPU of compute capability 8.9 or newer (torch._scaled_mm)")
def test_fp8_products_on_request_agree_with_the_dequantized_default(built_fp8):
    fast = Engine.load(built_fp8.target, device="cuda", dtype="bfloat16", fp8_matmul=True, check_invariance=False)
    slow = Engine.load(built_fp8.target, device="cuda", dtype="bfloat16", check_invariance=False)  # the default
    assert isinstance(fast.model.layers[0]["gate_up"], kernels.Fp8Linear)
    assert not isinstance(slow.model.layers[0]["gate_up"], kernels.Fp8Linear)
    ids = _ids(40, 3)
    with torch.inference_mode():
        a = fast.model.forward([Segment(ids, 0, fast.model.new_kv(40), 40)])[0]
        b = slow.model.forward([Segment(ids, 0, slow.model.new_kv(40), 40)])[0]
    # the FP8 path rounds every product's activations to E4M3 (relative error up to 2^-4, about 3.6% RMS); over
    # two layers' eight products that compounds to about 10% of the logits' norm (0.135 measured on an H100)
    assert _relative(a, b) < 0.25


def _greedy(target: Engine, draft: Engine | None, prompt: list[int], max_tokens: int, k: int) -> list[int]:
    target.cache.clear()
    drafter = None
    if draft is not None:
        draft.cache.clear()
        drafter = DraftModelDrafter(InProcessClient(draft), sampling=SamplingParams(), end_id=None, pad_id=None)
    request = SpecRequest(prompt=prompt, max_tokens=max_tokens, num_draft_tokens=k if draft else 0)
    return [t for chunk in speculate(request, InProcessClient(target), drafter) for t in chunk]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_speculative_equals_target_only_on_cuda(built_fp8, dtype):
    """Through the orchestrator loop with two drafters: the tiny draft model (random weights: its tokens are
    rejected, the target's own token comes from the verify pass) and a second copy of the target (its tokens are
    accepted: K+1 positions verified in one pass). Each K's output against target-only, token by token: a
    difference must be a near-tie in the target's own logits at the first differing position; in float32 there
    may be at most one."""
    target = Engine.load(built_fp8.target, device="cuda", dtype=dtype)
    drafts = [
        Engine.load(built_fp8.draft, device="cuda", dtype=dtype),
        Engine.load(built_fp8.target, device="cuda", dtype=dtype),
    ]
    verdicts = []
    for seed in range(6):
        prompt = _ids(8 + 3 * seed, 100 + seed)
        base = _greedy(target, None, prompt, 48, 0)
        assert len(base) == 48
        for draft, k in ((d, k) for d in drafts for k in (1, 2, 4)):
            spec = _greedy(target, draft, prompt, 48, k)
            at = next((i for i, (a, b) in enumerate(zip(base, spec)) if a != b), None)
            if at is None:
                assert len(spec) == len(base)
                continue
            logits = target.generate(
                GenerationRequest(
                    input_ids=prompt + base[:at], request_output_len=1, end_id=-1, return_generation_logits=True
                )
            ).generation_logits
            verdicts.append(classify(np.asarray(logits)[0], base[at], spec[at]))
    assert target.stats.num_accepted_tokens > target.stats.num_draft_tokens / 8  # the copy of the target was accepted
    mismatches = [v for v in verdicts if v.kind == MISMATCH]
    assert not mismatches, mismatches
    if dtype == "float32":
        assert len(verdicts) <= 1, verdicts


@pytest.mark.parametrize("static", [False, True], ids=["compact", "static"])
def test_kv_budget_holds_on_cuda(built_fp8, static):
    """The pool's byte accounting is what the device holds: running and kept caches stay within the budget, a
    call that cannot fit alone is refused naming engine.kv_cache_mb, and calls that fit only one after another
    still all finish. On static shapes the arena is allocated at load: what the kept caches hold is its blocks."""
    engine = Engine.load(built_fp8.target, device="cuda", static=static, check_invariance=False)
    pool = engine.cache
    pool.budget_bytes = pool.bytes_for(100)  # room for one 96-token call at a time
    pool.reuse_bytes = pool.bytes_for(64)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    requests = [GenerationRequest(input_ids=_ids(30, 200 + i), request_output_len=60, end_id=-1) for i in range(4)]
    results = engine.generate_many(requests)
    assert all(len(r.new_tokens) == 60 for r in results)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    assert pool.running_bytes == 0 and pool.kept_bytes <= pool.reuse_bytes
    assert held <= pool.kept_bytes + 2**20, (held, pool.kept_bytes)  # what stays is the kept caches (+ allocator slack)
    if static:
        gc.collect()  # a finished call's lease goes with its job
        arena, per_block = engine.model.arena, pool.bytes_for(1)
        assert arena.blocks - arena.free_blocks == pool.kept_bytes // per_block
    pool.budget_bytes = pool.bytes_for(64)
    with pytest.raises(RequestError, match="kv_cache_mb"):
        engine.generate(GenerationRequest(input_ids=_ids(30, 9), request_output_len=60, end_id=-1))


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_static_shapes_replayed_as_graphs_give_the_passes_run_eagerly(kind, dtype, tolerance):
    """The static-shape path with its passes replayed from CUDA graphs: the same logits as the same path run eagerly
    (the same kernels: within float rounding of nothing), and as the compact forward within the dtype's tolerance;
    the argmax agrees wherever the compact forward's top two are apart by more than the tolerance."""
    hf = _hf_model(kind)
    state = {k: v.float() for k, v in hf.state_dict().items()}
    cuda = torch.device("cuda")
    compact = CompactModel(hf.config, state, dtype=dtype, device=cuda)
    static = {}
    for graphs in (False, True):
        static[graphs] = PagedModel(hf.config, state, dtype=dtype, device=cuda, max_positions=512, graphs=graphs)
        static[graphs].reserve(64 * 2**20, max_batch=4, max_rows=MAX_DRAFT_LEN + 1)
    assert len(static[True]._graphs) == len(static[True].buckets.all())
    want, eager, replayed = (passes(m) for m in (compact, static[False], static[True]))
    for w, e, r in zip(want, eager, replayed, strict=True):
        assert _relative(r, e) < tolerance / 10  # the same kernels; a replay that read stale inputs is off by ~1
        assert _relative(r, w) < tolerance
        top2 = w.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > tolerance * w.abs().max()
        assert torch.equal(r.argmax(-1)[clear], w.argmax(-1)[clear])


def test_the_engine_on_cuda_runs_static_shapes_from_graphs_and_gives_its_blocks_back(built_fp8):
    engine = Engine.load(built_fp8.target, device="cuda", dtype="bfloat16")
    model = engine.model
    assert isinstance(model, PagedModel) and model.graphs
    assert len(model._graphs) == len(model.buckets.all()) and "CUDA graphs" in model.kernel_summary
    budget = int(engine.info.raw["trtspec"].get("kv_cache_mb", DEFAULT_KV_CACHE_MB)) * 2**20
    assert 0 < model.graph_bytes < budget and engine.cache.budget_bytes == budget - model.graph_bytes
    free = model.arena.free_blocks
    requests = [GenerationRequest(input_ids=_ids(20 + i, 300 + i), request_output_len=24, end_id=-1) for i in range(6)]
    results = engine.generate_many(requests)
    assert all(len(r.new_tokens) == 24 for r in results)
    engine.cache.clear()
    gc.collect()
    assert model.arena.free_blocks == free
