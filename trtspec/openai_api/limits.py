"""What one request may ask of the OpenAI front and what the front holds for one client (`Limits`), derived from the
BLS's config where they follow from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the front, and what the front holds for one client: every refusal names its field
    and the limit. None: derived from the BLS's config when the front connects (`resolve`)."""

    # The longest accepted prompt (65,536 characters for max_input_len 4096) is at most 786 KB as JSON even with
    # every character \u-escaped (12 bytes); 4 MiB leaves room and keeps a body's buffer small. Raised by `resolve`
    # where the deployment's prompts need more.
    body_bytes: int = 4 * 1024 * 1024
    # A request's headers must arrive within this (uvicorn waits forever): a connection that sends nothing holds a
    # slot of `connections`. Headers come in one packet; 10 s covers a slow link's retransmissions.
    header_seconds: float = 10.0
    # The whole body must arrive within this: a client that trickles it holds a connection. 4 MiB at 1 Mbit/s: 34 s.
    body_seconds: float = 60.0
    # OpenAI allows 4; clients written for vLLM or SGLang send a few more. Each one is matched on every token.
    stop_strings: int = 16
    # A stop string is a short marker; longer ones only cost the hold-back and the BLS's tokenizing.
    stop_chars: int = 256
    # The prompt cap is this many characters a token of the BLS's max_input_len, checked before tokenizing: text
    # averages 3-5 characters a token, so a longer prompt would be refused by the BLS after paying for its tokens.
    chars_per_token: int = 16
    prompt_chars: int | None = None  # None: chars_per_token x max_input_len (262,144 when the BLS does not say)
    # Every chat template spends at least one token a message, so more than max_input_len messages cannot fit;
    # the bound keeps the template's work (a worker thread) in proportion.
    messages: int | None = None  # None: the BLS's max_input_len (4,096 when it does not say)
    # uvicorn answers 503 past this many connections (idle keep-alive ones count): the BLS admits
    # max_concurrent_requests + max_queued_requests and refuses the rest, plus 64 for probes and idle connections.
    # The pool of connections to Triton is the same size: no more requests than that can be in flight.
    connections: int | None = None  # None: from the BLS as above (512 when it does not say)
    # The kernel's send buffer of a client's connection (autotuned, it grows to 4 MiB): what a client that stops
    # reading pins before the front notices. 256 KiB holds about a thousand streamed tokens.
    send_buffer_bytes: int | None = 256 * 1024
    # A response that the client has not read for this long (the send buffers full, nothing drained) ends: its
    # connection is closed, which ends the stream and cancels its request in Triton, freeing the slot.
    stall_seconds: float = 30.0

    def resolve(self, max_input_len: int | None = None, capacity: int | None = None) -> Limits:
        """These limits with every derived one filled in, from the BLS's max_input_len and its admitted requests
        (max_concurrent_requests + max_queued_requests); None where the BLS does not say."""
        prompt = self.prompt_chars or self.chars_per_token * (max_input_len or 16384)
        return dataclasses.replace(
            self,
            prompt_chars=prompt,
            messages=self.messages or max_input_len or 4096,
            connections=self.connections or (capacity + 64 if capacity else 512),
            body_bytes=max(self.body_bytes, 12 * prompt + 64 * 1024),
        )


DEFAULT_LIMITS = Limits().resolve()
