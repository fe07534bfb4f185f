"""A generation at the `tensorrt_llm_bls` model: the request's fields, and the Completion its responses make.

`request_fields` names a request's inputs as the BLS (and NVIDIA's) declares them; a `Collector` turns the BLS's
responses (tensor name -> value, in arrival order) into `Chunk`s and one `Completion`, with the speculation
statistics the BLS sends with return_perf_metrics. Transport-free: trtspec.client reads the responses off HTTP or
gRPC, and the OpenAI front's reader builds its Completions with the same Collector.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

# The perf outputs of `tensorrt_llm_bls` (sent with return_perf_metrics) -> Completion fields.
_PERF_FIELDS = {
    "acceptance_rate": ("acceptance_rate", float),
    "total_accepted_draft_tokens": ("accepted_draft_tokens", int),
    "total_draft_tokens": ("draft_tokens", int),
    "num_iterations": ("iterations", int),
    "draft_time_ms": ("draft_ms", float),
    "verify_time_ms": ("verify_ms", float),
    "accepted_prediction_tokens": ("accepted_prediction_tokens", int),  # with a prediction (Predicted Outputs)
    "rejected_prediction_tokens": ("rejected_prediction_tokens", int),
}
_PER_POSITION = {"accepted_per_position": "accepted_per_position", "drafted_per_position": "drafted_per_position"}


class Chunk(NamedTuple):
    """One response of a generation: when it arrived (seconds since the request was sent), its text, its ids."""

    seconds: float
    text: str
    token_ids: list[int]
    log_probs: tuple[float, ...] = ()  # of its tokens, where the request asked for them (return_log_probs)


@dataclass
class Completion:
    """A finished generation, with the BLS's speculation statistics when it sent them (return_perf_metrics).

    seconds: from sending the request to its final response. time_to_first_token: from sending the request to the
    first response carrying tokens (with stream false there is one response, so it equals `seconds`).
    chunks: every response that carried tokens or text, as it arrived. tokens_per_second = len(token_ids) / seconds.
    """

    text: str
    token_ids: list[int]
    chunks: list[Chunk] = field(default_factory=list)
    time_to_first_token: float | None = None
    seconds: float = 0.0
    acceptance_rate: float | None = None
    accepted_draft_tokens: int | None = None
    draft_tokens: int | None = None
    iterations: int | None = None
    draft_ms: float | None = None
    verify_ms: float | None = None
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> times speculation was switched off
    sources: dict[str, int] = field(default_factory=dict)  # draft source -> iterations it drafted
    finish_reason: str | None = None
    log_probs: list[float] = field(default_factory=list)  # of every token, with return_log_probs
    accepted_prediction_tokens: int | None = None  # with a prediction: OpenAI's completion_tokens_details
    rejected_prediction_tokens: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_iteration(self) -> float | None:
        return len(self.token_ids) / self.iterations if self.iterations else None

    def position_acceptance(self) -> list[float]:
        """The chance that draft position i was accepted, given it was drafted."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]


def request_fields(
    prompt: str,
    *,
    max_tokens: int,
    num_draft_tokens=None,
    use_draft_logits=None,
    temperature=None,
    top_k=None,
    top_p=None,
    seed=None,
    stop_words=None,
    end_id=None,
    min_tokens=None,
    return_perf_metrics=True,
    stream=False,
    speculation=None,
    adaptive_draft_length=None,
    final_perf_metrics_only=None,
    **more,
) -> dict[str, object]:
    """The `tensorrt_llm_bls` request fields (tensor name -> value) for one generation; None leaves a field out;
    `more`: other BLS inputs by name (prediction, return_log_probs, ...).

    `exclude_input_in_output` is always set, so the text is the generated text alone, streamed or not."""
    fields = {
        "text_input": prompt,
        "max_tokens": max_tokens,
        "num_draft_tokens": num_draft_tokens,
        "use_draft_logits": use_draft_logits,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "seed": seed,
        "end_id": end_id,
        "min_tokens": min_tokens,
        "stop_words": list(stop_words) if stop_words else None,
        "return_perf_metrics": return_perf_metrics,
        "stream": stream,
        "exclude_input_in_output": True,
        "speculation": speculation,
        "adaptive_draft_length": adaptive_draft_length,
        "final_perf_metrics_only": final_perf_metrics_only,
    } | more
    return {k: v for k, v in fields.items() if v is not None}


def flat(value) -> list:
    """A JSON value or array (any shape) -> flat list."""
    if value is None:
        return []
    if isinstance(value, np.ndarray):
        return value.reshape(-1).tolist()
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in flat(v)]
    return [value]


def as_text(value) -> str:
    return "".join(v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat(value))


class Collector:
    """Builds a Completion from the BLS's responses (tensor name -> value), in arrival order (the OpenAI front's
    reader builds its Completions with it too)."""

    def __init__(self, sent_at: float, on_chunk: Callable[[Chunk], None] | None):
        self.sent_at = sent_at
        self.on_chunk = on_chunk
        self.completion = Completion(text="", token_ids=[])
        self._text: list[str] = []

    def add(self, arrived_at: float, outputs: dict[str, object]) -> None:
        c = self.completion
        text = as_text(outputs.get("text_output"))
        ids = [int(i) for i in flat(outputs.get("output_ids"))]
        log_probs = tuple(float(v) for v in flat(outputs.get("output_log_probs")))
        c.log_probs += log_probs
        if text or ids:
            chunk = Chunk(arrived_at - self.sent_at, text, ids, log_probs)
            c.chunks.append(chunk)
            if ids and c.time_to_first_token is None:
                c.time_to_first_token = chunk.seconds
            self._text.append(text)
            c.token_ids += ids
            if self.on_chunk is not None:
                self.on_chunk(chunk)
        for name, (attr, kind) in _PERF_FIELDS.items():
            values = flat(outputs.get(name))
            if values:
                setattr(c, attr, kind(values[0]))
        for name, attr in _PER_POSITION.items():
            if name in outputs:
                setattr(c, attr, [int(v) for v in flat(outputs[name])])
        for name, counts in (("fallback_reasons", c.fallbacks), ("draft_sources", c.sources)):
            for entry in flat(outputs.get(name)):  # "name:count"
                key, _, count = (entry.decode() if isinstance(entry, bytes) else str(entry)).rpartition(":")
                if key and count.isdigit():
                    counts[key] = int(count)
        reason = as_text(outputs.get("finish_reason")) if "finish_reason" in outputs else ""
        if reason:
            c.finish_reason = reason

    def finish(self, ended_at: float, reason: str | None = None) -> Completion:
        c = self.completion
        c.text = "".join(self._text)
        c.seconds = ended_at - self.sent_at
        if c.time_to_first_token is None and c.token_ids:
            c.time_to_first_token = c.seconds
        if reason is not None:
            c.finish_reason = reason
        return c
