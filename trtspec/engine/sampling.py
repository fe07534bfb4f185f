"""Token selection and draft acceptance, as pure functions of logits.

The accept rule is the one TensorRT-LLM applies to `draft_tokens_external`:
- without draft logits, a draft token is accepted while it equals the token the target itself selects at
  that position (argmax under greedy, a sample from the target's distribution under sampling);
- with draft logits and sampling, modified rejection sampling (Leviathan et al. 2023, Chen et al. 2023):
  accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); on rejection draw from norm(max(0, p_i - q_i)).
Either way the first non-accepted position contributes one token of the target's own, and a fully accepted
draft earns a bonus token from p_k, so every verify step emits between 1 and k+1 tokens.
"""

from __future__ import annotations

import torch

from trtspec.contract import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [..., V] -> the distribution the sampler draws from: temperature, then top-k, then top-p."""
    scaled = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if 0.0 < params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def select(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from logits [V]."""
    if params.greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))


def accept_draft(
    target_logits: torch.Tensor,             # [k+1, V]: the target's logits at the k draft positions and one past
    draft_tokens: list[int],                 # [k]
    *,
    params: SamplingParams,
    draft_logits: torch.Tensor | None = None,  # [k, V]: the draft's logits for its tokens, or None
    generator: torch.Generator | None = None,
) -> tuple[int, list[int]]:
    """Return (number of draft tokens accepted, tokens to emit: the accepted ones + one of the target's)."""
    k = len(draft_tokens)
    if params.greedy or draft_logits is None:
        emitted = []
        for i in range(k):
            token = select(target_logits[i], params, generator)
            emitted.append(token)
            if token != draft_tokens[i]:
                return i, emitted
        return k, emitted + [select(target_logits[k], params, generator)]

    p = probabilities(target_logits, params)          # [k+1, V]
    q = probabilities(draft_logits.to(p.dtype), params)  # [k, V]
    for i, token in enumerate(draft_tokens):
        p_i, q_i = p[i, token], q[i, token]
        u = torch.rand((), generator=generator)
        # accept with probability min(1, p/q). q = 0 (a token the draft could not have drawn under these
        # settings) is accepted only if the target can produce it: a token with p = 0 is never emitted.
        if u * q_i < p_i:
            continue
        residual = torch.clamp(p[i] - q[i], min=0.0)
        total = residual.sum()
        # residual is all-zero only when p == q, where rejection has probability 0; guard against rounding
        dist = residual / total if total > 0 else p[i]
        return i, list(draft_tokens[:i]) + [int(torch.multinomial(dist, 1, generator=generator))]
    return k, list(draft_tokens) + [int(torch.multinomial(p[k], 1, generator=generator))]
