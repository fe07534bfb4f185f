"""A draft's greedy acceptance with and without FP8 weights, on the distillation's held-out prompts.

    python benchmarks/draft_quantization.py --draft pkg:trtspec/data/drafts/smollm2-135m-instruct

The target (FP8 weights, as the demo builds it) answers the held-out prompts greedily with the embedded engine's
forward, as `trtspec distill` does; the draft then replays speculative decoding over those answers teacher-forced,
once with its weights as shipped and once rounded to FP8 per tensor as `trtspec build` quantizes them
(`quantization: fp8`). The acceptance at K is what the engine measures on the same answers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from common import add_num_prompts  # benchmarks/common.py, beside this script
from rich.console import Console
from rich.table import Table

from trtspec.checkpoint import inspect_checkpoint, load_model, load_tokenizer, resolve_checkpoint_path
from trtspec.distill import HELDOUT, compact_forward, round_like_engine
from trtspec.distill import data as D
from trtspec.distill import train as T


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--draft", default="pkg:trtspec/data/drafts/smollm2-135m-instruct", help="a draft made by trtspec distill"
    )
    p.add_argument("--target-quantization", default="fp8", choices=["none", "fp8"], help="the target as built")
    add_num_prompts(p, 32, "held-out prompts")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per held-out answer")
    p.add_argument("--output", type=Path, default=Path("draft-quantization.json"))
    args = p.parse_args()
    console = Console()

    draft_info = inspect_checkpoint(resolve_checkpoint_path(args.draft, Path.cwd()))
    target_info = draft_info.shared.target
    tokenizer = load_tokenizer(target_info)
    prompts, _ = D.tokenize_source(D.read_source(HELDOUT, limit=args.num_prompts), tokenizer, target_info.vocab_size)
    with console.status("the target answers the held-out prompts"):
        target = load_model(target_info, torch.float32)
        round_like_engine(target, args.target_quantization)
        answers = D.decode_answers(
            compact_forward(target, target_info.architecture, torch.device("cpu")),
            prompts,
            list(range(len(prompts))),
            temperature=0.0,
            max_new_tokens=args.max_tokens,
            batch_size=32,
            top_k=32,
            seed=0,
            eos_id=tokenizer.eos_token_id,
        )
        del target
    results = {}
    for quantization in ("none", "fp8"):
        draft = load_model(draft_info, torch.float32)
        round_like_engine(draft, quantization)
        head = getattr(draft.lm_head, "token_ids", None)
        if head is not None:
            draft.lm_head.full_vocab = False
        results[quantization] = T.evaluate(draft, T.prepare(answers, head, target_info.vocab_size), torch.device("cpu"))
    table = Table(
        title=f"greedy acceptance on {len(answers)} held-out answers "
        f"({sum(a.supervised for a in answers):,} tokens), teacher-forced"
    )
    for col in ("draft weights", "KL", "K=1", "K=2", "K=4", "tokens/call K=4"):
        table.add_column(col, justify="right")
    for quantization, r in results.items():
        by_k = {x["k"]: x for x in r.by_k}
        table.add_row(
            "as shipped (bf16)" if quantization == "none" else "FP8 per tensor",
            f"{r.kl:.3f}",
            *(f"{by_k[k]['acceptance']:.3f}" for k in (1, 2, 4)),
            f"{by_k[4]['tokens_per_call']:.2f}",
        )
    console.print(table)
    args.output.write_text(json.dumps({q: r.summary() for q, r in results.items()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
