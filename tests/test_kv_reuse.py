"""The embedded engine's KV budget under a BLS's load: several requests in flight, each re-sending its whole sequence
with a few draft tokens on every call, as the orchestrator does. Kept caches are evicted least recently used (as
TensorRT-LLM evicts reusable blocks, docs/source/features/kvcache.md "prioritized LRU"), so a budget that holds fewer
sequences than are in flight evicts each one's prefix before its next call, and every verification re-prefills its
whole sequence; a budget that holds them all computes only the new tokens. Measured with the engine's own counters:
rows through the network, tokens computed and reused, evictions."""

from __future__ import annotations

import torch
from conftest import MAX_DRAFT_LEN

from trtspec.contract import GenerationRequest
from trtspec.engine.runtime import Engine

SEQUENCES = 6  # requests in flight, beyond the engine's batch of 4: two wait while the others verify
PROMPT = 40
ROUNDS = 6  # the longest sequence: PROMPT + ROUNDS x (MAX_DRAFT_LEN + 1) = 70 < the tiny engines' max_seq_len 96


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _serve(engine: Engine, budget_bytes: int) -> dict:
    """ROUNDS verification calls of each of SEQUENCES requests, all of a round submitted together, within a KV budget
    of `budget_bytes` (running and kept caches). What the calls computed, from the engine's counters."""
    vocab = engine.info.vocab_size
    engine.cache.budget_bytes = engine.cache.reuse_bytes = budget_bytes
    seqs = [_ids(PROMPT, 100 + s, vocab) for s in range(SEQUENCES)]
    computed, outputs, rows = [], [], 0
    for r in range(ROUNDS):
        calls = [
            GenerationRequest(
                input_ids=seq,
                request_output_len=MAX_DRAFT_LEN + 1,
                draft_input_ids=_ids(MAX_DRAFT_LEN, 1000 * r + s, vocab),
                end_id=-1,
            )
            for s, seq in enumerate(seqs)
        ]
        before = engine.stats.batching.rows
        results = engine.generate_many(calls)
        if r:  # the first round prefills every prompt whatever the budget
            computed += [res.computed_tokens for res in results]
            rows += engine.stats.batching.rows - before
        outputs.append([res.output_ids for res in results])
        seqs = [res.output_ids for res in results]
    return {
        "computed": computed,  # per verification after the first round
        "rows": rows,  # through the network after the first round
        "steps": engine.stats.batching.steps,
        "evictions": engine.stats.prefix.evictions,
        "peak": engine.stats.prefix.peak_bytes,
        "outputs": outputs,
    }


def test_a_cache_smaller_than_the_requests_in_flight_makes_every_verification_re_prefill(built_fp8):
    load = lambda: Engine.load(built_fp8.target, check_invariance=False)  # noqa: E731
    roomy = _serve(load(), 1 << 30)
    # room for all: each later call computes only what its previous call did not (its draft and bonus token)
    assert roomy["evictions"] == 0 and max(roomy["computed"]) <= 2 * (MAX_DRAFT_LEN + 1)
    # a budget a tenth short of what the six sequences took: the calls that wait for a batch slot find their sequence
    # evicted by those that ran, and so on round after round (least recently used is the cliff of a cyclic working
    # set): every verification re-prefills its whole sequence
    small = _serve(load(), roomy["peak"] * 9 // 10)
    assert small["outputs"] == roomy["outputs"]  # the same tokens: the cache changes only the work
    assert min(small["computed"]) >= PROMPT + MAX_DRAFT_LEN and small["evictions"] >= len(small["computed"])
    # as many engine steps, nine times the rows through the network (1410 against 150)
    assert small["steps"] == roomy["steps"]
    assert small["rows"] >= 8 * roomy["rows"]
