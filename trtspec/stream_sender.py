"""Streaming without a queue of messages: each message carries every token that is ready and not yet sent.

At each hop trtspec controls (the embedded engine model's responses to the BLS, the BLS's responses to its client,
the OpenAI front's server-sent events) a message costs far more than a token: about 0.34 ms of CPU per Triton
Python-backend response on a 2-core machine, whatever it holds. A reader that keeps up gets one message per token
(the next token goes alone as soon as the previous message was taken); a reader that is behind gets one message
with everything produced while it was busy, instead of a queue of one-token messages. No delay is added and nothing
is held back once produced, unless a client asks for `stream_interval` (tokens per message, SGLang's and vLLM's
`--stream-interval`): then tokens wait until that many are ready, but the first token and the final message always go
at once.

Two shapes, one rule (`due`):
- `Coalescer`: a producer that must not block (the engine's forward thread) hands each stream's latest state to a
  sender thread; while that thread is inside a send (Triton's `response_sender.send` returns only once the server
  process has taken the response: python_backend src/response_sender.cc, ResponseSender::Send waits on
  `is_stub_turn`), further states replace the pending one, and the next send carries all of their tokens.
- `Held`: a producer that sends on its own thread (the BLS, the front) reads everything that arrived while it was
  sending at its next read; `Held` adds only the `stream_interval` hold.

Triton-free (tested without a server); the Triton and HTTP adapters pass in their own send.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from trtspec.contract import GenerationResult

# The per-hop counters (one family each, labelled by model and hop), so that one panel reads every hop's messages
# per token: messages / tokens. Hops: engine (engine model -> BLS), bls (BLS -> its client).
MESSAGES_METRIC = "trtspec_stream_messages_total"
MESSAGES_HELP = "Streamed messages sent (responses of a streamed call or request, final included)"
TOKENS_METRIC = "trtspec_stream_tokens_total"
TOKENS_HELP = "Tokens carried by streamed messages"


def due(interval: int, sent: int, ready: int, final: bool) -> bool:
    """Whether `ready` unsent tokens go now, `sent` messages having gone before: the final message always, the first
    token at once, else when `interval` tokens are ready (0 or 1: every token; nothing is ever held otherwise)."""
    return final or (ready > 0 and (sent == 0 or ready >= max(1, interval)))


def check_interval(value, field_name: str = "stream_interval") -> int:
    """A stream_interval as given by a client or a deployment: an integer >= 0 (0 and 1: every token)."""
    from trtspec.errors import RequestError

    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RequestError(
            field_name, f"must be an integer >= 0 (tokens per streamed message; 0 or 1: every token), got {value!r}"
        )
    return value


@dataclass
class HopCounts:
    """Messages and tokens one hop has sent (thread-safe); messages / tokens is the hop's messages per token."""

    messages: int = 0
    tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, messages: int, tokens: int) -> None:
        with self._lock:
            self.messages += messages
            self.tokens += tokens

    def take(self) -> tuple[int, int]:
        """The counts since the last take (for a reporter that sends increments)."""
        with self._lock:
            out = (self.messages, self.tokens)
            self.messages = self.tokens = 0
            return out


class Coalescer:
    """One stream's messages, sent from a thread of `senders` so that the producer never waits on a send (None: on
    the producer's thread, one message per offer, as TensorRT-LLM's backend sends one response per step).

    `offer(state, tokens, final)`: the stream's latest state (everything the producer has; the send works out what
    is new) and how many tokens it added. `send(state, final)` sends one message for a state and returns the tokens
    it carried. At most one send of a stream runs at a time, in order; the final message goes last, once, with every
    token not sent before it. `on_error(exc)`: a send that raised (the stream goes on: a later message, the final
    one above all, is still tried)."""

    def __init__(
        self,
        send: Callable[[object, bool], int],
        senders: Executor | None,
        *,
        interval: int = 0,
        counts: HopCounts | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ):
        self._send, self._senders, self.interval = send, senders, interval
        self.counts, self._on_error = counts, on_error
        self._lock = threading.Lock()
        self._state: object = None
        self._has_state = self._final = self._busy = self._closed = False
        self._ready = 0  # tokens offered and not sent
        self.sent = 0  # messages sent
        self._idle = threading.Event()
        self._idle.set()

    def offer(self, state, tokens: int, final: bool = False) -> None:
        with self._lock:
            if self._closed:
                return  # the final message has been taken: nothing follows it
            self._state, self._has_state = state, True
            self._ready += tokens
            self._final = self._final or final
            if self._busy or not due(self.interval, self.sent, self._ready, self._final):
                return
            self._busy = True
            self._idle.clear()
        if self._senders is None:
            self._drain()  # on the producer's thread: one message per offer
        else:
            self._senders.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._has_state or not due(self.interval, self.sent, self._ready, self._final):
                    self._busy = False
                    self._idle.set()
                    return
                state, final, self._state, self._has_state, self._ready = self._state, self._final, None, False, 0
                self._closed = final
            carried = 0
            try:
                carried = self._send(state, final)
            except BaseException as exc:  # reported; the stream's later messages are still tried
                if self._on_error is not None:
                    self._on_error(exc)
            self.sent += 1
            if self.counts is not None:
                self.counts.add(1, carried)
            if final:
                with self._lock:
                    self._busy = False
                    self._idle.set()
                return

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every message offered so far has been sent (within `timeout` seconds)."""
        return self._idle.wait(timeout)


class Held:
    """The `stream_interval` hold for a producer that sends on its own thread: `push(tokens, text)` gives back what to
    send now (ids, text), or None to hold it; `take()` gives back what is held, for the final message. With interval
    0 or 1 nothing is held. `sent` counts the messages that went (the caller's final one included via `sent_final`)."""

    def __init__(self, interval: int = 0, counts: HopCounts | None = None):
        self.interval, self.counts = interval, counts
        self.ids: list[int] = []
        self.text: list[str] = []
        self.sent = 0
        self.tokens = 0  # tokens that went in messages so far

    def push(self, ids: list[int], text: str) -> tuple[list[int], str] | None:
        self.ids += ids
        if text:
            self.text.append(text)
        if not (self.ids or self.text):
            return None
        if self.ids and not due(self.interval, self.sent, len(self.ids), False):
            return None  # fewer tokens than the interval (text with no token, which no hop sends, is not held)
        return self._out()

    def take(self) -> tuple[list[int], str]:
        """Everything held, for the final message (counted as a message)."""
        return self._out()

    def _out(self) -> tuple[list[int], str]:
        ids, text = self.ids, "".join(self.text)
        self.ids, self.text = [], []
        self.sent += 1
        self.tokens += len(ids)
        if self.counts is not None:
            self.counts.add(1, len(ids))
        return ids, text


def merge_results(results: list[GenerationResult]) -> GenerationResult:
    """Consecutive responses of one streaming call as one: their tokens, logits and log probs in order; the running
    totals (perf outputs, KV blocks, times, draft counts) and the context logits of the last."""
    if len(results) == 1:
        return results[0]
    last = results[-1]
    logits = [r.generation_logits for r in results if r.generation_logits is not None and len(r.generation_logits)]
    logs = [r.log_probs for r in results]
    return dataclasses.replace(
        last,
        output_ids=[t for r in results for t in r.output_ids],
        new_tokens=[t for r in results for t in r.new_tokens],
        generation_logits=np.concatenate(logits) if logits else last.generation_logits,
        log_probs=None if any(lp is None for lp in logs) else [v for lp in logs for v in lp],
        context_logits=next((r.context_logits for r in reversed(results) if r.context_logits is not None), None),
    )
