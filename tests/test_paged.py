"""The static-shape path (trtspec.engine.paged) on the CPU: the code a GPU captures as CUDA graphs, run eagerly and
compared with the compact model's own forward, for each architecture; the engine on it; the block arena."""

from __future__ import annotations

import gc

import pytest
import torch
from test_engine_batching import ARCHITECTURES, MAX_DRAFT_LEN, _hf_model, _ids, _mixed_requests

from trtspec.contract import GenerationRequest
from trtspec.engine.model import CompactModel, Segment
from trtspec.engine.paged import BLOCK, BlockArena, Buckets, PagedModel
from trtspec.engine.runtime import Engine
from trtspec.errors import EngineError

CPU = torch.device("cpu")


def _pair(kind: str):
    hf = _hf_model(kind)
    state = {k: v.float() for k, v in hf.state_dict().items()}
    compact = CompactModel(hf.config, state, dtype=torch.float32, device=CPU)
    paged = PagedModel(hf.config, state, dtype=torch.float32, device=CPU, max_positions=512, graphs=False)
    paged.reserve(64 * 2**20, max_batch=4, max_rows=MAX_DRAFT_LEN + 1)
    return compact, paged


STEPS = [  # after the prefills: one row each; a verify pass of max_draft_len + 1 rows beside one-row steps; two
    [(0, 1), (1, 1), (2, 1)],  # sequences, padded to the bucket of 2; one sequence of 4 rows
    [(0, MAX_DRAFT_LEN + 1), (1, 1), (2, 3)],
    [(0, 1), (2, 2)],
    [(1, 4)],
]


def passes(model, steps=STEPS) -> list[torch.Tensor]:
    """Prefills of three sequences of different lengths (one ragged pass, past the row buckets; 130 tokens cross two
    key blocks and, for mistral, the window), then the passes `steps` [(sequence, rows), ...]: every pass's logits."""
    prompts = [_ids(70, 1), _ids(9, 2), _ids(130, 3)]
    kvs = [model.new_kv(200) for _ in prompts]
    seen = [len(p) for p in prompts]
    with torch.inference_mode():
        out = [x.clone() for x in model.forward([Segment(p, 0, kv, 2) for p, kv in zip(prompts, kvs)])]
        for n, step in enumerate(steps):
            rows = {i: _ids(k, 100 + 10 * n + i) for i, k in step}
            out += [x.clone() for x in model.forward([Segment(rows[i], seen[i], kvs[i], k) for i, k in step])]
            for i, k in step:
                seen[i] += k
    return out


@pytest.mark.parametrize("kind", sorted(ARCHITECTURES))
def test_static_shape_passes_give_the_compact_forward_s_logits(kind):
    """float32 on both: the attention sums in another order only."""
    compact, paged = _pair(kind)
    assert paged.buckets.fit([Segment([0] * 70, 0, None, 1)]) is None  # the prefill runs ragged
    for a, b in zip(passes(compact), passes(paged), strict=True):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_buckets_cover_the_engine_s_limits_and_nothing_beyond():
    b = Buckets.plan(max_batch=6, max_rows=9, max_positions=2057)
    assert b.sequences == (1, 2, 4, 6) and b.rows == (1, 2, 4, 8, 9) and b.key_blocks == (4, 8, 16, 32, 33)
    seg = lambda n, start: Segment([0] * n, start, None, 1)  # noqa: E731
    assert b.fit([seg(1, 0)]) == (1, 1, 4)
    assert b.fit([seg(1, 300), seg(5, 10), seg(1, 0)]) == (4, 8, 8)  # 301 positions: 5 blocks, in the bucket of 8
    assert b.fit([seg(10, 0)]) is None  # more rows than a verify pass has
    assert b.fit([seg(1, 0)] * 7) is None  # more sequences than the engine batches


def test_the_arena_gives_blocks_back_when_a_cache_is_dropped_and_names_the_budget_when_full():
    arena = BlockArena(layers=1, hkv=1, head_dim=8, blocks=4, dtype=torch.float32, device=CPU)
    a = arena.allocate(3)
    assert 0 not in a.blocks and arena.free_blocks == 1  # block 0 is the scratch block, never given
    with pytest.raises(EngineError, match="kv_cache_mb"):
        arena.allocate(2)
    del a
    gc.collect()
    assert arena.free_blocks == 4
    assert len(arena.allocate(4).blocks) == 4


def test_a_copied_prefix_reads_as_the_original(built_fp8):
    """KVPool copies a kept cache's prefix into a larger one (a sequence that outgrew its cache): block by block."""
    engine = Engine.load(built_fp8.target, static=True, check_invariance=False)
    m = engine.model
    ids = _ids(100, 5, engine.info.vocab_size)
    with torch.inference_mode():
        src = m.new_kv(100)
        m.forward([Segment(ids[:90], 0, src, 1)])
        dst = m.new_kv(100 + 2 * BLOCK)
        m.copy_kv(src, dst, 90)
        a = m.forward([Segment(ids[90:], 90, src, 10)])[0].clone()
        b = m.forward([Segment(ids[90:], 90, dst, 10)])[0]
    assert torch.equal(a, b)


def test_the_engine_on_static_shapes_gives_the_same_calls_as_on_the_compact_forward(built_fp8):
    """Greedy, sampled with a seed, verified with and without draft logits, batched: outputs and acceptance equal;
    logits within float32's reordering."""
    static = Engine.load(built_fp8.target, static=True)
    plain = Engine.load(built_fp8.target)
    assert isinstance(static.model, PagedModel) and not isinstance(plain.model, PagedModel)
    assert "static-shape passes run eagerly" in static.model.kernel_summary
    requests = _mixed_requests(plain)
    want = plain.generate_many(requests)
    have = static.generate_many(requests)
    for a, b in zip(want, have, strict=True):
        assert a.output_ids == b.output_ids
        assert (a.num_draft_tokens, a.num_accepted_tokens) == (b.num_draft_tokens, b.num_accepted_tokens)
        if a.generation_logits is not None:
            assert abs(a.generation_logits - b.generation_logits).max() < 1e-3
    prompt = _ids(12, 21, static.info.vocab_size)
    greedy = static.generate(GenerationRequest(input_ids=prompt, request_output_len=MAX_DRAFT_LEN + 1, end_id=-1))
    verified = static.generate(
        GenerationRequest(
            input_ids=prompt,
            request_output_len=MAX_DRAFT_LEN + 1,
            end_id=-1,
            draft_input_ids=greedy.new_tokens[:MAX_DRAFT_LEN],
        )
    )
    assert verified.num_accepted_tokens == MAX_DRAFT_LEN and verified.new_tokens == greedy.new_tokens


def test_graphs_are_refused_off_cuda(built_fp8):
    with pytest.raises(EngineError, match="CUDA graphs need a CUDA device"):
        Engine.load(built_fp8.target, static=True, graphs=True)


def test_a_rotary_embedding_that_depends_on_the_length_is_refused_by_name():
    hf = _hf_model("llama")
    config = hf.config
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert "rope_type 'dynamic'" in PagedModel.unsupported(config)
    with pytest.raises(EngineError, match="rope_type 'dynamic'"):
        PagedModel(config, hf.state_dict(), dtype=torch.float32, device=CPU, max_positions=64, graphs=False)
