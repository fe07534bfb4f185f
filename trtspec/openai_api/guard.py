"""What the front checks before a request reaches its handler, and what it holds for one client: the API key, the
body's size and arrival time, and a connection whose client stopped reading."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket

from trtspec.keys import Key
from trtspec.openai_api.errors import APIError, internal
from trtspec.openai_api.limits import Limits

log = logging.getLogger("trtspec.openai")
OPEN_PATHS = {"/health", "/health/live"}  # a load balancer's or kubelet's probe carries no key
_CLOSE = {"Connection": "close"}  # a refusal sent before the body was read: the rest of it is not waited for


def unauthorized(given: bytes | None) -> APIError:
    message = (
        "no API key: send the server's key as `Authorization: Bearer <key>` (the openai package's api_key)"
        if given is None
        else "the API key is not this server's; send the key its operator gave you as `Authorization: Bearer <key>`"
    )
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"} | _CLOSE)


def bearer(scope) -> bytes | None:
    """The token of the request's `Authorization: Bearer <token>` header, as sent; None without one."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else b""
    return None


async def send_error(send, exc: APIError) -> None:
    """`exc` as a whole response, in OpenAI's shape, on a raw ASGI `send`."""
    body = json.dumps(exc.body()).encode()  # ASCII: a refused field may hold any text
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequireKey:
    """ASGI middleware: every request but OPEN_PATHS carries `key` (compared in constant time) or gets 401, before
    its body is read."""

    def __init__(self, app, key: Key):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = bearer(scope)
            if not self.key.matches(given):
                await send_error(send, unauthorized(given))
                return
        await self.app(scope, receive, send)


class AnswerFailures:
    """ASGI middleware: a request that fails before its response starts gets a 500 with an error id (internal(): the
    exception, logged once under that id, never reaches the client), and its connection is not reused."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started or scope["type"] != "http":
                raise
            await send_error(send, internal(exc))


async def read_body(request, limits: Limits) -> bytes:
    """The request's body, refused (413) past limits.body_bytes, by its Content-Length before any of it is read or
    by the bytes that arrive (a chunked body has no length), and (408) when it has not all arrived within
    limits.body_seconds."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limits.body_bytes:
        raise _too_large(f"{int(length)} bytes (Content-Length)", limits)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_seconds):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.body_bytes:
                    raise _too_large(f"more than {limits.body_bytes} bytes", limits)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(
            408,
            f"body: it did not arrive within {limits.body_seconds:g} s (this server's limit); send it at once",
            param="body",
            code="request_timeout",
            headers=_CLOSE,
        ) from None
    return b"".join(chunks)


def _too_large(what: str, limits: Limits) -> APIError:
    return APIError(
        413,
        f"body: the request body has {what}; this server accepts at most {limits.body_bytes} bytes: shorten the "
        "prompt or the messages",
        param="body",
        code="request_too_large",
        headers=_CLOSE,
    )


def http_protocol(limits: Limits) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with deadlines that free a connection's slot:
    - a request's headers arrive within limits.header_seconds of the connection opening or of the previous
      response's end (uvicorn waits for them forever), or the connection is closed;
    - a connection whose responses its client has not read for limits.stall_seconds (the buffers full: asyncio
      paused the writing) is closed, which ends its stream (Starlette sees the disconnect) and so the request in
      Triton. Its send buffer is limits.send_buffer_bytes."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class BoundedHTTP(AutoHTTPProtocol):
        _stall: asyncio.TimerHandle | None = None
        _headers: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            sock = transport.get_extra_info("socket")
            if sock is not None and limits.send_buffer_bytes:
                with contextlib.suppress(OSError):  # not a TCP socket (a Unix socket): keep the system's
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.send_buffer_bytes)
            self._await_request()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._await_request()

        def _await_request(self) -> None:
            if self._headers is not None:
                self._headers.cancel()
            self._headers = self.loop.call_later(limits.header_seconds, self._no_request, self.cycle)

        def _no_request(self, cycle) -> None:
            self._headers = None
            if self.cycle is cycle and not self.transport.is_closing():  # no request began since
                self.transport.abort()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall is None:
                self._stall = self.loop.call_later(limits.stall_seconds, self._stalled)

        def resume_writing(self) -> None:
            self._unstall()
            super().resume_writing()

        def connection_lost(self, exc) -> None:
            self._unstall()
            if self._headers is not None:
                self._headers.cancel()
            super().connection_lost(exc)

        def _unstall(self) -> None:
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None

        def _stalled(self) -> None:
            self._stall = None
            log.warning(
                "a client read nothing of its response for %g s (stall_seconds): its connection is closed",
                limits.stall_seconds,
            )
            self.transport.abort()  # close() would wait for the unread buffer to drain, which it never does

    return BoundedHTTP
