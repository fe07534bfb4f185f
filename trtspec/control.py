"""Forcing the deployment's speculation level without a restart: an operator's or Alertmanager's hand on the governor.

`trtspec serve --control-port P` runs a small HTTP receiver beside tritonserver and hands the server one control file
(its path in the environment variable TRTSPEC_CONTROL_FILE, which the Python-backend stubs inherit). The receiver
writes the file; every BLS instance reads it (at most twice a second, and only when it changed) and forces its
governor (trtspec.orchestrator.governor) for the time given. The file, not a request to the BLS, because a BLS
model may run several instances and a force must reach each.

    GET  /control        the force in effect, or {"mode": "auto"}
    POST /control        {"mode": "plain" | "reduced" | "speculating" | "auto", "for_seconds": 900, "reason": "..."}
    POST /alertmanager   Alertmanager's webhook (version 4): firing alerts labelled `trtspec_mode` force the most
                         conservative mode they name, for `for_seconds` (renewed as Alertmanager repeats); once none
                         fires, a force that Alertmanager set is released (an operator's stays).

Bound to loopback by default; bound elsewhere it refuses to start without a token, and then every request must
carry `Authorization: Bearer <token>`.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CONTROL_ENV = "TRTSPEC_CONTROL_FILE"
MODES = ("speculating", "reduced", "plain")  # the governor's levels, least to most conservative
DEFAULT_SECONDS = 900.0
MAX_SECONDS = 7 * 86400.0
ALERT_LABEL = "trtspec_mode"  # the label an alert rule sets to ask for a mode
ALERTMANAGER = "alertmanager"
MAX_BODY = 1 << 20


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
    if not isinstance(reason, str) or not reason.strip() or len(reason) > 200:
        raise ControlError("reason: a non-empty string of at most 200 characters")
    return Force(mode, time.time() + float(seconds), reason.strip(), "operator")


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
    names = sorted({labels.get("alertname", "?") for labels in asking})
    return True, Force(mode, time.time() + seconds, "alert " + ", ".join(names), ALERTMANAGER)


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


class ControlServer:
    """The HTTP receiver (a thread); `token`: required of every request when given (and to bind beyond loopback)."""

    def __init__(
        self,
        control_file: str | os.PathLike[str],
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        alert_seconds: float = DEFAULT_SECONDS,
        log=print,
    ):
        if not is_loopback(host) and not token:
            raise ControlError(
                f"--control-host {host} is not loopback: give a token (--control-token-file) that "
                "every request must send as `Authorization: Bearer <token>`"
            )
        self.path, self.token, self.alert_seconds, self.log = Path(control_file), token, alert_seconds, log
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer((host, port), self._handler())
        self.httpd.daemon_threads = True
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

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                if server.token is None:
                    return True
                given = self.headers.get("Authorization", "")
                if hmac.compare_digest(given.encode(), f"Bearer {server.token}".encode()):
                    return True
                self._reply(401, {"error": "Authorization: Bearer <token> is missing or wrong"})
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
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    if not 0 < length <= MAX_BODY:
                        raise ControlError(f"the body must be JSON of 1 to {MAX_BODY} bytes")
                    body = json.loads(self.rfile.read(length))
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
