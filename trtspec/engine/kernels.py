"""The embedded engine's matrix products, chosen so that a row's result never depends on the rows beside it.

Batch invariance is what makes greedy speculative output equal target-only output by construction: the
target's logits for a position must be bitwise the same whether that position is decoded alone, verified
with draft tokens after it, or computed in one pass with other requests' sequences. The products used here:
- `PackedLinear` (CPU, the default): trtspec's own kernel (`_cpu_kernels.c`, AVX2 + FMA, built at install), on
  weights packed once as [N/16][K][16] in float32 or bfloat16, with float32 activations. Each output is one
  multiply-add chain over K in order, whatever the number of rows, so rows are batch-invariant by
  construction; and it streams the weights at close to the machine's read bandwidth, which a decode step's
  few hundred small products need (oneDNN's float32 product reached half of it on a 2-core AVX2 machine, and
  a bfloat16 weight on a CPU without bfloat16 instructions took PyTorch's slow path).
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

MIN_GEMM_ROWS = 16       # query rows per attention product (see the module docstring)
KEY_BLOCK = 64           # a row attends over its keys padded to a multiple of this


def attention_length(position: int) -> int:
    """Keys a query at `position` (0-based) is computed over: its own position + 1, rounded up to KEY_BLOCK."""
    return -(-(position + 1) // KEY_BLOCK) * KEY_BLOCK


def _cpu_module():
    try:
        from trtspec.engine import _cpu_kernels
    except ImportError:  # built without a C compiler, or on a platform the kernels do not cover
        return None
    return _cpu_kernels if _cpu_kernels.available() else None


_CPU = _cpu_module()


def packed_available(device: torch.device) -> bool:
    """Whether trtspec's own CPU kernels run here (built at install, AVX2 + FMA)."""
    return device.type == "cpu" and _CPU is not None


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """With trtspec's kernel: x += residual (in place, when given), then the RMS norm of each row of x."""
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} does not match {tuple(x.shape)}")
    x, residual = _f32_rows(x), None if residual is None else _f32_rows(residual.contiguous())
    if _f32_rows(weight).shape != x.shape[1:]:
        raise ValueError(f"norm weight {tuple(weight.shape)} does not match rows of {x.shape[1]}")
    y = torch.empty_like(x)
    _CPU.rms_norm(x.data_ptr(), 0 if residual is None else residual.data_ptr(), x.shape[0], x.shape[1],
                  weight.data_ptr(), eps, y.data_ptr())
    return y


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: torch.Tensor, start: int, *, window: int | None, scale: float, out: torch.Tensor) -> None:
    """With trtspec's kernel, one sequence's new rows on one layer: q [n, Hq, d], k and v [n, Hkv, d] (rows
    may be strided views of one product), cos and sin [n, d] (the rows' rotary tables); rotates the queries and
    keys, writes keys and values at positions start.. of `cache` [2, Hkv, capacity, d], and writes each row's
    causal attention over positions 0..its own into `out` [n, Hq * d]."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    for t in (q, k, v):
        if t.dtype != torch.float32 or t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError("attend_rows takes float32 rows of contiguous heads")
    cache, cos, sin = _f32_rows(cache), _f32_rows(cos), _f32_rows(sin)
    if out.stride(0) != hq * d or not out.is_contiguous():
        raise ValueError("attend_rows writes into contiguous rows")
    _CPU.attention(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), n, hq, hkv, d,
                   cos.data_ptr(), sin.data_ptr(), cache.data_ptr(), cache.shape[2], start, window or 0, scale,
                   out.data_ptr(), out.stride(0), torch.get_num_threads())


def _f32_rows(t: torch.Tensor) -> torch.Tensor:
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(f"trtspec's CPU kernels take contiguous float32 tensors, not {t.dtype} of strides {t.stride()}")
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
    """trtspec's own CPU product (`_cpu_kernels.c`): y = x W^T + b for float32 rows x, on W packed once as
    [N/16][K][16] in float32, or in bfloat16 when it was given in bfloat16 (half the bytes to read, widened
    exactly in the kernel)."""

    MIN_ROWS = 1
    BLOCK = 16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        n, k = weight.shape
        store = torch.bfloat16 if weight.dtype == torch.bfloat16 else torch.float32
        blocks = -(-n // self.BLOCK)
        w = torch.zeros(blocks * self.BLOCK, k, dtype=store)
        w[:n] = weight
        self.packed = w.view(blocks, self.BLOCK, k).transpose(1, 2).contiguous()
        self.bias = None
        if bias is not None:
            self.bias = torch.zeros(blocks * self.BLOCK)
            self.bias[:n] = bias
        self.bf16 = int(store == torch.bfloat16)
        self.n, self.n_padded, self.k = n, blocks * self.BLOCK, k
        self.nbytes = self.packed.numel() * self.packed.element_size()
        self.out_features = n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if x.dtype != torch.float32:
            raise TypeError(f"PackedLinear takes float32 rows, not {x.dtype}")
        m = x.shape[0]
        y = torch.empty(m, self.n_padded)
        _CPU.linear(x.data_ptr(), m, self.k, self.packed.data_ptr(), self.bf16, self.n_padded,
                    0 if self.bias is None else self.bias.data_ptr(), y.data_ptr(), torch.get_num_threads())
        return y if self.n_padded == self.n else y[:, : self.n]


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

    def __init__(self, weight_fp8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype):
        self.weight_t = weight_fp8.t()               # [K, N], column-major as _scaled_mm wants its second operand
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


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, *, kind: str):
    if kind == "packed":
        return PackedLinear(weight, bias)
    if kind == "prepacked":
        return PrepackedLinear(weight, bias)
    if kind == "dense":
        return DenseLinear(weight, bias)
    raise ValueError(f"unknown linear kind {kind!r}")


def attention_plan(positions: list[int], heads: tuple[int, int, int], window: int | None, dtype: torch.dtype,
                   device: torch.device) -> list[tuple]:
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


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: list[tuple], *,
           scale: float, groups: int) -> torch.Tensor:
    """Causal attention of one sequence's new rows over its cached keys and values.

    q [n, Hq, d]; keys, values [Hkv, capacity, d], holding every position up to the last row's; `plan` from
    `attention_plan`; `groups` = Hq / Hkv query heads per key head. Returns [n, Hq * d]. Each run of rows is
    one product per key head, padded to at least MIN_GEMM_ROWS rows, over keys padded to the run's
    `attention_length`: a row's result depends on nothing but its own inputs.
    """
    n, hq, d = q.shape
    hkv = keys.shape[0]
    out = q.new_empty(n, hq, d)
    for start, end, length, mask, qg in plan:                           # qg: [Hkv, >= MIN_GEMM_ROWS, d]
        rows = end - start
        m = rows * groups
        torch.mul(q[start:end].view(rows, hkv, groups, d).permute(1, 0, 2, 3).reshape(hkv, m, d), scale, out=qg[:, :m])
        scores = torch.baddbmm(mask, qg, keys[:, :length].transpose(1, 2))   # -inf where a key may not be seen
        probs = torch.softmax(scores, dim=-1)
        att = torch.bmm(probs, values[:, :length])[:, :m]                # [Hkv, rows*G, d]
        out[start:end] = att.view(hkv, rows, groups, d).permute(1, 0, 2, 3).reshape(rows, hq, d)
    return out.view(n, hq * d)
