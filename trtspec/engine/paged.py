"""The compact model with static shapes: the KV cache in blocks of one arena, and decode and verify passes
replayed as CUDA graphs.

Why: on a GPU the eager forward is launch-bound (every layer's small kernels launched from Python cost 17-34 ms a
step whatever the model's size, docs/notes/2026-11-24-h100.md). A CUDA graph replays a pass's kernels at once,
but it fixes every address and shape the pass read when it was captured. So here:

- each sequence's cache is a list of blocks of one arena allocated at load (`BlockArena`); a pass finds a
  sequence's keys through its block table, a device tensor like any other input;
- a decode or verify pass is laid out on a grid of S sequences x R rows (padded) attending over NB blocks of
  keys, with S, R and NB each rounded up to one of a few buckets (`Buckets`). On CUDA each bucket's pass is
  captured once at load and replayed from fixed input buffers that the host overwrites before each replay (token
  ids, positions, cache slots, block tables, wanted rows: one copy);
- any other pass (a prompt's prefill, a batch beyond the buckets) runs the same layers eagerly over its rows.

On a CPU the grid runs eagerly (`graphs=False`): the code a GPU captures is the code the tests compare with the
compact model's own forward. Padded rows and padded sequences write their keys into block 0, which no sequence
is given, and attend to position 0 only, so that their softmax stays finite.
"""

from __future__ import annotations

import gc
import math
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from trtspec.engine import kernels
from trtspec.engine.model import CompactModel, Segment, _rope
from trtspec.errors import EngineError

BLOCK = kernels.KEY_BLOCK  # positions per cache block: a cache's room is a whole number of them, as before
SCRATCH = 0  # the block that padded rows write to and padded keys read from
# rotary types whose table depends on the position alone (a "dynamic" one changes with the sequence's length)
STATIC_ROPE = {None, "default", "linear", "llama3", "yarn"}
# Share of the KV budget added to the arena for caches a finished call still holds for a moment (a Job keeps its
# lease until it is dropped): the budget is the KV pool's, the arena only has to hold what it admits.
ARENA_SLACK = 0.125


class PagedKV:
    """A sequence's cache: `blocks[b]` of the arena holds its positions b*BLOCK .. (b+1)*BLOCK-1."""

    __slots__ = ("blocks", "__weakref__")

    def __init__(self, blocks: list[int]):
        self.blocks = blocks


class BlockArena:
    """Every cache's keys and values, [layers, 2, blocks * BLOCK, Hkv, d], zeroed (masked keys must be finite).
    A cache's blocks go back when nothing refers to the cache any more."""

    def __init__(self, layers: int, hkv: int, head_dim: int, blocks: int, dtype: torch.dtype, device: torch.device):
        self.data = torch.zeros(layers, 2, (blocks + 1) * BLOCK, hkv, head_dim, dtype=dtype, device=device)
        self.blocks = blocks
        self._free = list(range(blocks, SCRATCH, -1))
        self._lock = threading.Lock()

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> PagedKV:
        for attempt in range(2):
            with self._lock:
                if len(self._free) >= n:
                    blocks = [self._free.pop() for _ in range(n)]
                    kv = PagedKV(blocks)
                    weakref.finalize(kv, self._release, blocks)
                    return kv
            if attempt == 0:
                gc.collect()  # caches that only a reference cycle still holds (outside the lock: finalizers take it)
        raise EngineError(
            f"the KV arena has {len(self._free)} free blocks of {BLOCK} positions, {n} are needed: the caches "
            "held exceed the KV budget; raise engine.kv_cache_mb"
        )

    def _release(self, blocks: list[int]) -> None:
        with self._lock:
            self._free.extend(blocks)


@dataclass(frozen=True)
class Buckets:
    """The grid shapes captured: sequences, rows per sequence, key blocks per sequence."""

    sequences: tuple[int, ...]
    rows: tuple[int, ...]
    key_blocks: tuple[int, ...]

    @classmethod
    def plan(cls, max_batch: int, max_rows: int, max_positions: int) -> Buckets:
        return cls(_doubling(1, max_batch), _doubling(1, max_rows), _doubling(4, math.ceil(max_positions / BLOCK)))

    def fit(self, segments: list[Segment]) -> tuple[int, int, int] | None:
        """The smallest (S, R, NB) that holds the pass, or None."""
        s = _first_at_least(self.sequences, len(segments))
        r = _first_at_least(self.rows, max(len(seg.ids) for seg in segments))
        nb = _first_at_least(self.key_blocks, max(-(-(seg.start + len(seg.ids)) // BLOCK) for seg in segments))
        return None if None in (s, r, nb) else (s, r, nb)

    def all(self) -> list[tuple[int, int, int]]:
        return [(s, r, nb) for s in self.sequences for r in self.rows for nb in self.key_blocks]


class PagedModel(CompactModel):
    """CompactModel's layers with the KV cache in a block arena and the grid passes described above. `reserve`
    (called by the engine once it knows its KV budget and limits) allocates the arena and captures the graphs."""

    def __init__(self, config, state, *, dtype, device, fp8_matmul=False, max_positions: int, graphs: bool):
        why = self.unsupported(config)
        if why:
            raise EngineError(why)
        super().__init__(config, state, dtype=dtype, device=device, fp8_matmul=fp8_matmul)
        if graphs and device.type != "cuda":
            raise EngineError("CUDA graphs need a CUDA device")
        self.graphs = graphs
        self.layer_table = None  # the layers run one by one here, whatever the CPU kernels cover
        positions = torch.arange(max_positions, device=device)[None]
        cos, sin = self.rotary(self.embed[:1], positions)
        half = self.head_dim // 2
        self.cos_table = cos[0].contiguous()
        self.sin_table = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1).contiguous()  # signed for _rope
        self.block_offsets = torch.arange(BLOCK, device=device)
        self.arena: BlockArena | None = None
        self.buckets: Buckets | None = None
        self._graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.graph_bytes = 0
        self.capture_seconds = 0.0

    @staticmethod
    def unsupported(config) -> str | None:
        """Why this architecture's configuration cannot run with static shapes, or None."""
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if rope.get("rope_type") not in STATIC_ROPE:
            return (
                f"rope_type {rope.get('rope_type')!r} depends on the sequence's length; the static-shape path needs "
                "one that depends on the position alone"
            )
        return None

    # ---- KV caches: blocks of the arena ----------------------------------------------------------------------
    def reserve(self, kv_budget_bytes: int, max_batch: int, max_rows: int) -> None:
        block_bytes = BLOCK * self.kv_bytes_per_token
        blocks = max(2, math.ceil(kv_budget_bytes * (1 + ARENA_SLACK) / block_bytes))
        self.arena = BlockArena(self.num_layers, self.hkv, self.head_dim, blocks, self.kv_dtype, self.device)
        self.buckets = Buckets.plan(max_batch, max_rows, self.cos_table.shape[0])
        s, r, nb = (b[-1] for b in (self.buckets.sequences, self.buckets.rows, self.buckets.key_blocks))
        # one buffer for every grid input (see _grid_layout), written by one copy per pass
        self._inputs = torch.zeros(5 * s * r + s * nb, dtype=torch.long, device=self.device)
        # float32 logits (the graph converts them), copied to a host buffer that every pass reuses: a fresh host
        # tensor per pass costs its page faults (docs/notes/2026-11-27-h200.md)
        self._logits = torch.zeros(s * r, self.vocab_size, dtype=torch.float32, device=self.device)
        # the host's side of both: pinned with graphs, so that the inputs' copy is asynchronous and the logits' fast
        self._host = torch.zeros_like(self._inputs, device="cpu")
        self._host_logits = self._logits if self.device.type == "cpu" else torch.zeros_like(self._logits, device="cpu")
        if self.graphs:
            self._host, self._host_logits = self._host.pin_memory(), self._host_logits.pin_memory()
            self._capture()

    def new_kv(self, tokens: int) -> PagedKV:
        return self.arena.allocate(self.kv_capacity(tokens) // BLOCK)

    def kv_room(self, kv: PagedKV) -> int:
        return len(kv.blocks) * BLOCK

    def kv_nbytes(self, kv: PagedKV) -> int:
        return len(kv.blocks) * BLOCK * self.kv_bytes_per_token

    def copy_kv(self, src: PagedKV, dst: PagedKV, tokens: int) -> None:
        n = -(-tokens // BLOCK)
        index = torch.tensor(src.blocks[:n], device=self.device)
        to = torch.tensor(dst.blocks[:n], device=self.device)
        data = self.arena.data.view(self.num_layers, 2, -1, BLOCK, self.hkv, self.head_dim)
        data[:, :, to] = data[:, :, index]

    # ---- passes ----------------------------------------------------------------------------------------------
    def forward(self, segments: list[Segment]) -> list[torch.Tensor]:
        """CompactModel.forward's logits, with one difference: a grid pass's are views of a buffer that the next
        pass overwrites, so whoever keeps logits past the step copies them (the scheduler's jobs do)."""
        shape = self.buckets.fit(segments)
        if shape is None:
            logits = self._ragged(segments).float().cpu()
        else:
            logits = self._grid(segments, shape)
        return list(logits.split([s.n_logits for s in segments]))

    def _grid(self, segments: list[Segment], shape: tuple[int, int, int]) -> torch.Tensor:
        """A pass laid out on its bucket's grid: replayed where captured, else run eagerly; [wanted rows, V]."""
        s, r, nb = shape
        total = 5 * s * r + s * nb
        host = self._host.numpy()  # filled with NumPy: a sixth of the host time of torch ops on small slices
        host[:total] = 0
        ids, pos, slots, rows, qpos, table = _grid_layout(host, s, r, nb)
        wanted = 0
        for i, seg in enumerate(segments):
            n, at = len(seg.ids), i * r
            ids[at : at + n] = seg.ids
            positions = np.arange(seg.start, seg.start + n)
            pos[at : at + n] = positions
            qpos[i, :n] = positions
            blocks = np.asarray(seg.kv.blocks[:nb])
            table[i, : len(blocks)] = blocks
            slots[at : at + n] = blocks[positions // BLOCK] * BLOCK + positions % BLOCK
            rows[wanted : wanted + seg.n_logits] = np.arange(at + n - seg.n_logits, at + n)
            wanted += seg.n_logits
        self._inputs[:total].copy_(self._host[:total], non_blocking=self.graphs)
        graph = self._graphs.get(shape)
        if graph is not None:
            graph.replay()
        else:
            self._grid_network(s, r, nb)
        return self.logits_to_host(wanted)

    def logits_to_host(self, rows: int) -> torch.Tensor:
        """The first `rows` rows of the pass's logits on the host: a view of a buffer the next pass overwrites."""
        if self._host_logits is not self._logits:
            self._host_logits[:rows].copy_(self._logits[:rows])
        return self._host_logits[:rows]

    def _grid_network(self, s: int, r: int, nb: int) -> None:
        """The network on the grid inputs in `_inputs`; the wanted rows' logits into `_logits` (device memory
        only, so that CUDA can capture it)."""
        ids, pos, slots, rows, qpos, table = _grid_layout(self._inputs, s, r, nb)
        keys, mask = self._visible(table, qpos)

        def attend(i, q):
            return self._attend(i, q.view(s, r, self.hq, self.head_dim), keys, mask).view(s * r, -1)

        logits = self._layers(ids, pos, slots, attend, rows)
        self._logits[: s * r].copy_(logits)

    def _ragged(self, segments: list[Segment]) -> torch.Tensor:
        """Any pass, eagerly: the rows of every segment one after another, each segment attending on its own."""
        ids, pos, slots, spans = [], [], [], []
        for seg in segments:
            positions = range(seg.start, seg.start + len(seg.ids))
            spans.append((len(ids), len(seg.ids), seg))
            ids += seg.ids
            pos += positions
            slots += [seg.kv.blocks[p // BLOCK] * BLOCK + p % BLOCK for p in positions]
        pad = max(0, self.head.MIN_ROWS - len(ids))  # as CompactModel.prepare: padded rows write to the scratch block
        dev = self.device
        ids_t = torch.tensor(ids + [0] * pad, device=dev)
        pos_t = torch.tensor(pos + [0] * pad, device=dev)
        slots_t = torch.tensor(slots + [SCRATCH] * pad, device=dev)
        visible = [
            (
                at,
                n,
                *self._visible(
                    torch.tensor([seg.kv.blocks[: -(-(seg.start + n) // BLOCK)]], device=dev), pos_t[at : at + n][None]
                ),
            )
            for at, n, seg in spans
        ]

        def attend(i, q):
            out = q.new_zeros(q.shape[0], self.hq * self.head_dim)
            for at, n, keys, mask in visible:
                out[at : at + n] = self._attend(i, q[at : at + n][None], keys, mask)[0]
            return out

        wanted = torch.tensor([at + n - j for at, n, seg in spans for j in range(seg.n_logits, 0, -1)], device=dev)
        return self._layers(ids_t, pos_t, slots_t, attend, wanted)

    # ---- the network -----------------------------------------------------------------------------------------
    def _layers(self, ids, pos, slots, attend, rows) -> torch.Tensor:
        """Embedding, every decoder layer (keys and values written at `slots`, then `attend(layer, q)`), the
        final norm and the head on `rows`; the same products as CompactModel.run."""
        x = F.embedding(ids, self.embed)
        cos, sin = self.cos_table[pos].unsqueeze(1), self.sin_table[pos].unsqueeze(1)
        h = self._norm(x, self.layers[0]["input_norm"])
        for i, layer in enumerate(self.layers):
            q, k, v = self._split_heads(layer, layer["qkv"](h))
            qk = _rope(torch.cat([q, k], 1), cos, sin)
            q, k = qk[:, : self.hq], qk[:, self.hq :]
            self.arena.data[i, 0].index_copy_(0, slots, k.to(self.kv_dtype))
            self.arena.data[i, 1].index_copy_(0, slots, v.to(self.kv_dtype))
            h = self._add_into_and_norm(x, layer["o"](attend(i, q.contiguous())), layer["post_norm"])
            gate, up = layer["gate_up"](h).chunk(2, dim=-1)
            mlp = layer["down"](F.silu(gate) * up)
            if i + 1 < len(self.layers):
                h = self._add_into_and_norm(x, mlp, self.layers[i + 1]["input_norm"])
        x = x + mlp
        return self._head(self._norm(x[rows], self.norm))

    def _visible(self, table: torch.Tensor, qpos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What every layer's attention reads of a pass (computed once, not per layer): the arena slots of each
        sequence's keys [S, M] for its blocks `table` [S, NB], and the additive mask [S, 1, G*R, M] that lets each row,
        at its position in `qpos` [S, R], see its sequence's positions up to its own (inside the window)."""
        s, r = qpos.shape
        slots = (table[:, :, None] * BLOCK + self.block_offsets).reshape(s, -1)
        key_pos = torch.arange(slots.shape[1], device=qpos.device)
        allowed = key_pos <= qpos[:, :, None]  # [S, R, M]
        if self.window is not None:
            allowed &= key_pos > qpos[:, :, None] - self.window
        allowed = allowed[:, None, None].expand(s, 1, self.groups, r, slots.shape[1]).reshape(s, 1, self.groups * r, -1)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=qpos.device).masked_fill_(~allowed, float("-inf"))
        return slots, mask

    def _attend(self, layer: int, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [S, R, Hq, d] of S sequences attending over their keys (`_visible`); [S, R, Hq*d]."""
        s, r = q.shape[:2]
        hkv, g, d = self.hkv, self.groups, self.head_dim
        keys = self.arena.data[layer, 0][slots].to(q.dtype).transpose(1, 2)  # [S, Hkv, M, d]
        values = self.arena.data[layer, 1][slots].to(q.dtype).transpose(1, 2)
        queries = q.view(s, r, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(s, hkv, g * r, d)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)
        return out.view(s, hkv, g, r, d).permute(0, 3, 1, 2, 4).reshape(s, r, hkv * g * d)

    # ---- CUDA graphs -----------------------------------------------------------------------------------------
    def _capture(self) -> None:
        """One graph per bucket, sharing one memory pool (they run one at a time, on one stream)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # as torch.cuda.graph does on entry: what stays reserved after is the graphs' pool
        began, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            self._inputs.zero_()
            for shape in self.buckets.all():
                self._grid_network(*shape)  # warm-up: kernels chosen and workspaces allocated outside capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._grid_network(*shape)
                self._graphs[shape] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.graph_bytes = torch.cuda.memory_reserved(self.device) - before
        self.capture_seconds = time.perf_counter() - began

    @property
    def kernel_summary(self) -> str:
        text = super().kernel_summary
        if self.graphs:
            mib, seconds = self.graph_bytes / 2**20, self.capture_seconds
            return text + f", {len(self._graphs)} CUDA graphs ({mib:.0f} MiB, captured in {seconds:.1f} s)"
        return text + ", static-shape passes run eagerly"


def _grid_layout(buf, s: int, r: int, nb: int):
    """(ids, positions, slots, wanted rows, row positions [S, R], block tables [S, NB]) as views of `buf` (a tensor
    or a NumPy array)."""
    n = s * r
    return (
        buf[:n],
        buf[n : 2 * n],
        buf[2 * n : 3 * n],
        buf[3 * n : 4 * n],
        buf[4 * n : 5 * n].reshape(s, r),
        buf[5 * n : 5 * n + s * nb].reshape(s, nb),
    )


def _doubling(first: int, last: int) -> tuple[int, ...]:
    """first, 2*first, ... below `last`, then `last` itself."""
    out, b = [], first
    while b < last:
        out.append(b)
        b *= 2
    return tuple(out + [last])


def _first_at_least(values: tuple[int, ...], n: int) -> int | None:
    return next((v for v in values if v >= n), None)
