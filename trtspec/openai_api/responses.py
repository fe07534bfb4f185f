"""A BLS Completion as OpenAI's response (`response`) or stream chunks (`Chunks`): usage, log probabilities,
finish reason, and trtspec's speculation figures."""

from __future__ import annotations

import time
import uuid

from trtspec.generation import Completion
from trtspec.openai_api.protocol import CHAT, Request
from trtspec.openai_api.stops import StopText


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex


def finish_reason(completion: Completion, stop: StopText) -> str:
    # The BLS says "length" when max_tokens ran out, "end_id" or "stop_words" otherwise.
    return "stop" if stop.stopped or completion.finish_reason != "length" else "length"


def usage(prompt_tokens: int, completion: Completion) -> dict:
    """OpenAI's usage; with a prediction, completion_tokens_details counts its tokens that appear in the completion
    (accepted) and the others (rejected), as the BLS read them off the output. OpenAI bills rejected prediction
    tokens as completion tokens; here completion_tokens are the tokens generated, which is what they cost."""
    n = len(completion.token_ids)
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
    if completion.accepted_prediction_tokens is not None:
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": completion.accepted_prediction_tokens,
            "rejected_prediction_tokens": completion.rejected_prediction_tokens or 0,
        }
    return out


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text (a token that holds part of a character decodes to U+FFFD, as OpenAI's do)."""
    return [tokenizer.decode([i]) for i in ids]


def logprobs(kind: str, texts: list[str], values: list[float], offset: int = 0) -> dict:
    """The choice's `logprobs` in OpenAI's shape for tokens `texts` with log probabilities `values`: chat's content
    list, or the completions' parallel lists (`offset`: the characters of the completion before these tokens)."""
    if kind == CHAT:
        content = [
            {"token": t, "logprob": v, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
            for t, v in zip(texts, values)
        ]
        return {"content": content, "refusal": None}
    offsets, at = [], offset
    for t in texts:
        offsets.append(at)
        at += len(t)
    return {"tokens": texts, "token_logprobs": list(values), "top_logprobs": None, "text_offset": offsets}


def _kept(texts: list[str], values: list[float], chars: int) -> tuple[list[str], list[float]]:
    """The tokens whose text lies within the first `chars` characters of the answer (a stop string cut the rest)."""
    n, at = 0, 0
    while n < len(texts) and n < len(values) and at + len(texts[n]) <= chars:
        at += len(texts[n])
        n += 1
    return texts[:n], values[:n]


def speculation(completion: Completion) -> dict:
    """The BLS's acceptance figures for this request (trtspec's addition to OpenAI's response)."""
    return {
        "acceptance_rate": completion.acceptance_rate,
        "accepted_draft_tokens": completion.accepted_draft_tokens,
        "draft_tokens": completion.draft_tokens,
        "iterations": completion.iterations,
        "tokens_per_iteration": completion.tokens_per_iteration,
        "fallbacks": dict(completion.fallbacks),
        "draft_sources": dict(completion.sources),
    }


def response(
    req: Request, model: str, text: str, reason: str, prompt_tokens: int, completion: Completion, tokenizer=None
) -> dict:
    """The whole answer; `tokenizer` (the deployment's) gives each token's text where log probabilities are asked."""
    lps = None
    if req.logprobs and tokenizer is not None:
        lps = logprobs(req.kind, *_kept(token_texts(tokenizer, completion.token_ids), completion.log_probs, len(text)))
    if req.kind == CHAT:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": lps,
            "finish_reason": reason,
        }
    else:
        choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": reason}
    return {
        "id": new_id(req.kind),
        "object": req.kind,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion),
        "speculation": speculation(completion),
    }


class Chunks:
    """The stream of one request: OpenAI's chunk objects, all with the same id and creation time."""

    def __init__(self, req: Request, model: str, tokenizer=None):
        self.req, self.model, self.tokenizer = req, model, tokenizer
        self.id, self.created = new_id(req.kind), int(time.time())
        self.object = "chat.completion.chunk" if req.kind == CHAT else "text_completion"
        # log probabilities of tokens received but not yet sent (their text may be held back for a stop string)
        self._texts: list[str] = []
        self._values: list[float] = []
        self._offset = 0  # characters sent so far (the completions' text_offset)

    def add(self, chunk) -> None:
        """A BLS response (trtspec.generation.Chunk): its tokens' log probabilities go with the text sent next."""
        if self.req.logprobs and self.tokenizer is not None:
            self._texts += token_texts(self.tokenizer, chunk.token_ids)
            self._values += chunk.log_probs

    def _logprobs(self, text: str | None, final: bool = False) -> dict | None:
        """The log probabilities of the tokens whose text is out with `text` (all that are left, when `final` and
        no stop string cut the answer)."""
        if not (self.req.logprobs and self.tokenizer is not None):
            return None
        chars = len(text or "")
        texts, values = _kept(self._texts, self._values, sum(map(len, self._texts)) if final else chars)
        del self._texts[: len(texts)], self._values[: len(values)]
        out = logprobs(self.req.kind, texts, values, self._offset)
        self._offset += chars
        return out

    def _chunk(self, choices: list, **extra) -> dict:
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": choices}
        if self.req.include_usage:
            out["usage"] = None  # as OpenAI: null on every chunk but the last
        return out | extra

    def _choice(self, text: str | None, reason: str | None, first: bool = False, lps: dict | None = None) -> dict:
        if self.req.kind == CHAT:
            delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": lps, "finish_reason": reason}
        return {"index": 0, "text": text or "", "logprobs": lps, "finish_reason": reason}

    def start(self) -> dict | None:
        """The chat stream opens with the assistant's role, as OpenAI's does."""
        return self._chunk([self._choice(None, None, first=True)]) if self.req.kind == CHAT else None

    def text(self, text: str) -> dict:
        return self._chunk([self._choice(text, None, lps=self._logprobs(text))])

    def finish(self, text: str, reason: str, completion: Completion) -> dict:
        lps = self._logprobs(text, final=reason != "stop" or not self.req.stop)
        return self._chunk([self._choice(text, reason, lps=lps)], speculation=speculation(completion))

    def usage(self, prompt_tokens: int, completion: Completion) -> dict:
        return self._chunk([]) | {"usage": usage(prompt_tokens, completion)}
