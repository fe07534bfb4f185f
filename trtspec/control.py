"""Forcing the deployment's speculation level without a restart: an operator's or Alertmanager's hand on the governor.

`trtspec serve --control-port P` runs a small HTTP receiver beside tritonserver and hands the server one control file
(its path in the environment variable TRTSPEC_CONTROL_FILE, which the Python-backend stubs inherit). The receiver
writes the file; every BLS instance reads it (at most twice a second, and only when it changed) and forces its
governor (trtspec.orchestrator.governor) for the time given, under the governor's KV-cache and draft-outage floors,
which no force lifts. The file, not a request to the BLS, because a BLS model may run several instances and a force
must reach each.

    GET  /control        the force in effect, or {"mode": "auto"}
    POST /control        {"mode": "plain" | "reduced" | "speculating" | "auto", "for_seconds": 900, "reason": "..."}
    POST /alertmanager   Alertmanager's webhook (version 4): firing alerts labelled `trtspec_mode` force the most
                         conservative mode they name, for `for_seconds` (renewed as Alertmanager repeats); once none
                         fires, a force that Alertmanager set is released (an operator's stays).

Every request must carry `Authorization: Bearer <token>` (`trtspec serve` takes it from --control-token-file, else
$TRTSPEC_CONTROL_TOKEN, else generates one into a 0600 file and prints where), checked before the body is read, and
a POST must say `Content-Type: application/json`: a web page cannot send that to another origin without a CORS
preflight, which the receiver never answers, so a page open in a local browser cannot force a mode. Each connection
has `TIMEOUT` seconds in all and at most `MAX_CONNECTIONS` are served at once, so clients that send half a request
hold neither threads nor the receiver for long. Bound to loopback by default.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from trtspec.keys import MIN_LENGTH, Key

CONTROL_ENV = "TRTSPEC_CONTROL_FILE"
MODES = ("speculating", "reduced", "plain")  # the governor's levels, least to most conservative
DEFAULT_SECONDS = 900.0
# A force is for an incident or a rollout, and a day covers the longest of those; a longer one is a force forgotten
# (a forced plain is a slowdown nobody sees), so a longer need renews it, as Alertmanager does every repeat.
MAX_SECONDS = 86400.0
MAX_REASON = 200
ALERT_LABEL = "trtspec_mode"  # the label an alert rule sets to ask for a mode
ALERTMANAGER = "alertmanager"
MAX_BODY = 1 << 20
TIMEOUT = 10.0  # seconds a connection may take in all: a request is a few hundred bytes
MAX_CONNECTIONS = 16  # an operator and an Alertmanager or two; more at once is a client holding sockets


class ControlError(ValueError):
    """A control request that cannot be applied; the message names the field."""


@dataclass(frozen=True)
class Force:
    mode: str  # one of MODES
    until: float  # wall-clock time (time.time()) the force ends
    reason: str
    source: str  # "operator" or "alertmanager"

    def remaining(self, now: float | None = None) -> float:
        return self.until - (time.time() if now is None else now)


def parse_request(body: dict) -> Force | None:
    """A POST /control body as a force (None: back to the governor's own judgement)."""
    if not isinstance(body, dict):
        raise ControlError('the body must be a JSON object: {"mode": ..., "for_seconds": ..., "reason": ...}')
    mode = body.get("mode")
    if mode == "auto":
        return None
    if mode not in MODES:
        raise ControlError(f"mode: {mode!r} is not one of {', '.join(MODES + ('auto',))}")
    seconds = body.get("for_seconds", DEFAULT_SECONDS)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= MAX_SECONDS:
        raise ControlError(f"for_seconds: {seconds!r} must be a number of seconds in (0, {MAX_SECONDS:g}]")
    reason = body.get("reason", "operator")
    if not isinstance(reason, str) or not printable(reason) or len(reason) > MAX_REASON:
        raise ControlError(f"reason: a non-empty string of at most {MAX_REASON} characters")
    return Force(mode, time.time() + float(seconds), printable(reason), "operator")


def printable(text: str) -> str:
    """`text` on one line, each run of control or format characters (newlines, escapes, bidi overrides) and spaces
    a single space: a reason is written to the server's log, where a newline could forge a line of its own."""
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


def from_alerts(payload: dict, current: Force | None, seconds: float = DEFAULT_SECONDS) -> tuple[bool, Force | None]:
    """(change?, new force) for an Alertmanager webhook payload: the most conservative mode its firing alerts ask for.
    An operator's force is never overridden by alerts."""
    if not isinstance(payload, dict) or not isinstance(payload.get("alerts"), list):
        raise ControlError('not an Alertmanager webhook payload: it has no "alerts" list')
    asking = [a.get("labels") or {} for a in payload["alerts"] if isinstance(a, dict) and a.get("status") == "firing"]
    asking = [labels for labels in asking if labels.get(ALERT_LABEL) is not None]
    bad = [labels[ALERT_LABEL] for labels in asking if labels[ALERT_LABEL] not in MODES]
    if bad:
        raise ControlError(f"label {ALERT_LABEL}: {bad[0]!r} is not one of {', '.join(MODES)}")
    if current is not None and current.source != ALERTMANAGER and current.remaining() > 0:
        return False, current
    if not asking:
        return current is not None, None
    mode = max((labels[ALERT_LABEL] for labels in asking), key=MODES.index)
    names = sorted({printable(str(labels.get("alertname", "?"))) for labels in asking})
    return True, Force(mode, time.time() + seconds, ("alert " + ", ".join(names))[:MAX_REASON], ALERTMANAGER)


def read(path: str | os.PathLike[str]) -> Force | None:
    """The force in the control file, or None (no file, ended, or unreadable: the governor decides)."""
    try:
        data = json.loads(Path(path).read_text())
        force = Force(**data)
    except (OSError, ValueError, TypeError):
        return None
    if force.mode not in MODES or force.remaining() <= 0:
        return None
    return force


def write(path: str | os.PathLike[str], force: Force | None) -> None:
    """Replace the control file atomically (a reader never sees half of it); None removes it."""
    path = Path(path)
    if force is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(force)))
    os.replace(tmp, path)


class Watcher:
    """The BLS's side: the control file's force, re-read only when the file changed, at most every `interval` s."""

    def __init__(self, path: str | os.PathLike[str] | None, interval: float = 0.5):
        self.path = Path(path) if path else None
        self.interval = interval
        self._checked = float("-inf")
        self._stamp: tuple | None = None
        self.force: Force | None = None

    def poll(self) -> tuple[bool, Force | None]:
        """(changed since the last poll?, the force now)."""
        if self.path is None or time.monotonic() - self._checked < self.interval:
            return False, self.force
        self._checked = time.monotonic()
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = None
        if stamp == self._stamp:
            return False, self.force
        self._stamp = stamp
        force = read(self.path) if stamp else None
        changed = force != self.force
        self.force = force
        return changed, force


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Receiver(ThreadingHTTPServer):
    """A thread per connection, as ThreadingHTTPServer, but at most `max_connections` of them (one more is told 503
    and closed), and each connection shut once it is `deadline` seconds old: a socket timeout alone is per read, and
    a client that sends a byte every few seconds would pass it forever."""

    daemon_threads = True
    BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 10\r\nConnection: close\r\n\r\n"

    def __init__(self, address, handler, *, max_connections: int, deadline: float):
        self.deadline = deadline
        self._slots = threading.BoundedSemaphore(max_connections)
        self._open: dict[socket.socket, float] = {}  # connection -> when it must be done (time.monotonic())
        self._open_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            try:  # a fresh socket's send buffer takes these bytes at once: the accepting thread does not wait
                request.setblocking(False)
                request.send(self.BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        with self._open_lock:
            self._open[request] = time.monotonic() + self.deadline
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._done(request)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done(request)

    def _done(self, request) -> None:
        with self._open_lock:
            if self._open.pop(request, None) is not None:
                self._slots.release()

    def service_actions(self) -> None:
        """Shut the connections past their deadline (serve_forever calls this every poll, 0.5 s): their thread's
        read or write then fails at once and the thread ends."""
        now = time.monotonic()
        with self._open_lock:
            late = [request for request, until in self._open.items() if until <= now]
        for request in late:
            try:
                request.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request, client_address) -> None:
        pass  # a client that went away or was cut off: nothing for the operator's console


class ControlServer:
    """The HTTP receiver (a thread). `token`: what every request must send as `Authorization: Bearer <token>`."""

    def __init__(
        self,
        control_file: str | os.PathLike[str],
        host: str = "127.0.0.1",
        port: int = 0,
        token: Key | str | None = None,
        alert_seconds: float = DEFAULT_SECONDS,
        log=print,
        *,
        timeout: float = TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
    ):
        if isinstance(token, str):
            token = Key(token.strip(), "given")
        if token is None or len(token.value) < MIN_LENGTH:
            raise ControlError(
                f"the control receiver needs a token of at least {MIN_LENGTH} characters that every request sends "
                "as `Authorization: Bearer <token>`: give --control-token-file or $TRTSPEC_CONTROL_TOKEN, or let "
                "`trtspec serve` generate one"
            )
        self.path, self.token, self.alert_seconds, self.log = Path(control_file), token, alert_seconds, log
        self._lock = threading.Lock()
        handler = self._handler()
        handler.timeout = timeout  # each read and write; the receiver's deadline bounds the connection as a whole
        self.httpd = _Receiver((host, port), handler, max_connections=max_connections, deadline=timeout)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="trtspec-control", daemon=True)

    def start(self) -> ControlServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def apply(self, force: Force | None) -> None:
        write(self.path, force)
        self.log(
            f"speculation forced to {force.mode} for {force.remaining():.0f} s ({force.reason}, {force.source})"
            if force
            else "speculation force released: the governor decides"
        )

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # the receiver logs what it applies, not every request
                pass

            def _reply(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                for name, value in ({"Content-Type": "application/json"} | (headers or {})).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                scheme, _, given = self.headers.get("Authorization", "").strip().partition(" ")
                if scheme.lower() == "bearer" and server.token.matches(given.strip()):
                    return True
                self._reply(
                    401,
                    {"error": "Authorization: Bearer <token> is missing or wrong (the token `trtspec serve` names)"},
                    {"WWW-Authenticate": "Bearer"},
                )
                return False

            def do_GET(self) -> None:
                if not self._authorized():
                    return
                if self.path != "/control":
                    return self._reply(404, {"error": "GET /control, POST /control, POST /alertmanager"})
                force = read(server.path)
                self._reply(
                    200,
                    {"mode": "auto"}
                    if force is None
                    else asdict(force) | {"remaining_seconds": round(force.remaining())},
                )

            def do_POST(self) -> None:
                if not self._authorized():
                    return
                if self.path not in ("/control", "/alertmanager"):
                    return self._reply(404, {"error": "GET /control, POST /control, POST /alertmanager"})
                kind = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
                if kind != "application/json":
                    return self._reply(
                        415,
                        {
                            "error": f"Content-Type: {kind or 'none'}; send the JSON body with "
                            "`Content-Type: application/json` (curl: -H 'Content-Type: application/json')"
                        },
                    )
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    if not 0 < length <= MAX_BODY:
                        raise ControlError(f"Content-Length: the body must be JSON of 1 to {MAX_BODY} bytes")
                    data = self.rfile.read(length)
                    if len(data) != length:
                        raise ControlError(f"the body ended after {len(data)} of its {length} bytes")
                    body = json.loads(data)
                    with server._lock:
                        if self.path == "/control":
                            force, changed = parse_request(body), True
                        else:
                            changed, force = from_alerts(body, read(server.path), server.alert_seconds)
                        if changed:
                            server.apply(force)
                except (ControlError, ValueError) as exc:
                    return self._reply(400, {"error": str(exc)})
                self._reply(200, {"mode": "auto"} if force is None else asdict(force))

        return Handler
