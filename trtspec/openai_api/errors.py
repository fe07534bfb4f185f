"""OpenAI's error shape: `APIError` (status, message naming the field and the fix), a request's fault (`bad`), the
front's own failure (`internal`), and a failed BLS call read as one of them (`bls_error`)."""

from __future__ import annotations

import logging
import re
import uuid
from typing import Protocol

from trtspec.client import ClientError


class _Named(Protocol):
    """What an error needs of the request (trtspec.openai_api.protocol.Request): the names its fields came under."""

    prompt_param: str
    max_tokens_param: str


log = logging.getLogger("trtspec.openai")


class APIError(Exception):
    """A request that gets an error in OpenAI's shape: `status`, its message (what and the fix), the field."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def internal(exc: BaseException) -> APIError:
    """A failure of the front itself: logged with an id, answered with the id alone (no internal detail)."""
    ref = uuid.uuid4().hex[:12]
    log.error("request failed (error id %s)", ref, exc_info=exc)
    return APIError(
        500,
        f"the server failed on this request (error id {ref}, in its log); retry it",
        code="internal_error",
        headers={"Connection": "close"},  # whatever state the failure left behind goes with the connection
    )


# SpecClient's message: "<model> (<protocol> <url>): <the BLS's message>"; a request error reads "<field>: <why>".
_CLIENT_PREFIX = re.compile(r"^\S+ \((?:grpc|http) [^)]*\): ", re.DOTALL)
_ADDRESS = re.compile(r" \((?:grpc|http) [^)]*\)")
_FIELD = re.compile(r"^(\w+): ")
_UNAVAILABLE = re.compile(
    r"busy|unavailable|failed to connect|connection refused|not ready|is not found|"
    r"unknown model|socket closed|deadline exceeded|no final response",
    re.IGNORECASE,
)


def bls_error(exc: Exception, req: _Named) -> APIError:
    """A failed BLS call as an OpenAI error: the request's fault (400, naming the OpenAI field), the server being
    unreachable or busy (503), anything else (500)."""
    if not isinstance(exc, ClientError):
        return internal(exc)
    message = _ADDRESS.sub("", _CLIENT_PREFIX.sub("", str(exc), count=1))  # Triton's address is internal
    names = {
        "text_input": req.prompt_param,
        "max_tokens": req.max_tokens_param,
        "stop_words": "stop",
        "num_draft_tokens": "num_draft_tokens",
        "speculation": "speculation",
        "temperature": "temperature",
        "top_p": "top_p",
        "seed": "seed",
        "adaptive_draft_length": "adaptive_draft_length",
        "min_tokens": "min_tokens",
        "stream_interval": "stream_interval",
        "prediction": "prediction",
        "presence_penalty": "presence_penalty",
        "frequency_penalty": "frequency_penalty",
    }
    m = _FIELD.match(message)
    if m and m.group(1) in names:
        param = names[m.group(1)]
        return APIError(400, param + message[len(m.group(1)) :], param=param)
    if m and m.group(1) == "timeout_ms":  # the deployment's request_timeout_ms ran out
        return APIError(504, f"the request ran past the deployment's time limit: {message}", code="timeout")
    if _UNAVAILABLE.search(message):
        return APIError(503, f"the inference server cannot take the request now: {message}", code="unavailable")
    return APIError(500, f"the inference server failed: {message}")
