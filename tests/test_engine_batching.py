"""The compact forward and in-flight batching: logits equal to Hugging Face for each supported architecture,
bitwise batch invariance (alone, with drafts, batched with other lengths), the kernel facts it rests on,
the KV-cache budget, FP8 products, and batched calls through the real Triton server."""

from __future__ import annotations

import concurrent.futures as cf
import shutil

import numpy as np
import pytest
import torch
from conftest import MAX_DRAFT_LEN
from support.tiny import write_config

from trtspec.contract import GenerationRequest, SamplingParams, request_to_tensors
from trtspec.engine import kernels
from trtspec.engine.kv import GROWTH_TOKENS, _common_prefix
from trtspec.engine.model import CompactModel, HFModel, Segment
from trtspec.engine.runtime import Engine
from trtspec.errors import EngineBusy, EngineError, RequestError

ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": 40}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
}


def _hf_model(kind: str, seed: int = 0):
    import transformers

    cfg_name, extra = ARCHITECTURES[kind]
    config = getattr(transformers, cfg_name)(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=(kind != "qwen3"),
        **extra,
    )
    config.architectures = [cfg_name.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # non-trivial biases (qwen2) and norm weights
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model


def _ids(n: int, seed: int, vocab: int = 320) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_compact_forward_equals_hugging_face(kind):
    hf = _hf_model(kind)
    model = CompactModel(hf.config, hf.state_dict(), dtype=torch.float32, device=torch.device("cpu"))
    ids = _ids(100, 1)  # crosses a key block (64) and, for mistral, the 40-token window
    with torch.inference_mode():
        reference = hf(torch.tensor([ids])).logits[0]
        kv = model.new_kv(100)
        first = model.forward([Segment(ids[:70], 0, kv, 70)])[0]
        rest = model.forward([Segment(ids[70:], 70, kv, 30)])[0]
    got = torch.cat([first, rest])
    # float32 sums in another order: a few ulps of logits of magnitude ~1
    torch.testing.assert_close(got, reference, atol=2e-5, rtol=1e-5)
    assert torch.equal(got.argmax(-1), reference.argmax(-1))


@pytest.fixture(params=["packed", "prepacked"])
def cpu_linears(request, monkeypatch):
    """The CPU's two batch-invariant products: trtspec's kernel, and oneDNN's where the kernel is missing."""
    if request.param == "packed" and not kernels.packed_available(torch.device("cpu")):
        pytest.skip("trtspec's CPU kernel is not built here (no C compiler at install, or no AVX2)")
    if request.param == "prepacked":
        if not kernels.prepack_available(torch.float32, torch.device("cpu")):
            pytest.skip("no oneDNN on this build of torch")
        monkeypatch.setattr(kernels, "packed_available", lambda device: False)
    return request.param


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_logits_are_bitwise_batch_invariant(kind, cpu_linears):
    hf = _hf_model(kind, seed=3)
    model = CompactModel(hf.config, hf.state_dict(), dtype=torch.float32, device=torch.device("cpu"))
    assert model.linear_kind == cpu_linears
    ids = _ids(75, 2)
    with torch.inference_mode():
        whole = model.forward([Segment(ids, 0, model.new_kv(75), 12)])[0]  # one pass: positions 63..74
        # one position at a time, as plain decoding computes them
        kv = model.new_kv(75)
        model.forward([Segment(ids[:63], 0, kv, 1)])
        single = torch.cat([model.forward([Segment([ids[p]], p, kv, 1)])[0] for p in range(63, 75)])
        # as a verification: the cached prefix, then the rest as "draft" tokens in one pass
        kv = model.new_kv(75)
        model.forward([Segment(ids[:63], 0, kv, 1)])
        verified = model.forward([Segment(ids[63:], 63, kv, 12)])[0]
        # batched behind and before sequences of other lengths, including a decode step of another sequence
        other_kv = model.new_kv(31)
        model.forward([Segment(_ids(30, 5), 0, other_kv, 1)])
        batched = model.forward(
            [
                Segment(_ids(7, 6), 0, model.new_kv(7), 3),
                Segment(ids, 0, model.new_kv(75), 12),
                Segment([17], 30, other_kv, 1),
            ]
        )[1]
    assert torch.equal(whole, single)
    assert torch.equal(whole, verified)
    assert torch.equal(whole, batched)


def test_hf_forward_is_the_reference_variant():
    hf = _hf_model("llama")
    compact = CompactModel(hf.config, hf.state_dict(), dtype=torch.float32, device=torch.device("cpu"))
    eager = HFModel(hf, torch.device("cpu"))
    ids = _ids(40, 4)
    with torch.inference_mode():
        a = compact.forward([Segment(ids, 0, compact.new_kv(40), 5)])[0]
        b = eager.forward([Segment(ids, 0, eager.new_kv(40), 5)])[0]
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_packed_linear_rows_are_independent_of_the_batch(threads):
    """trtspec's kernel: each row bitwise the same in any batch and any thread count, close to a float64
    product, bfloat16 weights widened exactly, a bias, and outputs that are not a multiple of the block."""
    if not kernels.packed_available(torch.device("cpu")):
        pytest.skip("trtspec's CPU kernel is not built here (no C compiler at install, or no AVX2)")
    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    try:
        torch.set_num_threads(threads)
        for n, k, bias in [(576, 1536, False), (960, 576, True), (50, 24, True)]:
            w = torch.randn(n, k, generator=gen) / k**0.5
            b = torch.randn(n, generator=gen) if bias else None
            linear = kernels.PackedLinear(w, b)
            x = torch.randn(40, k, generator=gen)
            full = linear(x)
            exact = x.double() @ w.double().T + (b.double() if bias else 0)
            torch.testing.assert_close(full.double(), exact, atol=1e-5, rtol=1e-5)
            for m in (1, 2, 3, 5, 6, 7, 9, 13, 33):
                for row in {0, m // 2, m - 1}:
                    assert torch.equal(linear(x[row : row + m][:1]), full[row : row + 1]), (n, k, m, row)
                    assert torch.equal(linear(x[:m])[row], full[row]), (n, k, m, row)
            torch.set_num_threads(3 - threads)  # the other thread count: the same bits
            assert torch.equal(linear(x), full)
            torch.set_num_threads(threads)
            wb = w.bfloat16()
            assert kernels.PackedLinear(wb, b).nbytes == linear.nbytes // 2 or n % 16
            assert torch.equal(kernels.PackedLinear(wb, b)(x), kernels.PackedLinear(wb.float(), b)(x))
        with pytest.raises(TypeError, match="float32"):
            linear(x.bfloat16())
    finally:
        torch.set_num_threads(before)


def _torch_attention_reference(q, k, v, cos, sin, cache, start, window, scale):
    """Rotary embedding, cache write and causal attention as transformers computes them, in float64."""

    def rope(x):
        half = x.shape[-1] // 2
        return x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, None]

    n, hq, d = q.shape
    hkv = k.shape[1]
    keys, values = cache[0].double().clone(), cache[1].double().clone()
    keys[:, start : start + n] = rope(k.double()).transpose(0, 1)
    values[:, start : start + n] = v.double().transpose(0, 1)
    out = torch.empty(n, hq, d, dtype=torch.float64)
    qr = rope(q.double())
    for r in range(n):
        pos = start + r
        lo = max(0, pos - window + 1) if window else 0
        for h in range(hq):
            kh = h // (hq // hkv)
            w = torch.softmax(keys[kh, lo : pos + 1] @ qr[r, h] * scale, 0)
            out[r, h] = w @ values[kh, lo : pos + 1]
    return out.view(n, hq * d), keys, values


@pytest.mark.parametrize("d, window", [(64, None), (128, None), (32, 5), (16, None)])
def test_cpu_attention_kernel(d, window):
    """trtspec's attention kernel against float64 attention, and each row bitwise the same computed alone."""
    if not kernels.packed_available(torch.device("cpu")):
        pytest.skip("trtspec's CPU kernel is not built here (no C compiler at install, or no AVX2)")
    gen = torch.Generator().manual_seed(d)
    hq, hkv, n, start, cap = 6, 2, 7, 27, 64
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen)
    q = qkv[:, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
    angles = torch.arange(start, start + n)[:, None] * torch.rand(d // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    cache = torch.randn(2, hkv, cap, d, generator=gen)
    expected, keys, values = _torch_attention_reference(q, k, v, cos, sin, cache, start, window, d**-0.5)
    out = torch.zeros(n, hq * d)
    kernels.attend_rows(q, k, v, cos, sin, cache, start, window=window, scale=d**-0.5, out=out)
    torch.testing.assert_close(out.double(), expected, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(cache[0, :, : start + n].double(), keys[:, : start + n], atol=1e-6, rtol=1e-6)
    assert torch.equal(cache[1, :, start : start + n], v.transpose(0, 1))
    for r in (0, 3, n - 1):  # the same row alone, on the cache the pass left: the same bits
        alone = torch.zeros(1, hq * d)
        kernels.attend_rows(
            q[r : r + 1],
            k[r : r + 1],
            v[r : r + 1],
            cos[r : r + 1],
            sin[r : r + 1],
            cache,
            start + r,
            window=window,
            scale=d**-0.5,
            out=alone,
        )
        assert torch.equal(alone[0], out[r]), r
    with pytest.raises(ValueError, match="float32"):
        kernels.attend_rows(q.double(), k, v, cos, sin, cache, start, window=window, scale=1.0, out=out)


def test_the_cpu_kernels_were_built_where_they_can_be():
    """setup.py builds them as an optional extension: a compiler problem must show here, not as a slow engine."""
    import platform
    import sysconfig

    if platform.machine() not in ("x86_64", "AMD64") or not shutil.which(
        sysconfig.get_config_var("CC").split()[0] or "cc"
    ):
        pytest.skip("no x86-64 C compiler: the engine runs on oneDNN's products here")
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    if " avx2" not in flags or " fma" not in flags:
        pytest.skip("this CPU lacks AVX2/FMA: the engine runs on oneDNN's products here")
    assert kernels.packed_available(torch.device("cpu")), (
        "trtspec.engine._cpu_kernels did not build: see the pip install log"
    )


def test_cpu_rms_norm_kernel():
    if not kernels.packed_available(torch.device("cpu")):
        pytest.skip("trtspec's CPU kernel is not built here (no C compiler at install, or no AVX2)")
    gen = torch.Generator().manual_seed(1)
    x, residual, w = (
        torch.randn(5, 576, generator=gen),
        torch.randn(5, 576, generator=gen),
        torch.randn(576, generator=gen),
    )
    summed = x + residual
    expected = w * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5))
    y = kernels.rms_norm_rows(x, w, 1e-5, residual)
    assert torch.equal(x, summed)  # the residual is added in place
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(kernels.rms_norm_rows(x[2:3].clone(), w, 1e-5), y[2:3])  # a row alone: the same bits
    with pytest.raises(ValueError, match="residual"):
        kernels.rms_norm_rows(x, w, 1e-5, residual[:2])


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_facts_the_invariance_rests_on(threads):
    """Re-checks kernels.py's facts of oneDNN and of torch.bmm on this machine, at the demo target's shapes."""
    if not kernels.prepack_available(torch.float32, torch.device("cpu")):
        pytest.skip("no oneDNN on this build of torch: the engine reports batch_invariant = False")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        for n, k in [(576, 1536), (1536 * 2, 576), (960, 576)]:
            linear = kernels.PrepackedLinear(torch.randn(n, k, generator=gen) / k**0.5, None)
            x = torch.randn(40, k, generator=gen)
            full = linear(x)
            for m in (1, 2, 3, 5, 9, 17, 33):
                for row in {0, m // 2, m - 1}:
                    assert torch.equal(linear(x[row : row + m][:1]), full[row : row + 1]), (n, k, m, row)
                    assert torch.equal(linear(x[:m])[row], full[row]), (n, k, m, row)
        hkv, d, length = 3, 64, 192
        keys = torch.randn(hkv, length, d, generator=gen)
        q = torch.randn(hkv, 64, d, generator=gen)
        reference = torch.bmm(q, keys.transpose(1, 2))
        for m in (kernels.MIN_GEMM_ROWS, 21, 27, 40):
            assert torch.equal(torch.bmm(q[:, :m], keys.transpose(1, 2)), reference[:, :m]), m
    finally:
        torch.set_num_threads(before)


# ---- the engine: batched calls, KV budget, FP8 --------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(built_fp8):
    return Engine.load(built_fp8.target)


def test_the_engine_reports_batch_invariance(engine):
    assert type(engine.model).__name__ == "CompactModel"
    cpu = torch.device("cpu")
    assert engine.batch_invariant == (kernels.packed_available(cpu) or kernels.prepack_available(torch.float32, cpu))


def _mixed_requests(engine) -> list[GenerationRequest]:
    base = _ids(30, 11, engine.info.vocab_size)
    return [
        GenerationRequest(input_ids=base[:9], request_output_len=12, end_id=-1),
        GenerationRequest(input_ids=base, request_output_len=5, end_id=-1, return_generation_logits=True),
        GenerationRequest(
            input_ids=base[:20],
            request_output_len=4,
            draft_input_ids=[3, 4, 5],
            end_id=-1,
            return_generation_logits=True,
        ),
        GenerationRequest(
            input_ids=base[5:17],
            request_output_len=8,
            end_id=-1,
            sampling=SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=7),
        ),
        GenerationRequest(
            input_ids=base[:3],
            request_output_len=MAX_DRAFT_LEN + 1,
            draft_input_ids=base[3 : 3 + MAX_DRAFT_LEN],
            end_id=-1,
            draft_logits=np.random.default_rng(0).normal(size=(MAX_DRAFT_LEN, 320)).astype(np.float32),
            sampling=SamplingParams(temperature=1.0, top_p=1.0, seed=3),
        ),
    ]


def test_batched_calls_equal_the_same_calls_alone(built_fp8):
    alone_engine, batched_engine = Engine.load(built_fp8.target), Engine.load(built_fp8.target)
    requests = _mixed_requests(alone_engine)
    alone = [alone_engine.generate(r) for r in requests]
    batched = batched_engine.generate_many(requests)
    # up to max_batch_size (4 in these engines) calls share a step; the fifth joins when one ends
    assert batched_engine.stats.batching.max_calls_in_step == min(len(requests), batched_engine.info.max_batch_size)
    assert batched_engine.stats.batching.steps < sum(max(1, len(a.new_tokens)) for a in alone)
    for a, b in zip(alone, batched, strict=True):
        assert a.output_ids == b.output_ids
        assert (a.num_draft_tokens, a.num_accepted_tokens) == (b.num_draft_tokens, b.num_accepted_tokens)
        if a.generation_logits is not None:
            assert np.array_equal(a.generation_logits, b.generation_logits)


def test_greedy_verification_reproduces_plain_decoding_bitwise(built_fp8):
    engine = Engine.load(built_fp8.target)
    prompt = _ids(12, 21, engine.info.vocab_size)
    plain = engine.generate(
        GenerationRequest(
            input_ids=prompt, request_output_len=MAX_DRAFT_LEN + 1, end_id=-1, return_generation_logits=True
        )
    )
    fresh = Engine.load(built_fp8.target)
    verified = fresh.generate(
        GenerationRequest(
            input_ids=prompt,
            request_output_len=MAX_DRAFT_LEN + 1,
            end_id=-1,
            draft_input_ids=plain.new_tokens[:MAX_DRAFT_LEN],
            return_generation_logits=True,
        )
    )
    assert verified.num_accepted_tokens == MAX_DRAFT_LEN
    assert verified.new_tokens == plain.new_tokens
    assert np.array_equal(verified.generation_logits, plain.generation_logits)


def test_a_call_beyond_the_kv_budget_is_refused_while_others_finish(built_fp8):
    engine = Engine.load(built_fp8.target)
    per_token = engine.model.kv_bytes_per_token
    engine.cache.budget_bytes = 64 * per_token  # one 64-token key block
    too_big = GenerationRequest(input_ids=list(range(1, 60)), request_output_len=30, end_id=-1)
    with pytest.raises(RequestError, match=r"request_output_len: .*engine.kv_cache_mb"):
        engine.generate(too_big)
    # each of these fits alone (50 tokens: one block), not two together: they queue and all finish
    fits = [
        GenerationRequest(input_ids=_ids(20, s, engine.info.vocab_size), request_output_len=30, end_id=-1)
        for s in range(3)
    ]
    outcomes = engine.generate_many(fits)
    assert all(len(o.new_tokens) == 30 for o in outcomes)
    assert engine.cache.stats.peak_bytes <= engine.cache.budget_bytes
    assert engine.cache.running_bytes == 0 and engine.cache.stats.refused == 1
    # the same outputs as an engine with room to spare
    roomy = Engine.load(built_fp8.target)
    assert [o.output_ids for o in outcomes] == [roomy.generate(r).output_ids for r in fits]


def test_kept_caches_of_the_same_tokens_are_evicted_without_harm(built_fp8):
    engine = Engine.load(built_fp8.target)
    per_token, vocab = engine.model.kv_bytes_per_token, engine.info.vocab_size
    engine.cache.budget_bytes = engine.cache.reuse_bytes = 160 * per_token  # two 64-token key blocks and a half
    same = GenerationRequest(input_ids=_ids(20, 1, vocab), request_output_len=30, end_id=-1)
    first = engine.generate_many([same, same])  # at once: two kept caches that hold the same tokens
    assert len(engine.cache.entries) == 2 and first[0].output_ids == first[1].output_ids
    others = [GenerationRequest(input_ids=_ids(20, s, vocab), request_output_len=30, end_id=-1) for s in (2, 3)]
    outcomes = engine.generate_many(others)  # their room comes from evicting those
    assert engine.cache.stats.evictions >= 1 and all(len(o.new_tokens) == 30 for o in outcomes)
    assert engine.generate(same).output_ids == first[0].output_ids


def _counting(engine, name: str) -> list:
    """Count the calls of the engine model's `name` (new_kv: a new cache; copy_kv: a prefix copied into one)."""
    calls, method = [], getattr(engine.model, name)
    setattr(engine.model, name, lambda *a: (calls.append(a), method(*a))[1])
    return calls


def test_a_request_takes_its_own_cache_over_when_an_earlier_request_s_matches_as_far(built_fp8):
    engine = Engine.load(built_fp8.target)
    prompt = _ids(20, 5, engine.info.vocab_size)
    earlier = engine.generate(GenerationRequest(input_ids=prompt, request_output_len=30, end_id=-1))
    copies = _counting(engine, "copy_kv")
    # the same text again, a few tokens a call: the earlier request's kept cache holds all of it
    seq = list(prompt)
    for _ in range(6):
        result = engine.generate(GenerationRequest(input_ids=seq, request_output_len=3, end_id=-1))
        seq = result.output_ids
        assert result.reused_tokens == len(result.output_ids) - 4  # all but the newest token came from a cache
    assert seq == earlier.output_ids[: len(seq)]
    assert len(copies) == 1  # the first call copies the shared prefix; the others take their own cache over
    assert len(engine.cache.entries) == 2


def test_common_prefix_matches_a_scan():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        a, b = (tuple(rng.integers(0, 2, rng.integers(0, 40)).tolist()) for _ in range(2))
        scan = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert _common_prefix(a, b) == scan
    for _ in range(300):  # long sequences that part anywhere, the windows' edges included
        a = tuple(rng.integers(0, 50, rng.integers(0, 3000)).tolist())
        cut = int(rng.integers(0, len(a) + 1))
        b = a[:cut] + tuple(rng.integers(50, 99, rng.integers(0, 40)).tolist())
        assert _common_prefix(a, b) == _common_prefix(b, a) == min(cut, len(b))


def test_a_sequence_that_outgrows_its_cache_gets_room_to_grow(built_fp8):
    engine = Engine.load(built_fp8.target)
    pool = engine.cache
    new = _counting(engine, "new_kv")
    seq = _ids(20, 6, engine.info.vocab_size)
    while len(seq) < 380:  # a request that verifies 3 tokens a call; capacities are whole 64-token key blocks
        lease = pool.acquire(seq, len(seq) + 4, len(seq) - 1)
        assert lease.cached == (len(seq) - 1 if len(seq) > 20 else 0)
        seq = seq + [1, 2, 3]
        pool.release(lease, seq[:-1])
    # two caches: its first (64 positions), and the one it moved to at 66 tokens, with room for GROWTH_TOKENS more
    # (384 positions); without that room, a new cache and a copy at every key block: 6
    assert new == [(24,), (66 + GROWTH_TOKENS,)]
    pool.budget_bytes = pool.running_bytes + pool.kept_bytes + pool.bytes_for(len(seq) + 64)
    lease = pool.acquire(seq, len(seq) + 64, len(seq) - 1)  # no room to spare: exactly the call's need
    assert lease.nbytes == pool.bytes_for(len(seq) + 64) and lease.cached == len(seq) - 1


def test_a_fault_outside_the_forward_pass_fails_the_calls_in_flight_not_the_engine(built_fp8):
    engine = Engine.load(built_fp8.target)
    vocab = engine.info.vocab_size
    request = GenerationRequest(input_ids=_ids(12, 4, vocab), request_output_len=8, end_id=-1)
    expected = engine.generate(request).output_ids
    acquire = engine.cache.acquire

    def broken(*args, **kwargs):  # a fault in admission, once
        engine.cache.acquire = acquire
        raise RuntimeError("bookkeeping fault")

    engine.cache.acquire = broken
    engine.scheduler.start()  # the worker thread, as in the server
    try:
        with cf.ThreadPoolExecutor(1) as pool:  # (a worker killed by the fault would leave the call waiting)
            with pytest.raises(EngineError, match="bookkeeping fault"):
                pool.submit(engine.generate, request).result(timeout=60)
            assert pool.submit(engine.generate, request).result(timeout=60).output_ids == expected
    finally:
        engine.scheduler.stop()


def test_a_stop_reaches_only_the_latest_request_with_its_id(built_fp8):
    """As TensorRT-LLM's backend maps ids (model_instance_state.cc `enqueue` replaces the id's entry with the newest
    request's calls; `handleStopRequest` cancels those): a stop ends the latest calls with the id, and an earlier
    call with the same id runs to its end; once those have ended, a stop of the id ends nothing."""
    engine = Engine.load(built_fp8.target)
    vocab = engine.info.vocab_size
    ended: dict[str, object] = {}
    first = GenerationRequest(input_ids=_ids(10, 1, vocab), request_output_len=20, end_id=-1)
    later = GenerationRequest(input_ids=_ids(10, 2, vocab), request_output_len=20, end_id=-1)
    engine.submit(first, lambda out: ended.__setitem__("first", out), request_id="1")
    engine.scheduler.step()  # the first is running
    engine.submit_all(  # a request of two rows with the same id
        [
            (later, lambda out: ended.__setitem__("later", out), None),
            (later, lambda out: ended.__setitem__("later row", out), None),
        ],
        request_id="1",
    )
    engine.scheduler.step()
    assert engine.cancel("1") == 2  # both rows of the latest request, not the first
    while len(ended) < 3:
        engine.scheduler.step()
    assert len(ended["first"].new_tokens) == 20
    assert len(ended["later"].new_tokens) < 20 and len(ended["later row"].new_tokens) < 20
    assert engine.cancel("1") == 0 and not engine.scheduler._latest  # ended calls leave the id's map


def test_the_waiting_queue_is_bounded_by_max_queue_size(built_fp8):
    """A request whose rows would take the waiting calls past max_queue_size is refused whole, at once, naming the
    limit (as TensorRT-LLM's executor refuses it); nothing of it is queued, and a request that fits is served."""
    engine = Engine.load(built_fp8.target)
    scheduler, vocab = engine.scheduler, engine.info.vocab_size
    scheduler.max_queue_size = 2
    call = GenerationRequest(input_ids=_ids(8, 3, vocab), request_output_len=4, end_id=-1)
    ended: list = []

    def rows(n):
        return [(call, ended.append, None)] * n

    with pytest.raises(EngineBusy, match=r"max_queue_size 2"):
        engine.submit_all(rows(3), request_id="three")  # more rows than the queue holds, even when it is empty
    assert not scheduler.waiting and "three" not in scheduler._latest
    engine.submit_all(rows(2), request_id="two")
    with pytest.raises(EngineBusy, match=r"2 calls wait .* adds 1, beyond max_queue_size 2"):
        engine.submit(call, ended.append, request_id="one")
    scheduler.step()  # the waiting calls take batch slots: the queue has room again
    engine.submit(call, ended.append, request_id="one")
    while len(ended) < 3:
        scheduler.step()
    assert all(len(o.new_tokens) == 4 for o in ended)


def test_kv_budget_comes_from_the_build_config(tiny_pair, tmp_path):
    from trtspec.compile import run_build

    config = write_config(
        tmp_path / "build.yaml",
        tiny_pair.target,
        None,
        engine={"max_input_len": 64, "max_seq_len": 96, "kv_cache_mb": 3, "kv_cache_reuse_mb": 1},
    )
    engines = run_build(config, tmp_path / "engines")
    engine = Engine.load(engines / "target")
    assert engine.cache.budget_bytes == 3 * 2**20 and engine.cache.reuse_bytes == 2**20
    # built without engine.gather_*_logits, it refuses requests for them, as TensorRT-LLM's executor does
    for name in ("return_context_logits", "return_generation_logits"):
        with pytest.raises(RequestError, match=name):
            engine.generate(GenerationRequest(input_ids=[1, 2, 3], request_output_len=2, **{name: True}))


def test_fp8_products_match_the_dequantized_weights(built_fp8):
    exact = Engine.load(built_fp8.target)
    fp8 = Engine.load(built_fp8.target, fp8_matmul=True)
    assert any(type(lin).__name__ == "Fp8Linear" for lin in fp8.model.layers[0].values())
    ids = _ids(20, 9, exact.info.vocab_size)
    with torch.inference_mode():
        a = exact.model.forward([Segment(ids, 0, exact.model.new_kv(20), 20)])[0]
        b = fp8.model.forward([Segment(ids, 0, fp8.model.new_kv(20), 20)])[0]
    # activations quantized to E4M3 per token at every linear of a random 2-layer model: close, not equal
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.95
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.75


def test_one_fp8_product_is_within_e4m3_rounding():
    from trtspec.engine import fp8

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=gen)
    x = torch.randn(5, 32, generator=gen)
    q, scale = fp8.quantize(w, per_channel=True)
    w_deq = fp8.dequantize(q, scale, torch.float32)
    y = kernels.Fp8Linear(q, scale, None, torch.float32)(x)
    exact = x @ w_deq.t()
    # E4M3 keeps 3 mantissa bits: each activation within 2^-4 of itself; the bfloat16 output within 2^-8
    bound = 2**-4 * (x.abs() @ w_deq.abs().t()) + 2**-8 * exact.abs() + 1e-6
    assert ((y - exact).abs() <= bound).all()
    assert not torch.equal(y, exact)  # it really went through FP8


def test_the_forward_choice(built_fp8):
    eager = Engine.load(built_fp8.target, forward="hf")
    assert type(eager.model).__name__ == "HFModel" and not eager.batch_invariant
    compact = Engine.load(built_fp8.target)
    request = GenerationRequest(input_ids=[5, 6, 7, 8], request_output_len=10, end_id=-1)
    assert eager.generate(request).output_ids == compact.generate(request).output_ids


# ---- through the real server --------------------------------------------------------------------------------


def test_concurrent_calls_through_triton_equal_the_same_calls_one_at_a_time(triton_server, built_fp8):
    from trtspec.client import SpecClient

    requests = _mixed_requests(Engine.load(built_fp8.target, check_invariance=False))

    def infer(request: GenerationRequest) -> dict[str, np.ndarray]:
        with SpecClient(triton_server.grpc_url, "grpc") as client:
            result = client.infer("tensorrt_llm", request_to_tensors(request))
        return {
            n: result.get(n)
            for n in ("output_ids", "sequence_length", "generation_logits", "total_accepted_draft_tokens")
        }

    one_by_one = [infer(r) for r in requests]
    with cf.ThreadPoolExecutor(len(requests) * 2) as pool:
        together = list(pool.map(infer, requests * 2))
    for i, got in enumerate(together):
        want = one_by_one[i % len(requests)]
        for name, value in want.items():
            if value is not None:
                assert np.array_equal(got[name], value), (i, name)


def test_the_dense_products_of_a_gpu_or_a_cpu_without_onednn(monkeypatch):
    """The path CUDA takes (F.linear, cuBLAS there): the same network, no invariance promised."""
    monkeypatch.setattr(kernels, "prepack_available", lambda dtype, device: False)
    monkeypatch.setattr(kernels, "packed_available", lambda device: False)
    hf = _hf_model("qwen2")
    model = CompactModel(hf.config, hf.state_dict(), dtype=torch.float32, device=torch.device("cpu"))
    assert model.linear_kind == "dense"
    ids = _ids(30, 8)
    with torch.inference_mode():
        got = model.forward([Segment(ids, 0, model.new_kv(30), 30)])[0]
        reference = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, reference, atol=2e-5, rtol=1e-5)
