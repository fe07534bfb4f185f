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

import dataclasses

import torch

from trtspec.contract import Penalties, SamplingParams


@dataclasses.dataclass
class Rules:
    """What a request asks of each step besides its sampling settings: penalties, bad words, an end token held
    back (min_tokens). `active` is false for a plain request, whose logits then go to the sampler untouched."""

    penalties: Penalties = Penalties()
    bad_words: list[list[int]] = dataclasses.field(default_factory=list)
    log_probs: bool = False

    def __post_init__(self):
        self.banned = BadWords(self.bad_words)

    @property
    def active(self) -> bool:
        return self.penalties.active or bool(self.bad_words) or self.log_probs


class BadWords:
    """A request's bad words indexed once per call, so that a step costs one tensor write for the one-token words
    and one dict lookup per distinct length of the others, however many words there are (the step runs on the
    thread that serves the whole batch)."""

    def __init__(self, words: list[list[int]]):
        single = sorted({w[0] for w in words if len(w) == 1})
        self.single = torch.as_tensor(single, dtype=torch.long) if single else None
        # prefix length -> the word's tokens but its last -> the last tokens that would complete a word
        self.by_prefix: dict[int, dict[tuple[int, ...], list[int]]] = {}
        for w in words:
            if len(w) > 1:
                self.by_prefix.setdefault(len(w) - 1, {}).setdefault(tuple(w[:-1]), []).append(w[-1])

    def ban(self, logits: torch.Tensor, history: list[int]) -> None:
        """Set to -inf, in place, every token that would complete a bad word after `history`."""
        if self.single is not None:
            logits[self.single] = float("-inf")
        for n, prefixes in self.by_prefix.items():
            if n <= len(history):
                last = prefixes.get(tuple(history[-n:]))
                if last:
                    logits[last] = float("-inf")


def prepare(
    logits: torch.Tensor, params: SamplingParams, rules: Rules, history: list[int], blocked: int | None = None
) -> tuple[torch.Tensor, SamplingParams]:
    """One position's logits [V] -> (the logits the sampler draws from, the settings to draw with), in
    TensorRT-LLM's order (penaltyKernels.cu, then banBadWords): temperature, repetition / presence / frequency
    penalties over `history`, the end token `blocked` (min_tokens), bad words completed by one more token.
    The temperature is applied here, so the settings returned carry temperature 1 (0 stays 0: greedy).
    Without rules or a blocked token the logits come back as they were."""
    if not rules.active and blocked is None:
        return logits, params
    out = logits.float().clone()
    if params.temperature > 0:
        out /= params.temperature
        params = dataclasses.replace(params, temperature=1.0)
    pen = rules.penalties
    if pen.active and history:
        counts = _counts(history, out.shape[-1])
        seen = counts > 0
        values = out[seen]
        out[seen] = torch.where(values < 0, values * pen.repetition, values / pen.repetition)
        # presence and frequency count the tokens after the ignored prefix, repetition the whole sequence
        # (penaltyKernels.cu since PR #8127: numOccurences against ifPresenceInFullSeq)
        if pen.prompt_ignore:
            counts = _counts(history[pen.prompt_ignore :], out.shape[-1])
            seen = counts > 0
        out[seen] = out[seen] - pen.presence - pen.frequency * counts[seen].float()  # in the kernel's order
    if blocked is not None:
        out[blocked] = float("-inf")
    rules.banned.ban(out, history)
    return out, params


def _counts(tokens: list[int], vocab: int) -> torch.Tensor:
    ids = torch.as_tensor(tokens, dtype=torch.long)
    return torch.bincount(ids[ids < vocab], minlength=vocab)[:vocab]


def log_prob(logits: torch.Tensor, token: int) -> float:
    """log p(token) under the full softmax of prepared logits (before top-k / top-p, as TensorRT-LLM reports it)."""
    return float(torch.log_softmax(logits.float(), dim=-1)[token])


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
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            # the same token (the first of the largest, as torch.argmax), without waking torch's thread pool: on a
            # 2-core machine that woke beside the engine kernels' own threads and cost 0.5 ms a decode step
            return int(logits.numpy().argmax())
        return int(torch.argmax(logits))
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))


def accept_draft(
    target_logits: torch.Tensor,  # [k+1, V]: the target's logits at the k draft positions and one past
    draft_tokens: list[int],  # [k]
    *,
    params: SamplingParams,
    draft_logits: torch.Tensor | None = None,  # [k, V]: the draft's logits for its tokens, or None
    generator: torch.Generator | None = None,
    draft_params: SamplingParams | None = None,  # the draft's settings when `params` are those of prepared logits
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

    p = probabilities(target_logits, params)  # [k+1, V]
    q = probabilities(draft_logits.to(p.dtype), draft_params or params)  # [k, V]
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
