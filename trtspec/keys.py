"""The keys a deployment's surfaces ask for, and where each comes from.

- the admin key: Triton's model-repository, model-config, shared-memory, statistics, trace and logging APIs answer
  only to a request that carries it (header `trtspec-admin-key`);
- the API key: the OpenAI front answers only to `Authorization: Bearer <key>`, and Triton's inference API bound
  beyond loopback only to the header `trtspec-api-key`;
- the control token: the speculation control receiver answers only to `Authorization: Bearer <token>`.

A key comes from a file the operator names, else from an environment variable, else (where the surface cannot do
without one) it is generated once into a 0600 file under the user's state directory and reused on the next start,
so an operator can read it there. A key is never taken from a command-line value, which `ps` shows to every user.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from trtspec.errors import TrtspecError

ADMIN_ENV = "TRTSPEC_ADMIN_KEY"
API_ENV = "TRTSPEC_API_KEY"
CONTROL_ENV_TOKEN = "TRTSPEC_CONTROL_TOKEN"
ADMIN_HEADER = "trtspec-admin-key"  # Triton's restricted APIs; lower case, as gRPC metadata keys must be
API_HEADER = "trtspec-api-key"  # Triton's inference API when it is bound beyond loopback
# Triton's gRPC front expects the header of --grpc-restricted-protocol as metadata with this prefix ("This protocol is
# restricted, expecting header 'triton-grpc-protocol-<header>'", tritonserver 2.51)
GRPC_PREFIX = "triton-grpc-protocol-"
MIN_LENGTH = 16  # a shorter key is guessable in a day of requests
_KEY_CHARACTERS = re.compile(r"[A-Za-z0-9._+/-]+")


class KeyProblem(TrtspecError):
    """A key file or variable that cannot be used; the message names it and the fix."""


@dataclass(frozen=True)
class Key:
    value: str
    source: str  # where it came from, for the operator: "file PATH", "$NAME", "generated into PATH"
    path: Path | None = None  # the file that holds it, when there is one

    def __repr__(self) -> str:  # never in a log or a traceback
        return f"Key(source={self.source!r})"

    def matches(self, given: str | bytes | None) -> bool:
        """Whether `given` is this key, compared in constant time."""
        if given is None:
            return False
        if isinstance(given, str):
            given = given.encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given, self.value.encode())


def state_dir(repo: str | os.PathLike[str] | None = None) -> Path:
    """Where generated keys live: `$XDG_STATE_HOME/trtspec` (`~/.local/state/trtspec`), one folder per model
    repository (named for it, with a hash of its absolute path), so two deployments on one host get two keys."""
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "trtspec"
    if repo is None:
        return base
    path = Path(repo).resolve()
    return base / f"{path.name}-{hashlib.sha256(str(path).encode()).hexdigest()[:10]}"


def _check(value: str, where: str, fix: str) -> str:
    value = value.strip()
    if len(value) < MIN_LENGTH:
        raise KeyProblem(f"{where} holds a key of {len(value)} characters; {fix} (at least {MIN_LENGTH} characters)")
    if not _KEY_CHARACTERS.fullmatch(value):
        raise KeyProblem(
            f"{where}: a key is letters, digits and . _ + / - (it travels in headers and on Triton's "
            f"command line, where ':' and '=' separate fields); {fix}"
        )
    return value


def read_key_file(path: str | os.PathLike[str], option: str) -> Key:
    path = Path(path).expanduser()
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyProblem(f"{option} {path}: cannot read it ({exc}); give a readable file holding the key") from None
    fix = f"write one with `python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > {path}`"
    return Key(_check(text, f"{option} {path}", fix), f"file {path}", path)


def resolve(
    *,
    file: str | os.PathLike[str] | None,
    option: str,
    env: str,
    generate_into: Path | None = None,
) -> Key | None:
    """The key from `file` (the operator's `option`), else from `$env`, else the one in `generate_into` (created
    there, 0600, the first time); None when none is given and none may be generated."""
    if file is not None:
        return read_key_file(file, option)
    if os.environ.get(env):
        return Key(_check(os.environ[env], f"${env}", f"set {env} to a longer key"), f"${env}")
    if generate_into is None:
        return None
    return _generated(generate_into)


def _generated(path: Path) -> Key:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise KeyProblem(
                f"{path} holds a generated key but other users may read it (mode {mode:o}); "
                f"`chmod 600 {path}`, or remove it to have a new key generated"
            ) from None
        key = read_key_file(path, "the generated key")
        return Key(key.value, f"generated into {path}", path)
    value = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return Key(value, f"generated into {path}", path)


# The headers of the servers this process started (TritonServer.start), by "host:port": the demo's, the benchmarks'
# and the tests' clients reach them without being handed a key.
_STARTED: dict[str, dict[str, str]] = {}


def remember_server(urls: list[str], headers: dict[str, str]) -> None:
    for url in urls:
        _STARTED[url] = dict(headers)


def client_headers(url: str | None = None) -> dict[str, str]:
    """What trtspec's clients of Triton send unless told otherwise: the keys in $TRTSPEC_ADMIN_KEY (model configs,
    which `validate` and `bench` read) and $TRTSPEC_API_KEY (inference, where Triton is bound beyond loopback), over
    those of a server at `url` that this process started."""
    pairs = ((ADMIN_HEADER, ADMIN_ENV), (API_HEADER, API_ENV))
    given = {header: os.environ[env].strip() for header, env in pairs if os.environ.get(env)}
    return _STARTED.get(url or "", {}) | given
