"""Training the draft: KL to the target's next-token distribution, and greedy acceptance on held-out answers.

Loss: for every position whose next token the target produced, the cross-entropy of the draft's distribution
against the target's top-k distribution (renormalised over the tokens the draft's head can propose); minus the
target's entropy that is the KL(target || draft) that is reported.

Evaluation: on the target's greedy answers to held-out prompts, teacher-forced. `match[i]` says whether the draft's
greedy choice after the first i tokens of the answer is the target's. That is exactly what greedy speculative
decoding checks: drafting K tokens from position i, the target accepts the leading run of matches (a draft token
is conditioned on the accepted ones, which are the target's), then adds its own token. `acceptance(match, K)`
replays that loop, so the reported acceptance is the one the engine will measure on the same answers.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from trtspec.distill.data import Sequence


@dataclass
class Example:
    """A sequence prepared for the draft: the target's top-k as indices into the draft's head."""

    ids: torch.Tensor  # int64 [L]
    first: int
    head_index: torch.Tensor  # int64 [L - first, k], -1 where the token is not in the draft's head
    probs: torch.Tensor  # float32 [L - first, k], the target's top-k distribution over the kept tokens

    @property
    def supervised(self) -> int:
        return int(self.ids.numel()) - self.first


def prepare(sequences: list[Sequence], head_ids: torch.Tensor | None, vocab_size: int) -> list[Example]:
    position = torch.full((vocab_size,), -1, dtype=torch.int64)
    if head_ids is None:
        position = torch.arange(vocab_size)
    else:
        position[head_ids] = torch.arange(head_ids.numel())
    examples = []
    for s in sequences:
        index = position[s.topk_ids.long()]
        logits = s.topk_logits.float().masked_fill(index < 0, float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with no kept token learns nothing
        examples.append(Example(s.ids.long(), s.first, index, probs))
    return examples


def batches(examples: list[Example], batch_tokens: int, seed: int) -> list[list[int]]:
    """One epoch's batches: shuffled, then sorted by length within windows (little padding), then packed up to
    `batch_tokens` padded tokens."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    out, window = [], 64
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: examples[i].ids.numel())
        batch: list[int] = []
        for i in chunk:
            width = max([examples[j].ids.numel() for j in batch] + [examples[i].ids.numel()])
            if batch and width * (len(batch) + 1) > batch_tokens:
                out.append(batch)
                batch = []
            batch.append(i)
        if batch:
            out.append(batch)
    random.Random(seed + 1).shuffle(out)
    return out


def _collate(examples: list[Example], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T], the mask of supervised input positions [B, T], and their targets [S, k] x 2."""
    width = max(e.ids.numel() for e in examples)
    ids = torch.zeros((len(examples), width), dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.bool)
    for row, e in enumerate(examples):
        ids[row, : e.ids.numel()] = e.ids
        mask[row, e.first - 1 : e.ids.numel() - 1] = True  # input position j predicts token j + 1
    index = torch.cat([e.head_index for e in examples])
    probs = torch.cat([e.probs for e in examples])
    return ids.to(device), mask.to(device), index.to(device), probs.to(device)


def head_logits(draft, hidden: torch.Tensor) -> torch.Tensor:
    """The draft's logits over its own head's tokens (all of the vocabulary, or the subset)."""
    return F.linear(hidden, draft.lm_head.weight)


def loss_on(draft, examples: list[Example], device) -> tuple[torch.Tensor, float, int]:
    """(mean cross-entropy to the target over supervised positions, summed target entropy, positions)."""
    ids, mask, index, probs = _collate(examples, device)
    hidden = draft.model(input_ids=ids).last_hidden_state[mask]
    logq = torch.log_softmax(head_logits(draft, hidden).float(), dim=-1)
    picked = logq.gather(-1, index.clamp(min=0))
    cross = -(probs * picked).sum()
    entropy = -(probs * probs.clamp(min=1e-12).log()).sum().item()
    n = int(mask.sum())
    return cross / max(n, 1), entropy, n


def acceptance(matches: list[list[bool]], k: int) -> dict:
    """Greedy speculative decoding with K draft tokens replayed over the held-out answers (see the module doc):
    accepted / drafted, and new tokens per target call."""
    drafted = accepted = calls = tokens = 0
    for match in matches:
        i, n = 0, len(match)
        while i < n:
            d = min(k, n - 1 - i)  # as the orchestrator: never more than the remaining budget minus one
            run = 0
            while run < d and match[i + run]:
                run += 1
            drafted, accepted, calls = drafted + d, accepted + run, calls + 1
            i += run + 1
        tokens += n
    return {
        "k": k,
        "acceptance": accepted / drafted if drafted else 0.0,
        "tokens_per_call": tokens / calls if calls else 0.0,
    }


@dataclass
class EvalResult:
    kl: float
    match_rate: float  # = greedy acceptance at K = 1
    by_k: list[dict] = field(default_factory=list)
    head_coverage: float = 1.0  # held-out target tokens the head can propose

    def summary(self) -> dict:
        return {
            "kl": round(self.kl, 4),
            "acceptance_k1": round(self.match_rate, 4),
            "by_k": [{key: round(v, 4) if isinstance(v, float) else v for key, v in r.items()} for r in self.by_k],
            "head_coverage": round(self.head_coverage, 4),
        }


@torch.no_grad()
def evaluate(draft, examples: list[Example], device, *, ks=(1, 2, 3, 4, 5, 6), batch_tokens: int = 8192) -> EvalResult:
    """Teacher-forced greedy agreement of the draft with the target's greedy answers (see the module doc)."""
    was_training = draft.training
    draft.eval()
    matches: list[list[bool]] = []
    kl_sum = n_sum = 0.0
    covered = total = 0
    token_ids = getattr(draft.lm_head, "token_ids", None)
    for batch in batches(examples, batch_tokens, seed=0):
        group = [examples[i] for i in batch]
        ids, mask, index, probs = _collate(group, device)
        hidden = draft.model(input_ids=ids).last_hidden_state[mask]
        logits = head_logits(draft, hidden).float()
        logq = torch.log_softmax(logits, dim=-1)
        kl_sum += float((probs * (probs.clamp(min=1e-12).log() - logq.gather(-1, index.clamp(min=0)))).sum())
        n_sum += float(mask.sum())
        choice = logits.argmax(-1)
        choice = token_ids[choice] if token_ids is not None else choice
        offset = 0
        for e in group:
            n = e.supervised
            truth = e.ids[e.first :].to(device)
            matches.append((choice[offset : offset + n] == truth).tolist())
            if token_ids is not None:
                covered += int(torch.isin(truth, token_ids).sum())
            offset += n
        total += sum(e.supervised for e in group)
    draft.train(was_training)
    flat = [m for match in matches for m in match]
    return EvalResult(
        kl=kl_sum / max(n_sum, 1),
        match_rate=sum(flat) / max(len(flat), 1),
        by_k=[acceptance(matches, k) for k in ks],
        head_coverage=covered / max(total, 1) if token_ids is not None else 1.0,
    )


def learning_rate(base: float, tokens: int, total: int, warmup: float = 0.03, floor: float = 0.1) -> float:
    """Linear warm-up over the first `warmup` of the run, then a cosine down to `floor` x base."""
    if total <= 0:
        return base
    x = tokens / total
    if x < warmup:
        return base * max(x / warmup, 0.01)
    progress = min((x - warmup) / max(1 - warmup, 1e-9), 1.0)
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def trainable(draft) -> list[torch.nn.Parameter]:
    return [p for p in draft.parameters() if p.requires_grad]
