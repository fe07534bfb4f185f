"""The embedded engine's matrix products, chosen so that a row's result never depends on the rows beside it.

Batch invariance is what makes greedy speculative output equal target-only output by construction: the
target's logits for a position must be bitwise the same whether that position is decoded alone, verified
with draft tokens after it, or computed in one pass with other requests' sequences. The products used here:
- `PackedLinear` (CPU, the default): trtspec's own kernel (`_cpu_kernels.c`, AVX-512 or AVX2 + FMA, built at
  install), on weights packed once as [N/16][K][16] in float32, bfloat16 or, for an FP8 model, the E4M3
  codes themselves (1 byte a weight, or 2 as their exact bfloat16 values where this machine streams those
  faster: `fp8_storage`), widened exactly in the kernel with the scale applied to the output; float32
  activations, or, for a bfloat16 model on a CPU with AVX512_BF16, activations rounded to bfloat16 and
  multiplied in pairs of k (`rows`, `BF16_ROWS`). Each output is one multiply-add chain over K in order,
  whatever the number of rows and on either instruction set, so rows are batch-invariant by construction and
  the two instruction sets give the same bits (for float32 rows); and it streams the weights at close to the
  machine's read bandwidth, which a decode step's few hundred small products need (oneDNN's float32 product
  reached half of it on a 2-core AVX2 machine, and a bfloat16 weight on a CPU without bfloat16 instructions
  took PyTorch's slow path).
- `PrepackedLinear` (CPU without the kernel: no compiler at install, or no AVX2): oneDNN's prepacked linear
  (`mkldnn._linear_pointwise` on a `_reorder_linear_weight` weight) gives bitwise equal rows for any number of
  rows >= 2; a single row takes another path (a GEMV) whose sums round differently, so fewer than four rows
  are padded to four.
- attention: the dense fp32 GEMM behind `torch.bmm` rounds a row the same way for any number of rows >= 12
  (and where the row sits among them); below that, small-matrix kernels round differently. Attention therefore
  pads its query rows to at least `MIN_GEMM_ROWS`, and each row's keys to a length that depends on the row
  alone (`attention_length`), so every row of every pass goes through identically shaped products.
tests/test_engine_batching.py re-checks these facts, and `Engine.check_batch_invariance` checks the loaded
model itself at load. On CUDA, cuBLAS picks kernels (and split-K) by shape, so no such guarantee is made
there: the engine reports `batch_invariant = False` and `trtspec validate outputs` classifies differences as
near-ties or mismatches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trtspec.engine import hugepages

MIN_GEMM_ROWS = 16  # query rows per attention product (see the module docstring)
KEY_BLOCK = 64  # a row attends over its keys padded to a multiple of this


def attention_length(position: int) -> int:
    """Keys a query at `position` (0-based) is computed over: its own position + 1, rounded up to KEY_BLOCK."""
    return -(-(position + 1) // KEY_BLOCK) * KEY_BLOCK


def _cpu_module():
    try:
        from trtspec.engine import _cpu_kernels
    except ImportError:  # built without a C compiler, or on a platform the kernels do not cover
        return None
    return _cpu_kernels if _cpu_kernels.isas() else None


BF16_ISA = "avx512bf16"  # AVX512_BF16 (+ _BW, _VL, _VBMI): bfloat16 rows, multiplied in pairs by vdpbf16ps
AMX_ISA = "amx"  # AMX-BF16 tiles: bfloat16 rows, up to 16 of them multiplied for about the cost of one
ISA_ENV = "TRTSPEC_CPU_ISA"  # caps the instruction set the kernels use (avx2 on an AVX-512 machine)
F32_ISAS = ("avx2", "avx512")  # the instruction sets of float32 rows, which all give the same bits
_ISA_CODE = {"avx2": 0, "avx512": 1, BF16_ISA: 1, AMX_ISA: 2}  # as the kernel numbers them


def _isas() -> tuple[str, ...]:
    """The instruction sets trtspec's kernels run here, the widest last, up to $TRTSPEC_CPU_ISA when it is set."""
    import os

    have = tuple(_CPU.isas()) if _CPU is not None else ()
    levels = tuple(_ISA_CODE)
    cap = os.environ.get(ISA_ENV, "").strip()
    if cap and cap not in levels:
        raise ValueError(f"${ISA_ENV}={cap!r}: set it to one of {', '.join(levels)}, or unset it")
    return tuple(isa for isa in have if not cap or levels.index(isa) <= levels.index(cap))


_CPU = _cpu_module()
_RUNNABLE = _isas()
ISAS = tuple(isa for isa in _RUNNABLE if isa in F32_ISAS)  # for float32 rows; every one gives the same bits
# for bfloat16 rows (the pair formats): vdpbf16ps, or AMX's tiles where the CPU has them; the two round differently,
# so a model's products all take the same one (the widest, unless $TRTSPEC_CPU_ISA caps it)
PAIR_ISAS = tuple(isa for isa in _RUNNABLE if isa not in F32_ISAS)
# whether a bfloat16 model's products can take their rows in bfloat16 here, as its GEMMs on a GPU do: twice the
# multiply-adds per instruction, and FP8 codes or bfloat16 weights without widening to float32 (PackedLinear)
BF16_ROWS = bool(PAIR_ISAS)
_FORMATS = {torch.float32: ("float32", 0), torch.bfloat16: ("bfloat16", 1), torch.uint8: ("e4m3", 2)}  # name, code
FP8_STORAGES = ("e4m3", "bf16")
# the KV cache elements the attention kernel reads and writes (float32 computed, rounded to nearest even when stored)
KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FP8_STORAGE_ENV = "TRTSPEC_FP8_WEIGHTS"  # pins the choice fp8_storage would measure


def packed_available(device: torch.device) -> bool:
    """Whether trtspec's own CPU kernels run here (built at install, AVX2 + FMA + F16C at least)."""
    return device.type == "cpu" and _CPU is not None


def rms_norm_rows(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """With trtspec's kernel: x += residual (in place, when given), then the RMS norm of each row of x."""
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match {tuple(x.shape)}")
    x, residual = _f32_rows(x), None if residual is None else _f32_rows(residual.contiguous())
    if _f32_rows(weight).shape != x.shape[1:]:
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match rows of {x.shape[1]}")
    y = torch.empty_like(x)
    _CPU.rms_norm(
        x.data_ptr(),
        0 if residual is None else residual.data_ptr(),
        x.shape[0],
        x.shape[1],
        weight.data_ptr(),
        eps,
        y.data_ptr(),
    )
    return y


def attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: torch.Tensor,
    start: int,
    *,
    window: int | None,
    scale: float,
    out: torch.Tensor,
    isa: str | None = None,
) -> None:
    """With trtspec's kernel, one sequence's new rows on one layer: q [n, Hq, d], k and v [n, Hkv, d] (rows
    may be strided views of one product), cos and sin [n, d] (the rows' rotary tables); rotates the queries and
    keys, writes keys and values at positions start.. of `cache` [2, Hkv, capacity, d] (of a KV_FORMATS dtype), and
    writes each row's causal attention over positions 0..its own into `out` [n, Hq * d]. `isa`: AVX-512 or wider
    computes the same bits two eight-lane vectors at a time (default: the widest runnable here)."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    for t in (q, k, v):
        if t.dtype != torch.float32 or t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError("attend_rows takes float32 rows of contiguous heads")
    cos, sin = _f32_rows(cos), _f32_rows(sin)
    if out.stride(0) != hq * d or not out.is_contiguous():
        raise ValueError("attend_rows writes into contiguous rows")
    _CPU.attention(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        n,
        hq,
        hkv,
        d,
        cos.data_ptr(),
        sin.data_ptr(),
        cache.data_ptr(),
        _kv_format(cache),
        cache.shape[2],
        start,
        window or 0,
        scale,
        out.data_ptr(),
        out.stride(0),
        torch.get_num_threads(),
        _ISA_CODE[isa or _RUNNABLE[-1]],
    )


DECODER_LINEARS = ("qkv", "o", "gate_up", "down")  # in the order of a layer table's fields


def layer_table(layers: list[dict]) -> torch.Tensor:
    """The decoder kernel's table of layers: per layer the addresses of its two norms' weights, then of each of
    DECODER_LINEARS its `fields`. The tensors must outlive the table."""
    rows = []
    for layer in layers:
        row = [_f32_rows(layer["input_norm"]).data_ptr(), _f32_rows(layer["post_norm"]).data_ptr()]
        for key in DECODER_LINEARS:
            row += layer[key].fields
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


def segment_table(segments: list[tuple[int, int, int, torch.Tensor]]) -> torch.Tensor:
    """The decoder kernel's table of sequences in a pass: (first row, rows, start position, KV cache
    [layers, 2, Hkv, capacity, d] of a KV_FORMATS dtype) each."""
    rows = []
    for first, n, start, kv in segments:
        kvf = _kv_format(kv)
        if start + n > kv.shape[3]:
            raise ValueError(f"a KV cache of {kv.shape[3]} positions cannot take rows up to {start + n}")
        rows.append([first, n, start, kv.data_ptr(), kv.stride(0) * kv.element_size(), kv.shape[3], kvf])
    return torch.tensor(rows, dtype=torch.int64)


def decoder_layers(
    x: torch.Tensor,
    layers: torch.Tensor,
    segments: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    heads: tuple[int, int, int],
    intermediate: int,
    window: int | None,
    scale: float,
    eps: float,
    isa: str,
) -> None:
    """With trtspec's kernel, every decoder layer over the rows x [T, H] (the embeddings; left holding the last
    residual stream, before the final norm), in one call: the norms, products, attention and activation that
    the framework's loop runs one by one, in the same order, each row's result its own alone. `layers` from
    `layer_table`, `segments` from `segment_table`, cos and sin [T, d] the rows' rotary tables; `isa` the
    instruction set of the layers' products."""
    hq, hkv, d = heads
    x, cos, sin = _f32_rows(x), _f32_rows(cos), _f32_rows(sin)
    _CPU.decoder(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        layers.data_ptr(),
        layers.shape[0],
        segments.data_ptr(),
        segments.shape[0],
        cos.data_ptr(),
        sin.data_ptr(),
        hq,
        hkv,
        d,
        intermediate,
        window or 0,
        scale,
        eps,
        torch.get_num_threads(),
        _ISA_CODE[isa],
    )


def _kv_format(cache: torch.Tensor) -> int:
    if cache.dtype not in KV_FORMATS or not cache.is_contiguous():
        raise ValueError(
            f"trtspec's attention kernel takes a contiguous KV cache of {', '.join(map(str, KV_FORMATS))}, "
            f"not {cache.dtype} of strides {cache.stride()}"
        )
    return KV_FORMATS[cache.dtype]


def _f32_rows(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(
            f"trtspec's CPU kernels take contiguous float32 tensors, not {t.dtype} of strides {t.stride()}"
        )
    return t


def prepack_available(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class DenseLinear:
    """y = x W^T + b with the framework's own product (CUDA, or a CPU without oneDNN)."""

    MIN_ROWS = 1

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias
        self.nbytes = weight.numel() * weight.element_size()
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear:
    """trtspec's own CPU product (`_cpu_kernels.c`): y = x W^T * scale + b for float32 rows x, on W packed once
    as [N/16][K][16]: float32 or bfloat16 as given, or FP8 E4M3 codes (`weight` of dtype float8_e4m3fn with
    its `scale`, per tensor or per output channel) kept as codes or as their exact bfloat16 values
    (`storage`, by default what `fp8_storage` measured fastest here). `isa`: one of ISAS, by default the
    widest this CPU has; every choice gives the same bits.

    `rows=torch.bfloat16` (bfloat16 or FP8 weights, where BF16_ROWS): the kernel rounds each row to bfloat16
    (nearest even) and multiplies pairs of k with vdpbf16ps, on W packed by pairs ([N/16][K/2][16][2], K
    padded to a multiple of 4; the codes of two pairs interleaved for the kernel's byte lookups), or, with
    `isa="amx"`, with AMX's tile products on the same packing. Other bits than float32 rows (and AMX others than
    vdpbf16ps), the same for every storage, and each row still one chain in a fixed order."""

    MIN_ROWS = 1
    BLOCK = 16

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        scale: torch.Tensor | None = None,
        storage: str | None = None,
        isa: str | None = None,
        rows: torch.dtype = torch.float32,
    ):
        n, k = weight.shape
        if rows not in (torch.float32, torch.bfloat16):
            raise ValueError(f"rows of {rows}: PackedLinear takes float32 or bfloat16 rows")
        if rows == torch.bfloat16 and not BF16_ROWS:
            raise ValueError(
                f"bfloat16 rows need the {BF16_ISA} instruction set (this CPU runs {', '.join(_RUNNABLE) or 'none'})"
            )
        if rows == torch.bfloat16 and weight.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise ValueError(f"bfloat16 rows go with bfloat16 or FP8 weights, not {weight.dtype}")
        if weight.dtype == torch.float8_e4m3fn:
            if scale is None:
                raise ValueError("an FP8 weight needs its scale")
            storage = storage or fp8_storage(rows)
            if storage not in FP8_STORAGES:
                raise ValueError(f"FP8 storage {storage!r}: choose one of {', '.join(FP8_STORAGES)}")
            weight = weight.view(torch.uint8) if storage == "e4m3" else weight.to(torch.bfloat16)  # both exact
        elif scale is not None:
            raise ValueError("a scale goes with FP8 weights only")
        elif weight.dtype != torch.bfloat16:
            weight = weight.float()
        choices = PAIR_ISAS if rows == torch.bfloat16 else ISAS
        self.isa = isa or choices[-1]
        if self.isa not in choices:
            raise ValueError(
                f"instruction set {self.isa!r} does not run {str(rows).removeprefix('torch.')} rows here (this CPU "
                f"runs {', '.join(choices) or 'none'} for them)"
            )
        blocks = -(-n // self.BLOCK)
        self.n, self.n_padded, self.k, self.rows = n, blocks * self.BLOCK, k, rows
        pairs = rows == torch.bfloat16
        kp = -(-k // 4) * 4 if pairs else k
        w = torch.zeros(self.n_padded, kp, dtype=weight.dtype)
        w[:n, :k] = weight
        if not pairs:
            self.packed = w.view(blocks, self.BLOCK, k).transpose(1, 2).contiguous()
        elif weight.dtype == torch.bfloat16:  # [block][pair][16 outputs][2]
            self.packed = w.view(blocks, self.BLOCK, kp // 2, 2).permute(0, 2, 1, 3).contiguous()
        else:
            # per block and 4 k: the 64 bytes as (output // 4, pair, output % 4, k % 2), which the kernel's byte
            # interleaves turn into the 16 outputs' two pairs, one vector each
            self.packed = w.view(blocks, 4, 4, kp // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).contiguous()
        self.format, code = _FORMATS[weight.dtype]
        code += 2 if pairs else 0  # the pair formats: 3 bfloat16, 4 E4M3
        self.scale = None if scale is None else self._padded(scale.float().reshape(-1).expand(n))
        self.bias = None if bias is None else self._padded(bias.float())
        self.nbytes = self.packed.numel() * self.packed.element_size()
        self.out_features = n
        # what the kernel reads of this product, as `linear` and a decoder layer table take it
        self.fields = (
            self.packed.data_ptr(),
            code,
            self.n_padded,
            0 if self.scale is None else self.scale.data_ptr(),
            0 if self.bias is None else self.bias.data_ptr(),
        )

    def move_to(self, packed: torch.Tensor) -> None:
        """Read the weights from `packed`, a copy of `self.packed` (hugepages.place's), from now on."""
        self.packed = packed
        self.fields = (packed.data_ptr(), *self.fields[1:])

    def _padded(self, values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.n_padded)
        out[: self.n] = values
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if x.dtype != torch.float32:
            raise TypeError(f"PackedLinear takes float32 rows, not {x.dtype}")
        m = x.shape[0]
        y = torch.empty(m, self.n_padded)
        _CPU.linear(x.data_ptr(), m, self.k, *self.fields, y.data_ptr(), torch.get_num_threads(), _ISA_CODE[self.isa])
        return y if self.n_padded == self.n else y[:, : self.n]


def on_huge_pages(linears: list[PackedLinear]) -> hugepages.Placement:
    """Move the linears' packed weights onto 2 MiB pages where the machine gives them (hugepages.place)."""
    placed, where = hugepages.place([lin.packed for lin in linears])
    for linear, tensor in zip(linears, placed):
        linear.move_to(tensor)
    return where


_fp8_storage: dict[torch.dtype, tuple[str, str]] = {}  # rows dtype -> (storage, why)


def fp8_storage(rows: torch.dtype = torch.float32) -> str:
    """How FP8 weights are kept for trtspec's CPU kernel on this machine, for products on `rows` of that dtype:
    "e4m3" (1 byte a weight, converted in the kernel) or "bf16" (2 bytes, used as they are, or widened with a
    shift). Which streams faster depends on the machine: the codes halve the bytes but cost more instructions
    per weight, which a core with little bandwidth to spare hides and one with much may not. Measured once per
    process on one-row and four-row products over weights larger than the last-level cache, unless
    $TRTSPEC_FP8_WEIGHTS names one."""
    if rows not in _fp8_storage:
        import os

        pinned = os.environ.get(FP8_STORAGE_ENV, "").strip()
        if pinned and pinned not in FP8_STORAGES:
            raise ValueError(f"${FP8_STORAGE_ENV}={pinned!r}: set it to one of {', '.join(FP8_STORAGES)}, or unset it")
        if pinned:
            _fp8_storage[rows] = pinned, f"pinned by ${FP8_STORAGE_ENV}"
        else:
            seconds = measure_fp8_storages(rows=rows)
            why = "measured: " + ", ".join(f"{name} {s * 1e12:.0f} ps" for name, s in seconds.items()) + " a weight"
            _fp8_storage[rows] = min(seconds, key=seconds.get), why
    return _fp8_storage[rows][0]


def fp8_storage_reason(rows: torch.dtype = torch.float32) -> str:
    """Why fp8_storage chose what it chose for such rows (after it has)."""
    return _fp8_storage.get(rows, ("", ""))[1]


def measure_fp8_storages(weights_mb: int = 48, reps: int = 3, *, rows: torch.dtype = torch.float32) -> dict[str, float]:
    """Seconds per weight of a one-row plus a four-row product on `rows`, for each FP8 storage, interleaved; the
    best of `reps`. The weights (`weights_mb` million, normal E4M3 values) outgrow a last-level cache of that
    size."""
    import time

    k = 1024
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0x08, 0x70, (weights_mb * 1024, k), dtype=torch.uint8, generator=gen)
    codes |= torch.randint(0, 2, codes.shape, dtype=torch.uint8, generator=gen) << 7
    weight, scale = codes.view(torch.float8_e4m3fn), torch.tensor(0.01)
    linears = {s: PackedLinear(weight, None, scale=scale, storage=s, rows=rows) for s in FP8_STORAGES}
    del codes, weight
    on_huge_pages(list(linears.values()))  # where a model's weights are kept
    x = torch.randn(4, k, generator=gen)
    best = dict.fromkeys(linears, float("inf"))
    for _ in range(reps):
        for name, linear in linears.items():
            t = time.perf_counter()
            linear(x[:1])
            linear(x)
            best[name] = min(best[name], time.perf_counter() - t)
    return {name: s / (weights_mb * 1024 * k) for name, s in best.items()}


class PrepackedLinear:
    """oneDNN product on a weight reordered once into its blocked layout (CPU)."""

    MIN_ROWS = 4

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        rows = 2  # the layout is chosen for a batch of this many rows; any row count works with it
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows)
        self.bias = bias
        self.nbytes = weight.numel() * weight.element_size()
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m < self.MIN_ROWS:
            # one row takes oneDNN's GEMV, which rounds differently; 2-3 rows stream the weight ~10% slower than 4
            x = torch.cat([x, x.new_zeros(self.MIN_ROWS - m, x.shape[1])])
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")[:m]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Fp8Linear:
    """A real FP8 product (`torch._scaled_mm`, SM89+ on CUDA): E4M3 weights with their ModelOpt scales, the
    activations quantized per token on the fly (amax / 448), the output in the compute dtype."""

    E4M3_MAX = 448.0

    def __init__(
        self, weight_fp8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
    ):
        self.weight_t = weight_fp8.t()  # [K, N], column-major as _scaled_mm wants its second operand
        n = weight_fp8.shape[0]
        # Per-token activation scales need per-channel weight scales ([1, N]); a per-tensor scale is broadcast.
        self.scale_b = scale.float().reshape(-1).expand(n).reshape(1, n).contiguous()
        self.bias, self.out_dtype = bias, out_dtype
        self.nbytes = weight_fp8.numel()
        self.out_features = n

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        n, k = weight.shape
        return n % 16 == 0 and k % 16 == 0  # _scaled_mm's shape rule

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
        scale_a = amax / self.E4M3_MAX
        xq = (x.float() / scale_a).clamp(-self.E4M3_MAX, self.E4M3_MAX).to(torch.float8_e4m3fn)
        # rowwise scaling produces bfloat16; other compute dtypes are converted after
        out = torch._scaled_mm(xq, self.weight_t, scale_a=scale_a, scale_b=self.scale_b, out_dtype=torch.bfloat16)
        out = out.to(self.out_dtype)
        return out + self.bias if self.bias is not None else out


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, *, kind: str, rows: torch.dtype = torch.float32):
    """`rows`: what a packed product rounds its rows to (PackedLinear); the other kinds take them as they come."""
    if kind == "packed":
        return PackedLinear(weight, bias, rows=rows)
    if kind == "prepacked":
        return PrepackedLinear(weight, bias)
    if kind == "dense":
        return DenseLinear(weight, bias)
    raise ValueError(f"unknown linear kind {kind!r}")


def attention_plan(
    positions: list[int], heads: tuple[int, int, int], window: int | None, dtype: torch.dtype, device: torch.device
) -> list[tuple]:
    """How `attend` splits one sequence's new rows (at ascending `positions`), computed once per forward pass:
    runs of rows with the same `attention_length`, each with its additive mask (-inf where a key may not be
    attended: after the row's position, or outside a sliding window) and a zeroed query buffer that every layer reuses
    (`heads` = (key heads, query heads per key head, head dim)). Padding rows attend to key 0 only, so their
    softmax stays finite."""
    hkv, groups, d = heads
    plan, start, n = [], 0, len(positions)
    while start < n:
        length = attention_length(positions[start])
        end = start
        while end < n and attention_length(positions[end]) == length:
            end += 1
        m = (end - start) * groups
        pos = torch.tensor(positions[start:end], device=device).repeat_interleave(groups)
        pos = torch.cat([pos, pos.new_zeros(max(m, MIN_GEMM_ROWS) - m)])
        key = torch.arange(length, device=device)
        blocked = key[None, :] > pos[:, None]
        if window is not None:
            blocked |= key[None, :] <= pos[:, None] - window
        mask = torch.zeros(blocked.shape, dtype=dtype, device=device).masked_fill_(blocked, float("-inf"))
        plan.append((start, end, length, mask, torch.zeros(hkv, blocked.shape[0], d, dtype=dtype, device=device)))
        start = end
    return plan


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: list[tuple], *, scale: float, groups: int
) -> torch.Tensor:
    """Causal attention of one sequence's new rows over its cached keys and values.

    q [n, Hq, d]; keys, values [Hkv, capacity, d], holding every position up to the last row's; `plan` from
    `attention_plan`; `groups` = Hq / Hkv query heads per key head. Returns [n, Hq * d]. Each run of rows is
    one product per key head, padded to at least MIN_GEMM_ROWS rows, over keys padded to the run's
    `attention_length`: a row's result depends on nothing but its own inputs.
    """
    n, hq, d = q.shape
    hkv = keys.shape[0]
    out = q.new_empty(n, hq, d)
    for start, end, length, mask, qg in plan:  # qg: [Hkv, >= MIN_GEMM_ROWS, d]
        rows = end - start
        m = rows * groups
        torch.mul(q[start:end].view(rows, hkv, groups, d).permute(1, 0, 2, 3).reshape(hkv, m, d), scale, out=qg[:, :m])
        scores = torch.baddbmm(mask, qg, keys[:, :length].transpose(1, 2))  # -inf where a key may not be seen
        probs = torch.softmax(scores, dim=-1)
        att = torch.bmm(probs, values[:, :length])[:, :m]  # [Hkv, rows*G, d]
        out[start:end] = att.view(hkv, rows, groups, d).permute(1, 0, 2, 3).reshape(rows, hq, d)
    return out.view(n, hq * d)
