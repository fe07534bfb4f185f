"""The deployment's BLS as the OpenAI front reads it: Triton's HTTP generate endpoints, read in the front's event loop.

A streamed token goes from Triton's socket to the client's without a thread in between: the event loop that writes
the client's stream reads Triton's server-sent events too. (tritonclient's blocking gRPC stream, which the front used
before, handed each token from thread to thread three times: about 0.8 ms of CPU a token, on the cores the engine
decodes on.) Requests and their outputs are those of SpecClient's HTTP path: the same fields, the same Completion.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator

import aiohttp

from trtspec.client import ClientError, SpecClient, http_error_message, parse_event
from trtspec.generation import Chunk, Collector, Completion

log = logging.getLogger("trtspec.openai")


class Upstream:
    """One deployment's BLS over HTTP, for coroutines of one event loop; `start()` in that loop, `close()` at the end.

    `timeout`: seconds a request may take in all; past it the connection is closed, on which Triton cancels the
    request. `headers`: sent with every request (the key Triton's inference API asks for, if any; None: SpecClient's
    default)."""

    def __init__(self, url: str, model: str, timeout: float, headers: dict[str, str] | None = None):
        # the model, address, timeout, headers and error messages
        self.client = SpecClient(url, protocol="http", model=model, timeout=timeout, headers=headers)
        base = f"{self.client.scheme}://{self.client.url}"
        self._generate = f"{base}/v2/models/{urllib.parse.quote(model)}/generate"
        self._ready = base + "/v2/models/{}/ready"
        self._session: aiohttp.ClientSession | None = None

    async def start(self, connections: int) -> None:
        """`connections`: the most open at once to Triton; a request past them waits for one (within `timeout`)."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=connections), headers=self.client.headers, trust_env=False
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def ready(self, model: str) -> bool:
        """Whether Triton says `model` is ready; False when Triton cannot be asked."""
        try:
            async with self._session.get(
                self._ready.format(urllib.parse.quote(model)), timeout=aiohttp.ClientTimeout(total=5.0)
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def complete(self, fields: dict) -> Completion:
        """One generation, answered at its end (`stream` false)."""
        sent_at = time.perf_counter()
        collector = Collector(sent_at, None)
        async with self._post(fields, stream=False) as resp:
            body = await self._read(resp.read())
            if resp.status != 200:
                raise self._refused(resp, body)
            collector.add(time.perf_counter(), parse_event(body.decode("utf-8", "replace"), self.client))
        return collector.finish(time.perf_counter())

    async def stream(self, fields: dict) -> AsyncIterator[Chunk | Completion]:
        """One streamed generation: the responses that carry text or tokens as Chunks, then the Completion. Every
        response that one read of the connection brings is one Chunk (their text and tokens together): the BLS's
        responses that came while the front was busy writing go to the client as one event, not a queue of them.
        Leaving the iteration early (aclose) closes the connection, which cancels the request."""
        sent_at = time.perf_counter()
        collector = Collector(sent_at, None)
        chunks = collector.completion.chunks
        async with self._post(fields, stream=True) as resp:
            if resp.status != 200:
                raise self._refused(resp, await self._read(resp.read()))
            buffer = b""
            while True:
                data = await self._read(resp.content.readany())
                if not data:
                    break
                buffer += data
                *events, buffer = buffer.split(b"\n\n")
                seen = len(chunks)
                for event in events:
                    if (payload := _data(event)) is not None:
                        collector.add(time.perf_counter(), parse_event(payload, self.client))
                if len(chunks) > seen:
                    yield merged(chunks[seen:])
            if (payload := _data(buffer)) is not None:  # a last event without its blank line
                collector.add(time.perf_counter(), parse_event(payload, self.client))
        yield collector.finish(time.perf_counter())

    # ---- helpers ----
    @contextlib.asynccontextmanager
    async def _post(self, fields: dict, stream: bool):
        if self._session is None:
            raise ClientError("the front is not started (Upstream.start)")
        url = self._generate + ("_stream" if stream else "")
        resp = await self._read(
            self._session.post(
                url,
                data=json.dumps(fields),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self.client.timeout),
            )
        )
        try:
            yield resp
        finally:
            if resp.content.at_eof():
                resp.release()  # read to its end: the connection serves the next request
            else:
                resp.close()  # left early: closing the connection cancels the request in Triton

    async def _read(self, pending):
        """Await the response or one read of it, with the failures of the connection as ClientErrors."""
        try:
            return await pending
        except asyncio.TimeoutError:
            raise self.client.server_error(
                self.client.model,
                f"gave no final response within {self.client.timeout:g} "
                "s; the connection was closed, which cancels the request",
            ) from None
        except aiohttp.ClientError as exc:
            raise self._failed(exc) from exc

    def _refused(self, resp: aiohttp.ClientResponse, body: bytes) -> ClientError:
        return self.client.server_error(self.client.model, http_error_message(resp.status, resp.reason or "", body))

    def _failed(self, exc: Exception) -> ClientError:
        # the words errors.bls_error reads as "unavailable" (503): the server, not the client, failed. The
        # exception (it names Triton's address) goes to the log, not to the client.
        what = (
            "failed to connect"
            if isinstance(exc, aiohttp.ClientConnectorError)
            else "the connection closed before the final response (socket closed)"
        )
        log.warning("Triton at %s: %s: %s: %s", self.client.url, what, type(exc).__name__, exc)
        return self.client.server_error(self.client.model, what)


def _data(event: bytes) -> str | None:
    """The `data:` payload of one server-sent event, or None if it has none."""
    lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines).decode("utf-8", "replace") if lines else None


def merged(chunks: list[Chunk]) -> Chunk:
    """Consecutive chunks as one: their text and tokens in order, arrived when the last did."""
    if len(chunks) == 1:
        return chunks[0]
    return Chunk(
        chunks[-1].seconds,
        "".join(c.text for c in chunks),
        [t for c in chunks for t in c.token_ids],
        tuple(v for c in chunks for v in c.log_probs),
    )
