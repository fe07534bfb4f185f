"""Typed errors shared across trtspec. Each carries a message meant for the user: what, where, and the fix."""

from __future__ import annotations

from dataclasses import dataclass


class TrtspecError(Exception):
    """Base class: the CLI prints these without a traceback."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a user's input, reported together with all the others."""

    field: str
    value: object
    message: str
    fix: str = ""

    def __str__(self) -> str:
        value = repr(self.value)
        if len(value) > 120:
            value = value[:117] + "..."
        text = f"{self.field} = {value}: {self.message}"
        return f"{text}\n    fix: {self.fix}" if self.fix else text


class ConfigError(TrtspecError):
    """A build config with one or more problems; all of them are listed."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = problems
        lines = [f"{source}: {len(problems)} problem{'s' if len(problems) != 1 else ''}"]
        lines += [f"  - {p}" for p in problems]
        super().__init__("\n".join(lines))


class CheckpointError(TrtspecError):
    """A checkpoint that is missing, corrupt or of an architecture the engine cannot run."""


class EngineError(TrtspecError):
    """An engine dir that cannot be loaded, or a request the engine cannot serve."""


class EngineUnavailable(EngineError):
    """An engine model that cannot answer now: its process died, or it is being loaded again. The server's fault
    and a passing one: the request may be retried (UNAVAILABLE, HTTP 503)."""


class EngineBusy(EngineError):
    """An engine model whose waiting queue is full (max_queue_size): refused at once, the server's fault and a
    passing one (UNAVAILABLE, HTTP 503: retry later). Not an EngineUnavailable: nothing died, so a request that meets
    it ends rather than waiting for a reload, and the queue stays bounded."""


class RequestError(EngineError):
    """A request that breaks the engine's limits or the tensor contract; names the field and the limit."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class DeadlineExceeded(RequestError):
    """A request that ran past its timeout_ms: named as the field, counted apart from bad requests."""

    def __init__(self, message: str):
        super().__init__("timeout_ms", message)


class Cancelled(Exception):
    """The client went away: the request stops where it is (its engine calls are stopped) and nothing is returned."""


class BenchError(TrtspecError):
    """A benchmark that cannot run: bad options, unreadable prompts, an unreachable deployment."""


class ServerError(TrtspecError, RuntimeError):
    """The Triton server could not be found, prepared, started, or it died. A TrtspecError: the CLI prints it as
    its other errors (no traceback, exit code 2); still a RuntimeError for callers that catch that."""
