"""trtspec's CPU kernels on FP8 weights and on each instruction set: products against float64, each row bitwise
the same in any batch, every path the same bits, FP8 codes exact through bfloat16, the decoder kernel against the
framework's loop over the same kernels, FP8 models against Hugging Face on the dequantized weights, and KV caches of
bfloat16 or float16 written rounded to nearest even and read exactly."""

from __future__ import annotations

import pytest
import torch
from test_engine_batching import ARCHITECTURES, _hf_model, _ids

from trtspec.engine import fp8, hugepages, kernels
from trtspec.engine.model import CompactModel, Segment

pytestmark = pytest.mark.skipif(
    not kernels.packed_available(torch.device("cpu")),
    reason="trtspec's CPU kernel is not built here (no C compiler at install, or no AVX2)",
)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_every_e4m3_code_is_exact_as_bfloat16():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = ~codes.float().isnan()
    as_bf16 = codes[finite].to(torch.bfloat16)
    assert torch.equal(as_bf16.float(), codes[finite].float())
    assert torch.equal(as_bf16.to(torch.float8_e4m3fn).view(torch.uint8), codes[finite].view(torch.uint8))
    assert int(finite.sum()) == 254  # only 0x7F and 0xFF are NaN, and the quantizer never writes them
    q, _ = fp8.quantize(torch.tensor([[1e9, -1e9, 1e-9, 0.0]]))
    assert not q.float().isnan().any()


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
@pytest.mark.parametrize("isa", kernels.ISAS)
@pytest.mark.parametrize("storage", kernels.FP8_STORAGES)
def test_fp8_products_on_every_path(storage, isa, per_channel, threads):
    """Each path against float64 on the dequantized weights (subnormal codes included), each row bitwise the
    same alone, in any batch and on any thread count, and the same bits as every other path."""
    gen = torch.Generator().manual_seed(7)
    for n, k, bias in [(960, 576, False), (50, 24, True), (64, 1536, True)]:
        w = torch.randn(n, k, generator=gen) / k**0.5
        w[0, :8] = torch.tensor([1e-6, -3e-7, 0.0, 5e-8, 1e-3, -1e-3, 2.0, -2.0])  # subnormal and zero codes
        q, scale = fp8.quantize(w, per_channel=per_channel)
        b = torch.randn(n, generator=gen) if bias else None
        linear = kernels.PackedLinear(q, b, scale=scale, storage=storage, isa=isa)
        assert linear.format == {"e4m3": "e4m3", "bf16": "bfloat16"}[storage]
        assert linear.nbytes == -(-n // 16) * 16 * k * (1 if storage == "e4m3" else 2)
        x = torch.randn(30, k, generator=gen)
        full = linear(x)
        exact = x.double() @ fp8.dequantize(q, scale, torch.float64).T + (b.double() if bias else 0)
        torch.testing.assert_close(full.double(), exact, atol=1e-5, rtol=1e-5)
        _same_bits_in_any_batch(linear, x, full, (1, 2, 3, 4, 5, 7, 12, 13, 25), threads)
        for other_isa in kernels.ISAS:
            for other in kernels.FP8_STORAGES:
                assert torch.equal(kernels.PackedLinear(q, b, scale=scale, storage=other, isa=other_isa)(x), full)


def _same_bits_in_any_batch(linear, x, full, batches, threads):
    """Each row of `full` (= linear(x)) comes out bitwise the same alone, in a batch of each size in `batches` at
    its start, middle or end, and on the other thread count."""
    for m in batches:
        for row in {0, m // 2, m - 1}:
            assert torch.equal(linear(x[row : row + m][:1]), full[row : row + 1]), (linear.n, linear.k, m, row)
            assert torch.equal(linear(x[:m])[row], full[row]), (linear.n, linear.k, m, row)
    torch.set_num_threads(3 - threads)
    assert torch.equal(linear(x), full)
    torch.set_num_threads(threads)


bf16_rows = pytest.mark.skipif(not kernels.BF16_ROWS, reason=f"this CPU lacks {kernels.BF16_ISA}")


@bf16_rows
@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
@pytest.mark.parametrize("isa", kernels.PAIR_ISAS)
@pytest.mark.parametrize("storage", kernels.FP8_STORAGES)
def test_bf16_row_products_against_float64(storage, isa, per_channel, threads):
    """The pair formats (bfloat16 rows; vdpbf16ps, or AMX's tiles): against float64 on the rows rounded to
    bfloat16 and the dequantized weights (subnormal codes, K not a multiple of 4, K/2 not a multiple of AMX's 16
    pairs), each row bitwise the same alone, in any batch (more rows than one AMX tile holds included) and on any
    thread count, and the same bits from either storage of the codes."""
    gen = torch.Generator().manual_seed(11)
    for n, k, bias in [(960, 576, False), (50, 30, True), (40, 100, True), (64, 1536, True)]:
        w = torch.randn(n, k, generator=gen) / k**0.5
        w[0, :8] = torch.tensor([1e-6, -3e-7, 0.0, 5e-8, 1e-3, -1e-3, 2.0, -2.0])  # subnormal and zero codes
        q, scale = fp8.quantize(w, per_channel=per_channel)
        b = torch.randn(n, generator=gen) if bias else None
        linear = kernels.PackedLinear(q, b, scale=scale, storage=storage, rows=torch.bfloat16, isa=isa)
        assert linear.rows == torch.bfloat16 and linear.fields[1] == {"e4m3": 4, "bf16": 3}[storage]
        x = torch.randn(30, k, generator=gen)
        full = linear(x)
        exact = x.bfloat16().double() @ fp8.dequantize(q, scale, torch.float64).T + (b.double() if bias else 0)
        torch.testing.assert_close(full.double(), exact, atol=1e-5, rtol=1e-5)
        assert not torch.equal(full, kernels.PackedLinear(q, b, scale=scale, storage=storage)(x))  # other rows
        _same_bits_in_any_batch(linear, x, full, (1, 2, 3, 4, 5, 6, 7, 9, 12, 13, 16, 17, 25), threads)
        for other in kernels.FP8_STORAGES:
            same = kernels.PackedLinear(q, b, scale=scale, storage=other, rows=torch.bfloat16, isa=isa)
            assert torch.equal(same(x), full)
        wb = w.bfloat16()
        plain = kernels.PackedLinear(wb, b, rows=torch.bfloat16, isa=isa)
        exact = x.bfloat16().double() @ wb.double().T + (b.double() if bias else 0)
        torch.testing.assert_close(plain(x).double(), exact, atol=1e-5, rtol=1e-5)
        assert torch.equal(plain(x[3:4]), plain(x)[3:4])


@bf16_rows
def test_a_bfloat16_model_takes_bfloat16_rows_and_stays_batch_invariant():
    """A bfloat16 build's products (layers and head) round their rows to bfloat16; a position's logits are the
    same bits decoded alone, verified behind other rows or batched; close to the float32-row forward."""
    hf = _hf_model("llama", seed=4)
    state = fp8.quantize_state_dict(hf.state_dict(), per_channel=False)
    model = CompactModel(hf.config, state, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert model.rows_dtype == torch.bfloat16 and model.head.rows == torch.bfloat16
    assert f"{kernels.PAIR_ISAS[-1]}, bfloat16 rows" in model.kernel_summary
    ids = _ids(60, 8)
    with torch.inference_mode():
        full = model.forward([Segment(ids, 0, model.new_kv(60), 20)])[0]
        kv = model.new_kv(60)
        model.forward([Segment(ids[:40], 0, kv, 1)])
        stepwise = torch.cat([model.forward([Segment([ids[p]], p, kv, 1)])[0] for p in range(40, 60)])
        batched = model.forward([Segment(_ids(7, 2), 0, model.new_kv(7), 3), Segment(ids, 0, model.new_kv(60), 20)])[1]
    assert torch.equal(full, stepwise) and torch.equal(full, batched)
    f32 = CompactModel(hf.config, state, dtype=torch.float32, device=torch.device("cpu"))
    with torch.inference_mode():
        wide = f32.forward([Segment(ids, 0, f32.new_kv(60), 20)])[0]
    # rows rounded to bfloat16 (2^-9 relative) at every product of a 2-layer model, and a bfloat16 KV cache
    torch.testing.assert_close(full, wide, atol=0.05, rtol=0.02)
    assert (full.argmax(-1) == wide.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_instruction_sets_give_the_same_bits(dtype):
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(100, 200, generator=gen).to(dtype), torch.randn(17, 200, generator=gen)
    outs = [kernels.PackedLinear(w, None, isa=isa)(x) for isa in kernels.ISAS]
    assert all(torch.equal(out, outs[0]) for out in outs)


def test_bad_packed_linear_arguments_are_named():
    q, scale = fp8.quantize(torch.randn(16, 16))
    with pytest.raises(ValueError, match="scale"):
        kernels.PackedLinear(q, None)
    with pytest.raises(ValueError, match="scale"):
        kernels.PackedLinear(torch.randn(16, 16), None, scale=scale)
    with pytest.raises(ValueError, match="storage"):
        kernels.PackedLinear(q, None, scale=scale, storage="int8")
    with pytest.raises(ValueError, match="does not run float32 rows here"):
        kernels.PackedLinear(q, None, scale=scale, isa="neon")
    with pytest.raises(ValueError, match="float32 or bfloat16 rows"):
        kernels.PackedLinear(q, None, scale=scale, rows=torch.float16)
    with pytest.raises(ValueError, match="does not run float32 rows"):
        kernels.PackedLinear(q, None, scale=scale, isa=kernels.BF16_ISA)
    if kernels.BF16_ROWS:
        with pytest.raises(ValueError, match="bfloat16 or FP8 weights"):
            kernels.PackedLinear(torch.randn(16, 16), None, rows=torch.bfloat16)
        with pytest.raises(ValueError, match="does not run bfloat16 rows"):
            kernels.PackedLinear(q, None, scale=scale, rows=torch.bfloat16, isa="avx512")
    else:
        with pytest.raises(ValueError, match=kernels.BF16_ISA):
            kernels.PackedLinear(q, None, scale=scale, rows=torch.bfloat16)


def test_the_fp8_storage_is_measured_or_pinned(monkeypatch):
    monkeypatch.setattr(kernels, "_fp8_storage", {})
    monkeypatch.setenv(kernels.FP8_STORAGE_ENV, "bf16")
    assert kernels.fp8_storage() == "bf16" and kernels.FP8_STORAGE_ENV in kernels.fp8_storage_reason()
    monkeypatch.setattr(kernels, "_fp8_storage", {})
    monkeypatch.setenv(kernels.FP8_STORAGE_ENV, "fp4")
    with pytest.raises(ValueError, match=kernels.FP8_STORAGE_ENV):
        kernels.fp8_storage()
    seconds = kernels.measure_fp8_storages(weights_mb=4, reps=1)
    assert set(seconds) == set(kernels.FP8_STORAGES) and all(s > 0 for s in seconds.values())


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_kv_cache_holds_rounded_keys_and_values_and_attention_reads_them_exactly(kv_dtype, threads):
    """The attention kernel writes the rotated keys and the values into a cache of `kv_dtype` (rounded to nearest
    even, as torch rounds) and attends over what the cache holds: against float64 on the rounded keys and values."""
    gen = torch.Generator().manual_seed(3)
    n, start, hq, hkv, d = 5, 11, 4, 2, 32
    q, k, v = (torch.randn(n, h, d, generator=gen) for h in (hq, hkv, hkv))
    angles = torch.arange(start, start + n)[:, None] * torch.rand(d // 2, generator=gen)[None]
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    cache = torch.zeros(2, hkv, kernels.attention_length(start + n), d, dtype=kv_dtype)
    cache[:, :, :start] = torch.randn(2, hkv, start, d, generator=gen).to(kv_dtype)
    out = torch.empty(n, hq * d)
    kernels.attend_rows(q, k, v, cos, sin, cache, start, window=None, scale=d**-0.5, out=out)

    def rope(x):  # the kernel's expression in float32, operation by operation
        a, b = x[..., : d // 2], x[..., d // 2 :]
        c, s = cos[:, None], sin[:, None]
        return torch.cat([a * c[..., : d // 2] - b * s[..., : d // 2], b * c[..., d // 2 :] + a * s[..., d // 2 :]], -1)

    assert torch.equal(cache[0, :, start : start + n], rope(k).to(kv_dtype).transpose(0, 1))
    assert torch.equal(cache[1, :, start : start + n], v.to(kv_dtype).transpose(0, 1))
    keys, values = cache[0].double(), cache[1].double()
    qr = rope(q).double()
    for r in range(n):
        for h in range(hq):
            scores = (keys[h // (hq // hkv), : start + r + 1] @ qr[r, h]) * d**-0.5
            want = torch.softmax(scores, 0) @ values[h // (hq // hkv), : start + r + 1]
            torch.testing.assert_close(out[r, h * d : (h + 1) * d].double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.skipif("avx512" not in kernels.ISAS, reason="needs a CPU with AVX-512 and trtspec's kernels")
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_attention_gives_the_same_bits_with_avx512_as_with_avx2(kv_dtype, threads):
    """The AVX-512 attention computes each lane as the eight-lane one does: one to nine rows (a decode step, a
    verification, a prompt), after 0 to 40 cached positions (whole groups of eight keys and the rest), head sizes
    of 64, 48 and 40 (not a multiple of 16: eight lanes), with and without a sliding window."""
    gen = torch.Generator().manual_seed(11)
    for d in (64, 48, 40):
        for n in (1, 2, 5, 8, 9):
            for start in (0, 7, 40):
                for window in (None, 6):
                    q, k, v = (torch.randn(n, h, d, generator=gen) for h in (6, 2, 2))
                    angles = torch.arange(start, start + n)[:, None] * torch.rand(d // 2, generator=gen)[None]
                    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
                    cache = torch.zeros(2, 2, kernels.attention_length(start + n), d, dtype=kv_dtype)
                    cache[:, :, :start] = torch.randn(2, 2, start, d, generator=gen).to(kv_dtype)
                    outs, caches = [], []
                    for isa in ("avx2", "avx512"):
                        out, c = torch.empty(n, 6 * d), cache.clone()
                        kernels.attend_rows(q, k, v, cos, sin, c, start, window=window, scale=d**-0.5, out=out, isa=isa)
                        outs.append(out)
                        caches.append(c)
                    assert torch.equal(caches[0], caches[1])
                    assert torch.equal(outs[0], outs[1]), (d, n, start, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
def test_the_decoder_kernel_equals_the_framework_loop(kind, dtype, threads):
    """One call for every layer against the same kernels called layer by layer from Python: the same network
    (the activation is computed by another formula: a few ulps), and bitwise batch-invariant itself, with the KV
    cache in the configured dtype (half the bytes of float32 for bfloat16 and float16)."""
    hf = _hf_model(kind, seed=5)
    model = CompactModel(hf.config, hf.state_dict(), dtype=dtype, device=torch.device("cpu"))
    assert model.layer_table is not None
    assert model.new_kv(90).dtype == dtype
    assert model.kv_bytes_per_token == model.num_layers * 2 * model.hkv * model.head_dim * dtype.itemsize
    ids = _ids(90, 6)
    with torch.inference_mode():
        fused = model.forward([Segment(ids, 0, model.new_kv(90), 20)])[0]
        kv = model.new_kv(90)
        model.forward([Segment(ids[:70], 0, kv, 1)])
        stepwise = torch.cat([model.forward([Segment([ids[p]], p, kv, 1)])[0] for p in range(70, 90)])
        batched = model.forward([Segment(_ids(9, 1), 0, model.new_kv(9), 2), Segment(ids, 0, model.new_kv(90), 20)])[1]
        table, model.layer_table = model.layer_table, None
        loop = model.forward([Segment(ids, 0, model.new_kv(90), 20)])[0]
        model.layer_table = table
    assert torch.equal(fused, stepwise) and torch.equal(fused, batched)
    torch.testing.assert_close(fused, loop, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_an_fp8_model_equals_hugging_face_on_its_dequantized_weights(kind, per_channel):
    hf = _hf_model(kind, seed=2)
    state = fp8.quantize_state_dict(hf.state_dict(), per_channel=per_channel)
    hf.load_state_dict(fp8.dequantize_state_dict(state, torch.float32))
    model = CompactModel(hf.config, state, dtype=torch.float32, device=torch.device("cpu"))
    assert {lin.format for lin in model.layers[0].values() if isinstance(lin, kernels.PackedLinear)} <= {
        "e4m3",
        "bfloat16",
    }
    ids = _ids(80, 3)
    with torch.inference_mode():
        got = model.forward([Segment(ids, 0, model.new_kv(80), 80)])[0]
        reference = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, reference, atol=3e-5, rtol=1e-5)
    assert "FP8 kept as" in model.kernel_summary


def test_packed_weights_on_huge_pages_give_the_same_bits(threads):
    """hugepages.place copies tensors into one mapping that asks for 2 MiB pages; a product reads its weights
    there (the old tensor gone) with the same bits, and where the machine has no huge pages nothing moves."""
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 0x7F, (96, 200), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    x = torch.randn(3, 200, generator=gen)
    lin, other = (kernels.PackedLinear(codes, None, scale=torch.tensor(0.02)) for _ in range(2))
    before = lin(x)
    big = torch.ones(4 << 20, dtype=torch.uint8)
    placed, where = hugepages.place([lin.packed, big, other.packed])
    if where.setting not in ("always", "madvise"):
        assert placed[0] is lin.packed and where.huge_bytes == 0 and "4 KiB pages" in where.summary()
        return
    assert placed[0].data_ptr() % hugepages.HUGE_PAGE == 0
    assert [t.data_ptr() % hugepages.ALIGN for t in placed] == [0, 0, 0]
    assert all(torch.equal(a, b) for a, b in zip(placed, [lin.packed, big, other.packed]))
    assert where.nbytes == lin.nbytes + big.numel() + other.nbytes
    assert 0 < where.huge_bytes <= where.nbytes, "the kernel gave no 2 MiB pages to a 4 MiB madvised mapping"
    old = lin.packed.data_ptr()
    lin.move_to(placed[0])
    del placed
    assert lin.fields[0] == lin.packed.data_ptr() != old
    assert torch.equal(lin(x), before)


def test_a_model_keeps_its_packed_weights_where_its_log_line_says():
    hf = _hf_model("llama", seed=3)
    model = CompactModel(
        hf.config,
        fp8.quantize_state_dict(hf.state_dict(), per_channel=False),
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    linears = model._packed_linears(head=True)
    assert model.head in linears and len(linears) == 4 * model.num_layers + 1
    assert model.placement.nbytes == sum(lin.nbytes for lin in linears)
    assert model.placement.summary() in model.kernel_summary
    assert all(lin.fields[0] == lin.packed.data_ptr() for lin in linears)
    if model.placement.huge_bytes:
        assert linears[0].packed.data_ptr() % hugepages.HUGE_PAGE == 0
