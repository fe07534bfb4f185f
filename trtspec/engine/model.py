"""The networks the embedded engine runs: a compact forward over a ragged batch, and Hugging Face's own.

`CompactModel` is the engine's forward for the decoder-only architectures trtspec builds (Llama, Mistral,
Qwen2, Qwen3): one flat list of rows, the new tokens of every sequence in the batch one after another, goes
through each linear once (weights are read once per step whatever the batch), and each sequence attends over
its own KV cache. Why not the Hugging Face modules with faster linears: their attention pads a batch to a
common length and computes each pass's rows in one shape-dependent product, so logits of a sequence change
with what else is in the batch; and their per-call overhead (masks, cache objects, module hooks) is a large
part of a 20 ms CPU step. The rotary embedding is still the architecture's own Hugging Face class, so every
RoPE variant (Llama 3 scaling, YaRN, ...) means what transformers means by it.

`HFModel` runs the transformers model itself, one sequence at a time: the reference the compact forward is
tested against, and the eager forward `benchmarks/engine_speed.py` measures beside it.

Both take `Segment`s and keep their KV in objects only they read (`new_kv`, `copy_kv` or `adopt_prefix`,
`kv_nbytes`), which trtspec.engine.kv manages.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trtspec.engine import fp8, kernels, subset_head
from trtspec.errors import EngineError

COMPACT_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class Segment:
    """One sequence's part of a forward pass: `ids` at positions start.. start+len(ids)-1, on top of a KV cache
    that already holds positions 0..start-1; logits are wanted for the last `n_logits` of them."""

    ids: list[int]
    start: int
    kv: object
    n_logits: int


@dataclass
class DecoderInputs:
    """What trtspec's decoder kernel (kernels.decoder_layers) reads of a pass besides its rows."""

    segments: torch.Tensor  # kernels.segment_table of the pass's sequences
    cos: torch.Tensor  # [T, d] the rows' rotary tables
    sin: torch.Tensor


@dataclass
class Prepared:
    """A pass's device-side inputs (CompactModel.prepare): token ids, the attention over the caches, and which
    rows' logits are wanted."""

    ids: torch.Tensor
    attend: object  # per layer (framework loop), or None
    rows: torch.Tensor
    decoder: DecoderInputs | None = None  # every layer in one kernel call, or None


class CompactModel:
    """Decoder-only transformer forward over ragged batches; weights prepacked once (see kernels.py)."""

    def __init__(
        self,
        config,
        state: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device,
        fp8_matmul: bool = False,
    ):
        arch = (getattr(config, "architectures", None) or [""])[0]
        if arch not in COMPACT_ARCHITECTURES:
            raise EngineError(f"the compact forward covers {', '.join(COMPACT_ARCHITECTURES)}, not {arch}")
        self.kind = COMPACT_ARCHITECTURES[arch]
        self.config, self.device = config, device
        self.weight_dtype = dtype  # the linears' weights, as built
        if kernels.packed_available(device):
            # trtspec's CPU kernel reads float32 or bfloat16 weights and computes in float32 (exact widening)
            self.linear_kind, self.dtype = "packed", torch.float32
        else:
            self.linear_kind = "prepacked" if kernels.prepack_available(dtype, device) else "dense"
            self.dtype = dtype
        self.num_layers = config.num_hidden_layers
        self.hq = config.num_attention_heads
        self.hkv = getattr(config, "num_key_value_heads", None) or self.hq
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.hq
        self.groups = self.hq // self.hkv
        self.scale = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.window = _sliding_window(config)
        if config.hidden_act != "silu":
            raise EngineError(f"hidden_act {config.hidden_act!r} is not supported by the compact forward (silu only)")
        self.fp8_matmul = fp8_matmul
        # the kernels' norm and attention take rows of 8-float vectors
        self.fused = self.linear_kind == "packed" and config.hidden_size % 8 == 0 and self.head_dim % 8 == 0
        # the KV cache in the configured dtype where the attention kernel reads it (half the bytes of float32, so
        # twice the tokens in the same budget); float32 compute either way
        self.kv_dtype = dtype if self.fused and dtype in kernels.KV_FORMATS else self.dtype
        # a bfloat16 model's products take their rows in bfloat16 where the CPU multiplies bfloat16 pairs, as the
        # model's GEMMs do on a GPU (TensorRT-LLM's and transformers'); accumulation stays float32
        packed_bf16 = self.linear_kind == "packed" and dtype == torch.bfloat16 and kernels.BF16_ROWS
        self.rows_dtype = torch.bfloat16 if packed_bf16 else torch.float32
        self._load(state)
        self.rotary = _rotary(config, device)
        self.layer_table = self._layer_table()

    # ---- weights ----------------------------------------------------------------------------------------------
    def _tensor(self, state, name):
        return state[name].to(self.device, self.dtype)

    def _linear(self, state, names: list[str], bias: bool):
        """One product for several projections that read the same input (q/k/v, gate/up), stacked by rows."""
        biases = [state.get(n.removesuffix(".weight") + ".bias") for n in names] if bias else []
        b = (
            torch.cat([x.to(self.device, self.dtype) for x in biases])
            if biases and all(x is not None for x in biases)
            else None
        )
        if self.fp8_matmul and all(state[n].dtype == fp8.FP8_DTYPE for n in names):
            w8 = torch.cat([state[n] for n in names]).to(self.device)
            scale = self._row_scales(state, names).to(self.device)
            if kernels.Fp8Linear.supported(w8):
                return kernels.Fp8Linear(w8, scale, b, self.dtype)
        if self.linear_kind == "packed" and all(state[n].dtype == fp8.FP8_DTYPE for n in names):
            # trtspec's CPU kernel reads the E4M3 codes themselves and scales its outputs
            w8, scale = torch.cat([state[n] for n in names]), self._row_scales(state, names)
            return kernels.PackedLinear(w8, b, scale=scale, rows=self.rows_dtype)
        w = torch.cat([_dequantized(state, n, self.weight_dtype) for n in names]).to(self.device)
        return kernels.make_linear(w, b, kind=self.linear_kind, rows=self.rows_dtype)

    @staticmethod
    def _row_scales(state, names: list[str]) -> torch.Tensor:
        """One dequantization scale per output row of the stacked FP8 weights (per tensor or per channel)."""
        scales = [state[n.removesuffix(".weight") + fp8.SCALE_SUFFIX].float().reshape(-1) for n in names]
        return torch.cat([s.expand(state[n].shape[0]) for s, n in zip(scales, names)])

    def _load(self, state: dict[str, torch.Tensor]) -> None:
        need = ["model.embed_tokens.weight", "model.norm.weight"]
        missing = [n for n in need if n not in state]
        if missing:
            raise EngineError(f"weights lack {missing}")
        self.embed = _dequantized(state, "model.embed_tokens.weight", self.dtype).to(self.device)
        self.norm = self._tensor(state, "model.norm.weight")
        qkv_bias = self.kind == "qwen2" or bool(getattr(self.config, "attention_bias", False))
        self.layers = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            layer = {
                "input_norm": self._tensor(state, p + "input_layernorm.weight"),
                "post_norm": self._tensor(state, p + "post_attention_layernorm.weight"),
                "qkv": self._linear(state, [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"], qkv_bias),
                "o": self._linear(state, [a + "o_proj.weight"], bool(getattr(self.config, "attention_bias", False))),
                "gate_up": self._linear(state, [m + "gate_proj.weight", m + "up_proj.weight"], False),
                "down": self._linear(state, [m + "down_proj.weight"], False),
            }
            if self.kind == "qwen3":
                layer["q_norm"] = self._tensor(state, a + "q_norm.weight")
                layer["k_norm"] = self._tensor(state, a + "k_norm.weight")
            self.layers.append(layer)
        self.head_ids = None
        self.head = self._linear(state, [_head_name(self.config, state)], False)
        if subset_head.head_tokens(self.config):
            self.head_ids = state["lm_head.token_ids"].to(self.device)
        self.vocab_size = self.config.vocab_size
        self.placement = kernels.on_huge_pages(self._packed_linears(head=True))

    def _packed_linears(self, head: bool = False) -> list:
        """The products on trtspec's CPU kernels, the output head's too where `head`."""
        linears = [lin for layer in self.layers for lin in layer.values() if isinstance(lin, kernels.PackedLinear)]
        return linears + [self.head] if head and isinstance(self.head, kernels.PackedLinear) else linears

    def _layer_table(self) -> torch.Tensor | None:
        """What trtspec's decoder kernel reads of each layer (kernels.decoder_layers), when it covers this model:
        trtspec's CPU kernels, no per-head norms (Qwen3), and every product's width a whole number of blocks."""
        if not self.fused or "q_norm" in self.layers[0]:
            return None
        linears = [layer[key] for layer in self.layers for key in kernels.DECODER_LINEARS]
        if not all(isinstance(lin, kernels.PackedLinear) and lin.n == lin.n_padded for lin in linears):
            return None
        return kernels.layer_table(self.layers)

    @property
    def kernel_summary(self) -> str:
        """The products this model runs on, for the engine's log line."""
        if self.linear_kind != "packed":
            return self.linear_kind
        linears = self._packed_linears()
        formats = {lin.format for lin in linears}
        isa, rows = linears[0].isa, str(self.rows_dtype).removeprefix("torch.")
        text = f"packed ({isa}, {rows} rows), layer weights {'/'.join(sorted(formats))}, head {self.head.format}"
        if any(lin.scale is not None for lin in linears):
            storage, why = kernels.fp8_storage(self.rows_dtype), kernels.fp8_storage_reason(self.rows_dtype)
            text += f" (FP8 kept as {storage}: {why})"
        text += f", KV cache {str(self.kv_dtype).removeprefix('torch.')}, {self.placement.summary()}"
        return text + (", all decoder layers in one kernel call" if self.layer_table is not None else "")

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every linear and the output head (not the embedding table,
        of which a step reads one row per token)."""
        linears = [lin for layer in self.layers for key, lin in layer.items() if hasattr(lin, "nbytes")]
        norms = sum(
            t.numel() * t.element_size()
            for layer in self.layers
            for key, t in layer.items()
            if isinstance(t, torch.Tensor)
        )
        return sum(lin.nbytes for lin in linears) + self.head.nbytes + norms

    # ---- KV caches ----------------------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.hkv * self.head_dim * self.kv_dtype.itemsize

    def kv_capacity(self, tokens: int) -> int:
        return kernels.attention_length(max(tokens, 1) - 1)

    def new_kv(self, tokens: int) -> torch.Tensor:
        """A cache with room for `tokens` positions (rounded up to the attention's key block), zeroed: the
        attention reads whole key blocks, and a masked key must hold a finite value."""
        return torch.zeros(
            self.num_layers,
            2,
            self.hkv,
            self.kv_capacity(tokens),
            self.head_dim,
            dtype=self.kv_dtype,
            device=self.device,
        )

    def kv_room(self, kv: torch.Tensor) -> int:
        return kv.shape[3]

    def kv_nbytes(self, kv: torch.Tensor) -> int:
        return kv.numel() * kv.element_size()

    def copy_kv(self, src: torch.Tensor, dst: torch.Tensor, tokens: int) -> None:
        dst[:, :, :, :tokens] = src[:, :, :, :tokens]

    def crop_kv(self, kv: torch.Tensor, tokens: int) -> None:
        """Positions from `tokens` on are stale; nothing to do, as every read masks keys beyond its position."""

    # ---- forward ------------------------------------------------------------------------------------------------
    def forward(self, segments: list[Segment]) -> list[torch.Tensor]:
        """Run every segment's rows; returns each segment's logits [n_logits, V] in float32."""
        # sampling and the contract's outputs work on the CPU: one transfer per step on a GPU
        logits = self.run(self.prepare(segments)).float().cpu()
        return list(logits.split([s.n_logits for s in segments]))

    def prepare(self, segments: list[Segment]) -> Prepared:
        """Everything a pass needs that comes from the host (token ids, positions, attention plans), on the
        device; `run` then reads device memory only, so that a GPU can capture it as one CUDA graph."""
        # fewer rows than a product's minimum are padded once here rather than in every product: the extra rows
        # (token 0 at position 0) go through the linears only, never through attention, a cache or the head
        flat = [t for s in segments for t in s.ids]
        pad = max(0, self.head.MIN_ROWS - len(flat))
        ids = torch.tensor(flat + [0] * pad, dtype=torch.long, device=self.device)
        positions = [s.start + i for s in segments for i in range(len(s.ids))] + [0] * pad
        cos, sin = self.rotary(self.embed[:1], torch.tensor([positions], device=self.device))
        offsets, at = [], 0
        for s in segments:
            offsets.append(at)
            at += len(s.ids)
        rows = torch.tensor(
            [off + len(s.ids) - j for s, off in zip(segments, offsets) for j in range(s.n_logits, 0, -1)],
            device=self.device,
        )
        if self.layer_table is not None and not pad:
            table = kernels.segment_table([(off, len(s.ids), s.start, s.kv) for s, off in zip(segments, offsets)])
            return Prepared(ids, None, rows, DecoderInputs(table, cos[0].contiguous(), sin[0].contiguous()))
        attend = (self._fused_attention if self.fused else self._torch_attention)(
            segments, offsets, cos[0], sin[0], at + pad
        )
        return Prepared(ids, attend, rows)

    def run(self, p: Prepared) -> torch.Tensor:
        """The network on a prepared pass: the logits of the wanted rows, [rows, V], on the device."""
        x = F.embedding(p.ids, self.embed)  # the residual stream
        if p.decoder is not None:  # every layer in one call of trtspec's kernel, in place on x
            kernels.decoder_layers(
                x,
                self.layer_table,
                p.decoder.segments,
                p.decoder.cos,
                p.decoder.sin,
                heads=(self.hq, self.hkv, self.head_dim),
                intermediate=self.config.intermediate_size,
                window=self.window,
                scale=self.scale,
                eps=self.eps,
                isa=self.layers[0]["qkv"].isa,
            )
            return self._head(self._norm(x[p.rows], self.norm))
        h = self._norm(x, self.layers[0]["input_norm"])
        for i, layer in enumerate(self.layers):
            attention = layer["o"](p.attend(i, layer, layer["qkv"](h)))
            h = self._add_into_and_norm(x, attention, layer["post_norm"])  # x += attention, in place
            gate, up = layer["gate_up"](h).chunk(2, dim=-1)
            mlp = layer["down"](F.silu(gate) * up)
            if i + 1 < len(self.layers):  # the last layer's MLP output is added below, outside the loop
                h = self._add_into_and_norm(x, mlp, self.layers[i + 1]["input_norm"])  # x += mlp, in place
        x = x + mlp
        return self._head(self._norm(x[p.rows], self.norm))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The RMS norm of x's rows."""
        if self.fused:
            return kernels.rms_norm_rows(x, weight, self.eps)
        return _rms_norm(x, weight, self.eps)

    def _add_into_and_norm(self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """residual += delta, IN PLACE (the residual stream goes on in the same tensor: no copy per layer), then the
        RMS norm of its rows; trtspec's kernel does both in one pass over the rows."""
        if self.fused:
            return kernels.rms_norm_rows(residual, weight, self.eps, delta)
        residual.add_(delta)
        return _rms_norm(residual, weight, self.eps)

    def _split_heads(self, layer: dict, qkv: torch.Tensor):
        """q [T, Hq, d], k and v [T, Hkv, d] of one layer's q/k/v product (Qwen3 normalises q and k per head)."""
        d, hq, hkv = self.head_dim, self.hq, self.hkv
        t = qkv.shape[0]
        q = qkv[:, : hq * d].view(t, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        if "q_norm" in layer:
            q, k = _rms_norm(q, layer["q_norm"], self.eps), _rms_norm(k, layer["k_norm"], self.eps)
        return q, k, v

    def _fused_attention(self, segments, offsets, cos, sin, total):
        """Attention through trtspec's CPU kernel: rotary embedding, cache writes and attention in one call per
        sequence and layer; a row's result depends on its own inputs alone (see _cpu_kernels.c)."""
        cos, sin = cos.contiguous(), sin.contiguous()

        def attend(i: int, layer: dict, qkv: torch.Tensor) -> torch.Tensor:
            q, k, v = self._split_heads(layer, qkv)
            att = qkv.new_zeros(total, self.hq * self.head_dim)
            for s, off in zip(segments, offsets):
                n = len(s.ids)
                kernels.attend_rows(
                    q[off : off + n],
                    k[off : off + n],
                    v[off : off + n],
                    cos[off : off + n],
                    sin[off : off + n],
                    s.kv[i],
                    s.start,
                    window=self.window,
                    scale=self.scale,
                    out=att[off : off + n],
                    isa=getattr(layer["qkv"], "isa", None),
                )
            return att

        return attend

    def _torch_attention(self, segments, offsets, cos, sin, total):
        """Attention as framework operations (CUDA, or a CPU without trtspec's kernels), with the shapes of
        kernels.attention_plan so that a row's result depends on its own inputs alone on a CPU."""
        half = self.head_dim // 2
        cos = cos.unsqueeze(1)  # [T, 1, d]
        sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1).unsqueeze(1)  # signed for _rope
        heads = (self.hkv, self.groups, self.head_dim)
        plans = [
            kernels.attention_plan(
                list(range(s.start, s.start + len(s.ids))), heads, self.window, self.dtype, self.device
            )
            for s in segments
        ]

        def attend(i: int, layer: dict, qkv: torch.Tensor) -> torch.Tensor:
            q, k, v = self._split_heads(layer, qkv)
            qk = _rope(torch.cat([q, k], 1), cos, sin)  # queries and keys rotated together: one op each
            q, k = qk[:, : self.hq], qk[:, self.hq :]
            att = qkv.new_zeros(total, self.hq * self.head_dim)
            for s, off, plan in zip(segments, offsets, plans):
                n = len(s.ids)
                cache = s.kv[i]  # [2, Hkv, capacity, d]
                cache[0, :, s.start : s.start + n] = k[off : off + n].transpose(0, 1)
                cache[1, :, s.start : s.start + n] = v[off : off + n].transpose(0, 1)
                att[off : off + n] = kernels.attend(
                    q[off : off + n], cache[0], cache[1], plan, scale=self.scale, groups=self.groups
                )
            return att

        return attend

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.head(h)
        if self.head_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.head_ids, logits)


class HFModel:
    """The transformers model run as it is, one segment at a time (each on its own DynamicCache)."""

    def __init__(self, model, device: torch.device):
        self.model, self.device = model, device
        cfg = model.config
        self.vocab_size = cfg.vocab_size
        heads = cfg.num_attention_heads
        hkv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        elem = next(model.parameters()).element_size()
        self.kv_bytes_per_token = cfg.num_hidden_layers * 2 * hkv * head_dim * elem
        self.linear_kind = self.kernel_summary = "hf-eager"

    @property
    def weight_bytes(self) -> int:
        emb = self.model.get_input_embeddings().weight
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) - (
            0 if self.model.config.tie_word_embeddings else emb.numel() * emb.element_size()
        )

    def kv_capacity(self, tokens: int) -> int:
        return tokens

    def new_kv(self, tokens: int):
        from transformers import DynamicCache

        return DynamicCache()

    def kv_room(self, kv) -> int:
        return 1 << 62  # grows as needed

    def kv_nbytes(self, kv) -> int:
        return kv.get_seq_length() * self.kv_bytes_per_token

    def adopt_prefix(self, src, tokens: int):
        kv = copy.deepcopy(src)
        self.crop_kv(kv, tokens)
        return kv

    def crop_kv(self, kv, tokens: int) -> None:
        remove = kv.get_seq_length() - tokens
        if remove > 0:
            kv.crop(-remove)

    def forward(self, segments: list[Segment]) -> list[torch.Tensor]:
        out = []
        for s in segments:
            self.crop_kv(s.kv, s.start)
            ids = torch.tensor([s.ids], dtype=torch.long, device=self.device)
            res = self.model(input_ids=ids, past_key_values=s.kv, use_cache=True, logits_to_keep=s.n_logits)
            out.append(res.logits[0].float().cpu())
        return out


def _head_name(config, state) -> str:
    """The output head's weight: lm_head's own, unless the head is tied to the embedding and stored as it; a head
    quantized to FP8 (quantize_lm_head) is stored apart from the embedding it was tied to."""
    head = state.get(fp8.HEAD)
    if head is None:
        return fp8.EMBEDDING
    if head.dtype == fp8.FP8_DTYPE or subset_head.head_tokens(config):
        return fp8.HEAD
    return fp8.EMBEDDING if getattr(config, "tie_word_embeddings", False) else fp8.HEAD


def _dequantized(state, name: str, dtype: torch.dtype) -> torch.Tensor:
    t = state[name]
    if t.dtype == fp8.FP8_DTYPE:
        scale = state.get(name.removesuffix(".weight") + fp8.SCALE_SUFFIX)
        if scale is None:
            raise EngineError(f"{name} is FP8 but its scale is missing")
        return fp8.dequantize(t, scale, dtype)
    return t.to(dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # as transformers' LlamaRMSNorm: the mean of squares in float32, the scale applied in the input's dtype
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1] written as flip-halves(x) * [-sin1, sin2]."""
    t, h, d = x.shape
    swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)
    return x * cos + swapped * signed_sin


def _rotary(config, device: torch.device):
    """The architecture's own rotary embedding module: (x, position_ids [1, T]) -> (cos, sin) [1, T, d]."""
    kind = COMPACT_ARCHITECTURES[config.architectures[0]]
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    cls = getattr(module, config.architectures[0].removesuffix("ForCausalLM") + "RotaryEmbedding")
    return cls(config=config).to(device)


def _sliding_window(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    kind = COMPACT_ARCHITECTURES[config.architectures[0]]
    if kind in ("qwen2", "qwen3"):
        # Qwen carries a window it uses only with use_sliding_window, and then only from max_window_layers on
        if getattr(config, "use_sliding_window", False):
            raise EngineError("use_sliding_window: true (Qwen) is not supported by the embedded engine")
        return None
    return int(window)
