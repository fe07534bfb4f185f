"""What too small a KV cache costs a speculative deployment under load, on an embedded engine dir.

    python benchmarks/kv_reuse.py --engine demo-output/engines/target --sequences 16 --prompt-tokens 1000

--sequences requests are in flight (a BLS's max_concurrent_requests: twice the engine's batch by default), each
re-sending its whole sequence with --draft-tokens draft tokens on every call, all of a round's calls submitted
together as the BLS's threads submit them. The same rounds run under two KV budgets: one holding only the engine's
batch at full length (max_batch_size x max_seq_len, what trtllm deployments capped their KV cache at), and one holding
every sequence in flight. Kept caches are evicted least recently used, so the first budget evicts each request's
prefix before its next call once more sequences are in flight than it holds, and each verification re-prefills its
sequence. Printed per budget: the tokens each verification computed, the rows through the network, the engine's
steps, evictions and the wall time of the verification rounds. Both must give the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from trtspec.contract import GenerationRequest
from trtspec.engine.runtime import Engine


def ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def serve(engine: Engine, budget: int, args) -> dict:
    engine.cache.budget_bytes = engine.cache.reuse_bytes = budget
    vocab = engine.info.vocab_size
    seqs = [ids(args.prompt_tokens, 100 + s, vocab) for s in range(args.sequences)]
    computed, outputs, seconds, rows = [], [], 0.0, 0
    for r in range(args.rounds + 1):
        calls = [
            GenerationRequest(
                input_ids=seq,
                request_output_len=args.draft_tokens + 1,
                draft_input_ids=ids(args.draft_tokens, 1000 * r + s, vocab),
                end_id=-1,
            )
            for s, seq in enumerate(seqs)
        ]
        before, start = engine.stats.batching.rows, time.perf_counter()
        results = engine.generate_many(calls)
        if r:  # round 0 prefills the prompts whatever the budget
            seconds += time.perf_counter() - start
            rows += engine.stats.batching.rows - before
            computed += [res.computed_tokens for res in results]
        outputs.append([res.output_ids for res in results])
        seqs = [res.output_ids for res in results]
    return {
        "budget_mib": round(budget / 2**20, 1),
        "computed_per_verification": round(statistics.mean(computed), 1),
        "re_prefilled": sum(c >= args.prompt_tokens for c in computed),
        "verifications": len(computed),
        "rows": rows,
        "steps": engine.stats.batching.steps,
        "evictions": engine.stats.prefix.evictions,
        "seconds_per_round": round(seconds / args.rounds, 3),
        "outputs": outputs,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="an embedded (backend: torch) engine dir")
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    engine = Engine.load(args.engine, check_invariance=False)
    info, pool = engine.info, engine.cache
    longest = args.prompt_tokens + (args.rounds + 1) * (args.draft_tokens + 1)
    budgets = {
        "batch at full length": info.max_batch_size * pool.bytes_for(info.max_seq_len),
        "every sequence in flight": (args.sequences + info.max_batch_size) * pool.bytes_for(longest + 256),
    }
    report = {}
    for name, budget in budgets.items():
        report[name] = serve(Engine.load(args.engine, check_invariance=False), budget, args)
    outputs = [r.pop("outputs") for r in report.values()]
    report["same tokens"] = all(o == outputs[0] for o in outputs)
    report["setup"] = {
        "engine": args.engine,
        "max_batch_size": info.max_batch_size,
        "max_seq_len": info.max_seq_len,
        "sequences": args.sequences,
        "prompt_tokens": args.prompt_tokens,
        "draft_tokens": args.draft_tokens,
        "rounds": args.rounds,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
