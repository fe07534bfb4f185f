"""Start, health-check and stop a Triton Inference Server for a model repository (the binary is found by
trtspec.server_binary), with its admin APIs behind a key and its inference API behind another beyond loopback."""

from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from http.client import HTTPException
from pathlib import Path
from typing import TYPE_CHECKING

from trtspec import keys
from trtspec.calibration import CALIBRATION_ENV
from trtspec.control import CONTROL_ENV, is_loopback
from trtspec.errors import ServerError
from trtspec.server_binary import ServerBinary, find_tritonserver
from trtspec.triton.kv_watch import METRICS_ENV

if TYPE_CHECKING:
    from rich.console import Console


# How long `trtspec serve` waits for readiness unless told: a base for the backend (TensorRT engines also
# deserialize and allocate the KV cache) plus the engines' bytes read at a slow network volume's rate. A 405B
# pair over 8 GPUs (about 406 GB) gets about 33 minutes; the embedded demo pair about 3.
START_BASE_SECONDS = {"torch": 180.0, "trtllm": 600.0}
START_READ_BYTES_PER_SECOND = 250e6


def start_timeout_for(repo: str | os.PathLike[str]) -> float:
    """The readiness wait for a repository written by `trtspec deploy`, from its backend and its engines' size
    (its marker file names both); 180 s for any other repository."""
    from trtspec.marker import read_marker

    marker = read_marker(repo)
    if marker is None:
        return START_BASE_SECONDS["torch"]
    engines = (marker.get("engines") or {}).values()
    size = sum(f.stat().st_size for d in engines if Path(d).is_dir() for f in Path(d).rglob("*") if f.is_file())
    return (
        START_BASE_SECONDS.get(marker.get("backend"), START_BASE_SECONDS["trtllm"]) + size / START_READ_BYTES_PER_SECOND
    )


# The embedded engines of one deployment (target, draft) are separate processes, each with an OpenMP team.
# When both compute at once on a CPU, GNU OpenMP's default wait (about 300,000 spins before sleeping) keeps a
# thread spinning for a peer that the other process has pushed off its core. Measured on a 2-core machine
# (demo pair, 4 concurrent speculative requests at K=4, against target-only in the same run): 0.19x with the
# default, 0.43x with 10,000 spins, 0.78x with 1,000; one request alone lost nothing measurable.
CPU_ENGINE_ENV = {"GOMP_SPINCOUNT": "1000"}


# Triton's APIs that can change or disclose the deployment: they answer only to the admin key (trtspec.keys). Model
# repository: load (with an uploaded model.py: code execution) and unload; model-config: engine and tokenizer paths;
# shared-memory: the path of the CVE-2025-23319/23320/23334 chain; statistics, trace, logging: what clients sent and
# how the server logs. The names are those 2.51's `--help` lists (health, metadata, inference, shared-memory,
# model-config, model-repository, statistics, trace, logging); Triton's src/restricted_features.h has the same up to
# 2.73 (26.09), and its gRPC front reads the key from metadata prefixed triton-grpc-protocol- (grpc_server.h).
ADMIN_APIS = ("model-repository", "model-config", "shared-memory", "statistics", "trace", "logging")


# --------------------------------------------------------------------------- ports


_GIVEN_PORTS: set[int] = set()
_GIVEN_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` right now (the OS picks it), never one this process was given before: the OS
    may hand a just-released port out again, so a server's three ports asked for in a row could coincide."""
    with _GIVEN_LOCK:
        while True:
            with socket.socket(_family(host), socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _GIVEN_PORTS:
                _GIVEN_PORTS.add(port)
                return port


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        # SO_REUSEADDR as the server sets it: a port in TIME_WAIT is usable, a listening one is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


# --------------------------------------------------------------------------- log reasons

# Lines that look like errors but are expected on a machine without a GPU.
_NOISE = re.compile(
    r"Failed to initialize NVML|CUDA driver version is insufficient|CudaDriverHelper has not been "
    r"initialized|DCGM|pinned memory|Unable to get CUDA device count|GPU metrics",
    re.IGNORECASE,
)
_RELEVANT = re.compile(
    r"^E\d{4} |failed to load|error:|already in use|address in use|unexpected|unrecognized|"
    r"Failed to initialize Python stub|Traceback|ModuleNotFoundError|ImportError|"
    r"cannot open shared object|undefined symbol|failed to start|Unable to find",
    re.IGNORECASE,
)
_MODEL_FAILED = re.compile(r"failed to load '[^']+' version")
_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] ")
# The server exits on these when started with --exit-on-error true; stopping at once saves its
# shutdown (which unloads every model that did load).
_FATAL = re.compile(r"failed to load '|error: creating server|failed to start \w+ service")


def failure_reason(log_text: str, max_lines: int = 20) -> str:
    """The server's own explanation of a failure, from its log, without GPU-less noise."""
    # Status tables (lines starting with + or |) only repeat what the log lines say.
    lines = [ln for ln in log_text.splitlines() if ln.strip() and ln[0] not in "+|" and not _NOISE.search(ln)]
    # A model load failure line carries the model's own error; the other lines repeat it.
    picked = (
        [ln for ln in lines if _MODEL_FAILED.search(ln)] or [ln for ln in lines if _RELEVANT.search(ln)] or lines[-5:]
    )
    out: list[str] = []
    for ln in picked:
        msg = _PREFIX.sub("", ln).strip()
        if len(msg) >= 2 and msg[0] == msg[-1] == '"':
            msg = msg[1:-1]
        # Messages hold escaped newlines (tracebacks); unfold them, indented.
        parts = [p.rstrip() for p in msg.replace('\\"', '"').split("\\n") if p.strip()]
        msg = "\n    ".join(parts)
        if msg and msg not in out:
            out.append(msg)
    return "\n".join(out[-max_lines:])


# --------------------------------------------------------------------------- the server


class TritonServer:
    """A `tritonserver` process for one model repository, bound to `host` (loopback by default)."""

    def __init__(
        self,
        repo: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        binary: str | None = None,
        log_file: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        model_control_explicit_models: Sequence[str] | None = None,
        backend_cache_dir: str | os.PathLike[str] | None = None,
        exit_timeout: int = 10,
        launch=None,
        control_file: str | os.PathLike[str] | None = None,
        calibration_file: str | os.PathLike[str] | None = None,
        metrics_host: str | None = None,
        admin_key: keys.Key | None = None,
        api_key: keys.Key | None = None,
        allow_dev_server_exposure: bool = False,
    ) -> None:
        self.repo = Path(repo)
        # Triton's admin APIs (ADMIN_APIS) answer only to this key: the operator's (--admin-key-file,
        # $TRTSPEC_ADMIN_KEY) or one generated for this repository and kept beside the user's other state.
        self.admin_key = admin_key or keys.resolve(
            file=None,
            option="--admin-key-file",
            env=keys.ADMIN_ENV,
            generate_into=keys.state_dir(repo) / "admin-key",
        )
        # Triton's inference API beyond loopback answers only to this key (header trtspec-api-key).
        self.api_key = api_key
        self.allow_dev_server_exposure = allow_dev_server_exposure
        # the file through which `trtspec serve --control-port` forces the BLS's governor (trtspec.control)
        self.control_file = control_file
        # the file the BLS reads the engines' measured costs from (trtspec.calibration), kept up to date by serve
        self.calibration_file = calibration_file
        # trtspec.deploy.launch.Launch: run under mpirun in TensorRT-LLM's orchestrator mode (trtllm deployments).
        self.launch = launch
        self.host = host
        self.metrics_host = metrics_host or host
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.binary = binary
        self.extra_args = tuple(extra_args)
        self.explicit_models = None if model_control_explicit_models is None else list(model_control_explicit_models)
        self.backend_cache_dir = backend_cache_dir
        self.exit_timeout = exit_timeout
        self._log_path: Path | None = Path(log_file) if log_file is not None else None
        self._proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None  # of the last server process, once it has exited
        self._atexit_registered = False

    # endpoints ------------------------------------------------------------

    @property
    def _client_host(self) -> str:
        return client_host(self.host)

    @property
    def http_url(self) -> str:
        """`host:port`, as tritonclient.http wants it."""
        return f"{self._client_host}:{self.http_port}"

    @property
    def http_base_url(self) -> str:
        return f"http://{self.http_url}"

    @property
    def grpc_url(self) -> str:
        """`host:port`, as tritonclient.grpc wants it."""
        return f"{self._client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{client_host(self.metrics_host)}:{self.metrics_port}/metrics"

    @property
    def restricts_inference(self) -> bool:
        """Whether Triton's inference API asks for the API key: it does wherever Triton is bound beyond loopback."""
        return not is_loopback(self.host)

    @property
    def admin_headers(self) -> dict[str, str]:
        """The headers a client of Triton's admin APIs (model config, repository, ...) sends."""
        return {keys.ADMIN_HEADER: self.admin_key.value}

    @property
    def inference_headers(self) -> dict[str, str]:
        """The headers an inference request sends: the API key where inference asks for it."""
        return {keys.API_HEADER: self.api_key.value} if self.restricts_inference and self.api_key else {}

    @property
    def client_headers(self) -> dict[str, str]:
        """The headers trtspec's own clients of this server send: the admin key, and the API key where inference
        asks for it."""
        return self.admin_headers | self.inference_headers

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stub_pids(self, model: str) -> list[int]:
        """The Python backend stub processes serving `model` (instance `<model>_0_0`, as the stub is named)."""
        if not self.is_running():
            return []
        name = f"{model}_0_0".encode()
        return [pid for pid, args in _group_processes(os.getpgid(self.pid)) if name in args]

    def memory_bytes(self) -> int:
        """Resident memory of tritonserver and its stub processes together (0 when it is not running)."""
        return sum(self.memory_by_process().values())

    def memory_by_process(self) -> dict[str, int]:
        """Resident memory of tritonserver and of each stub (named by its model instance, e.g.
        `tensorrt_llm_0_0`); empty when it is not running."""
        if not self.is_running():
            return {}
        out: dict[str, int] = {}
        for pid, args in _group_processes(os.getpgid(self.pid)):
            name = (
                "tritonserver"
                if pid == self.pid
                else next((a.decode() for a in args if _INSTANCE_NAME.search(a)), f"pid {pid}")
            )
            out[name] = out.get(name, 0) + _rss_bytes(pid)
        return out

    def is_ready(self, timeout: float = 1.0) -> bool:
        # The metrics service starts a moment after the HTTP one reports ready: wait for both.
        return self._answers(f"{self.http_base_url}/v2/health/ready", timeout) and self._answers(
            self.metrics_url, timeout
        )

    @staticmethod
    def _answers(url: str, timeout: float) -> bool:
        # No proxies: HTTP(S)_PROXY must not capture a loopback health check.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(url, timeout=timeout) as resp:
                return resp.status == 200
        except (OSError, HTTPException):  # URLError is an OSError
            return False

    def failure_reason(self) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        return failure_reason(self._log_path.read_text(errors="replace"))

    # lifecycle ------------------------------------------------------------

    def command(self, binary: ServerBinary) -> list[str]:
        cmd = [str(binary.path), "--model-repository", str(self.repo.resolve())]
        if binary.backend_dir is not None:
            cmd += ["--backend-directory", str(binary.backend_dir)]
        cmd += [
            "--http-address",
            self.host,
            "--http-port",
            str(self.http_port),
            "--grpc-address",
            self.host,
            "--grpc-port",
            str(self.grpc_port),
            # --metrics-address is listed by 2.51's --help (it defaults to the HTTP address).
            "--metrics-address",
            self.metrics_host,
            "--metrics-port",
            str(self.metrics_port),
            "--allow-metrics",
            "true",
            "--log-verbose",
            "0",
            # A model that fails to load makes the server exit instead of serving without it; the
            # log then holds the model's own reason, which start() reports.
            "--exit-on-error",
            "true",
            # Ready only once every model is loaded.
            "--strict-readiness",
            "true",
            # On SIGTERM the server waits this long for in-flight requests and for clients to close
            # their keep-alive connections (Triton's default, 30 s, makes every stop slow).
            "--exit-timeout-secs",
            str(self.exit_timeout),
        ]
        cmd += self.restriction_args()
        if self.explicit_models is not None:
            cmd += ["--model-control-mode", "explicit"]
            for name in self.explicit_models:
                cmd += ["--load-model", name]
        elif self.launch is None and self._backend() != "trtllm":
            # Every model, under explicit model control: the BLS can then load an embedded engine model again whose
            # stub process died (trtspec.triton.recovery, through the in-process API, which the restrictions below
            # do not touch). TensorRT-LLM's engines run inside the server, so their repositories keep Triton's
            # default, `none`: no model can be loaded or unloaded at all.
            cmd += ["--model-control-mode", "explicit", "--load-model", "*"]
        cmd += list(self.extra_args)
        return self.launch.command(cmd) if self.launch is not None else cmd

    def restriction_args(self) -> list[str]:
        """Triton's flags that put its admin APIs behind the admin key, and its inference API behind the API key
        where it is bound beyond loopback. Triton takes a key only on its command line; run it where other users
        cannot read its /proc (a container has its own process namespace; on a shared host, mount /proc with
        hidepid=2)."""
        rules = [(ADMIN_APIS, keys.ADMIN_HEADER, self.admin_key)]
        if self.restricts_inference and self.api_key is not None:
            rules.append((("inference",), keys.API_HEADER, self.api_key))
        args = []
        for apis, header, key in rules:
            value = f"{','.join(apis)}:{header}={key.value}"
            args += [f"--http-restricted-api={value}", f"--grpc-restricted-protocol={value}"]
        return args

    def _backend(self) -> str | None:
        from trtspec.marker import read_marker

        return (read_marker(self.repo) or {}).get("backend")

    def check_exposure(self, binary: ServerBinary) -> None:
        """Refuse to bind beyond loopback what must not be there: Triton's inference API without a key, and the
        wheel's development server at all unless told."""
        if is_loopback(self.host):
            return
        if self.api_key is None:
            raise ServerError(
                f"--host {self.host} puts Triton's inference API on the network, which needs a key: give one with "
                "--api-key-file FILE or $TRTSPEC_API_KEY (clients then send the header trtspec-api-key), or keep "
                "Triton on 127.0.0.1 and expose the OpenAI front alone (--openai-port 9000 --openai-host 0.0.0.0)."
            )
        if binary.is_dev_server and not self.allow_dev_server_exposure:
            raise ServerError(
                f"--host {self.host}: the tritonserver of the nvidia-pytriton wheel ({binary.path}) is Triton 2.51, "
                "which predates the fixes for CVE-2025-23319/23320/23334; serve on 127.0.0.1 (the OpenAI front can "
                "still be exposed with --openai-host), run a Triton of 25.07 or later (--tritonserver PATH, or the "
                "image of docker/Dockerfile), or pass --allow-dev-server-exposure to accept the risk."
            )

    def environ_additions(self) -> dict[str, str]:
        """Environment variables the launch sets on top of the binary's (TRTLLM_ORCHESTRATOR, ...)."""
        control = {CONTROL_ENV: str(self.control_file)} if self.control_file is not None else {}
        control[METRICS_ENV] = self.metrics_url  # the BLS reads the target's KV-cache blocks there
        if self.calibration_file is not None:
            control[CALIBRATION_ENV] = str(self.calibration_file)
        if self.launch is not None:  # TensorRT-LLM under mpirun: no embedded engines
            return dict(self.launch.env) | control
        return {k: os.environ.get(k, v) for k, v in CPU_ENGINE_ENV.items()} | control  # the user's own setting wins

    def start(self, timeout: float | None = None) -> TritonServer:
        """Launch the server and wait until /v2/health/ready answers 200; ServerError otherwise. `timeout`:
        seconds to wait for readiness [default: start_timeout_for(the repository)]."""
        if self.is_running():
            return self
        if not self.repo.is_dir():
            raise ServerError(f"model repository {self.repo} is not a directory.")
        ports = {"--http-port": self.http_port, "--grpc-port": self.grpc_port, "--metrics-port": self.metrics_port}
        if len(set(ports.values())) != len(ports):
            raise ServerError(f"the HTTP, gRPC and metrics ports must differ (got {ports}).")
        for flag, port in ports.items():
            host = self.metrics_host if flag == "--metrics-port" else self.host
            if not _port_is_free(host, port):
                raise ServerError(f"port {port} on {host} is already in use; free it or choose another with {flag}.")
        binary = find_tritonserver(self.binary, cache_dir=self.backend_cache_dir)
        self.check_exposure(binary)

        if self._log_path is None:
            fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)
            self._log_path = Path(name)
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._log_path, "wb") as log:
            # Own process group, so stop() also reaches the Python backend stubs it forks.
            self._proc = proc = subprocess.Popen(
                self.command(binary),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**binary.environ(), **self.environ_additions()},
                start_new_session=True,
            )
        if not self._atexit_registered:
            atexit.register(self.stop)
            self._atexit_registered = True

        timeout = start_timeout_for(self.repo) if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                self._fail(f"tritonserver exited with code {proc.returncode} during startup")
            if self.is_ready(timeout=1.0):
                keys.remember_server([self.http_url, self.grpc_url], self.client_headers)
                return self
            if _FATAL.search(self._log_path.read_text(errors="replace")):
                self._fail("tritonserver failed during startup")
            if time.monotonic() > deadline:
                self._fail(
                    f"tritonserver did not become ready within {timeout:.0f} s (give `trtspec serve` a longer "
                    "--start-timeout if the models are still loading: see the log)"
                )
            time.sleep(0.2)

    def _fail(self, what: str) -> None:
        self.stop(grace=5.0)  # the server is already exiting on its own (--exit-on-error)
        reason = self.failure_reason() or "(the log has no error lines)"
        raise ServerError(f"{what}. Server log: {self._log_path}\n{reason}")

    def stop(self, grace: float | None = None) -> None:
        """Stop the server: SIGTERM, then SIGKILL to its group after `grace` seconds (default: the
        exit timeout plus time to unload models). Idempotent."""
        if grace is None:
            grace = self.exit_timeout + 10.0
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if self._atexit_registered:
            atexit.unregister(self.stop)
            self._atexit_registered = False
        if proc.poll() is None:
            # SIGTERM to the server alone: it unloads its models and stops its stubs, which frees
            # their shared memory. Signalling the stubs as well would leave it waiting on dead stubs.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left of the group (a hung server, stubs of a crashed one) is killed, and the
        # shared-memory regions those stubs used are removed, since nothing else would.
        pgid = proc.pid  # start_new_session made the server its group leader
        regions = _stub_shm_regions(pgid)
        _killpg(pgid, signal.SIGKILL)
        proc.wait()
        for name in regions:
            Path("/dev/shm", name).unlink(missing_ok=True)
        _wait_group_gone(pgid, timeout=5.0)
        self.returncode = proc.returncode

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def client_host(host: str) -> str:
    """How a client on this machine reaches a server bound to `host`: a wildcard bind through loopback; IPv6
    literals in brackets, as URLs want them."""
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_group_gone(pgid: int, timeout: float) -> None:
    # Killed stubs are orphans reaped by init; wait so callers see no process of ours left.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)


def _group_processes(pgid: int):
    """(pid, command-line arguments) of every live process in group `pgid`: tritonserver and its stubs."""
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # Fields after the parenthesised command: state, ppid, pgrp, ...
            if int(stat[stat.rindex(")") + 2 :].split()[2]) != pgid:
                continue
            yield int(entry.name), (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue


def _stub_shm_regions(pgid: int) -> list[str]:
    """Shared-memory regions named on the command lines of Python backend stubs in group `pgid`."""
    return [
        a.decode()
        for _, args in _group_processes(pgid)
        for a in args
        if a.startswith(b"triton_python_backend_shm_region_")
    ]


_INSTANCE_NAME = re.compile(rb"^\w+_\d+_\d+$")  # a stub's model instance: <model>_<group>_<index>


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


# --------------------------------------------------------------------------- foreground serving


def run_foreground(
    server: TritonServer,
    console: Console | None = None,
    start_timeout: float | None = None,
    after_start: Callable[[], object] | None = None,
) -> int:
    """Start `server`, run `after_start` (the calibration), print its endpoints, block until Ctrl-C or SIGTERM.
    Returns an exit code; a server that cannot start raises ServerError, which the CLI prints as it prints every
    TrtspecError."""
    from rich.console import Console
    from rich.markup import escape

    console = console or Console()

    def _interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        timeout = start_timeout_for(server.repo) if start_timeout is None else start_timeout
        with console.status(f"starting tritonserver (waiting up to {timeout:.0f} s for its models)…"):
            server.start(timeout)
        if after_start is not None:
            after_start()
        console.print(f"[green]Triton is ready[/green] (pid {server.pid})")
        for label, value in (
            ("HTTP", server.http_base_url),
            ("gRPC", server.grpc_url),
            ("metrics", server.metrics_url),
            ("log", server.log_path),
            ("admin key", server.admin_key.source),
        ):
            console.print(f"  {label:<8} {escape(str(value))}", highlight=False)
        console.print("Press Ctrl-C to stop.")
        while server.is_running():
            time.sleep(0.5)
        server.stop()
        code = server.returncode
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exited with code {code}"
        )
        console.print(f"[red]tritonserver {how} unexpectedly.[/red] Log: {escape(str(server.log_path))}")
        console.print(server.failure_reason(), markup=False, highlight=False)
        return 1
    except KeyboardInterrupt:
        console.print("stopping…")
        return 0
    finally:
        server.stop()
        signal.signal(signal.SIGTERM, previous)
