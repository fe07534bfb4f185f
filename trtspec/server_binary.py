"""Finding a `tritonserver`, and preparing the one shipped in the `nvidia-pytriton` wheel to run.

Three kinds are supported: the NVIDIA container's (`/opt/tritonserver`), one on `PATH` or given explicitly, and the
wheel's. The wheel's binary needs a backend directory assembled from its parts and an environment that lets the Python
backend stub find the running interpreter's libpython and packages; both are prepared here.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trtspec.errors import ServerError

CONTAINER_BINARY = Path("/opt/tritonserver/bin/tritonserver")
CONTAINER_BACKENDS = Path("/opt/tritonserver/backends")


# The wheel's tritonserver (2.51) predates Triton 25.07's fixes for an unauthenticated chain through the Python backend
# and the shared-memory API (NVIDIA's bulletin for CVE-2025-23319, -23320, -23334): a development server.
DEV_SERVER_NOTE = (
    "development only: Triton 2.51 predates the fixes for CVE-2025-23319/23320/23334; `trtspec serve` keeps it on "
    "loopback unless told --allow-dev-server-exposure"
)


@dataclass(frozen=True)
class ServerBinary:
    path: Path
    kind: str  # "flag" | "container" | "path" | "pytriton"
    backend_dir: Path | None = None  # passed as --backend-directory when set
    env_additions: dict[str, str] = field(default_factory=dict)  # full values to override

    def environ(self) -> dict[str, str]:
        return {**os.environ, **self.env_additions}

    @property
    def is_dev_server(self) -> bool:
        """The nvidia-pytriton wheel's tritonserver (DEV_SERVER_NOTE)."""
        return is_pytriton_layout(self.path)


# --------------------------------------------------------------------------- finding the binary


def _pytriton_root() -> Path | None:
    """`<site-packages>/pytriton`, located without importing pytriton (its import is heavy)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def is_pytriton_layout(binary: Path) -> bool:
    # <site-packages>/pytriton/tritonserver/bin/tritonserver next to python_backend_stubs/
    return (binary.parent.parent / "python_backend_stubs").is_dir()


def find_tritonserver(
    explicit: str | os.PathLike[str] | None = None, *, cache_dir: str | os.PathLike[str] | None = None
) -> ServerBinary:
    """Locate a `tritonserver`; for the wheel's binary also prepare its backend dir and environment.

    Order: `explicit`, the NVIDIA container's, `tritonserver` on PATH, the `nvidia-pytriton` wheel's.
    """
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file() or not os.access(path, os.X_OK):
            problem = "does not exist" if not path.exists() else "is not an executable file"
            raise ServerError(
                f"tritonserver binary {path} {problem}. Pass the path of an executable `tritonserver` "
                "with --tritonserver PATH, or leave the flag out to use the one shipped in nvidia-pytriton."
            )
        path = path.resolve()
        if is_pytriton_layout(path):
            return _prepare_pytriton(path, "flag", cache_dir)
        return ServerBinary(path, "flag")

    looked: list[str] = [str(CONTAINER_BINARY)]
    if CONTAINER_BINARY.is_file() and os.access(CONTAINER_BINARY, os.X_OK):
        # The container's server finds its backends in its default directory; nothing to prepare.
        return ServerBinary(CONTAINER_BINARY, "container", CONTAINER_BACKENDS)

    looked.append("`tritonserver` on PATH")
    on_path = shutil.which("tritonserver")
    if on_path:
        path = Path(on_path).resolve()
        if is_pytriton_layout(path):
            return _prepare_pytriton(path, "path", cache_dir)
        return ServerBinary(path, "path")

    root = _pytriton_root()
    if root is None:
        looked.append("the nvidia-pytriton package (not installed)")
    else:
        path = root / "tritonserver" / "bin" / "tritonserver"
        looked.append(str(path))
        if path.is_file():
            return _prepare_pytriton(path, "pytriton", cache_dir)

    raise ServerError(
        "no tritonserver found. Looked at: " + "; ".join(looked) + ". "
        "Install it with `pip install nvidia-pytriton==0.7.0` (ships tritonserver 2.51), run inside an "
        "NVIDIA Triton container, or pass --tritonserver PATH."
    )


# --------------------------------------------------------------------------- the wheel's binary


def _pytriton_environment(binary: Path) -> dict[str, str]:
    """LD_LIBRARY_PATH and PATH that let the Python backend stub use the running interpreter."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        raise ServerError(
            f"the interpreter {sys.executable} has no shared libpython (it was built without "
            "--enable-shared), which the Triton Python backend stub needs to load. Use an interpreter "
            "built with --enable-shared: e.g. with pyenv, `PYTHON_CONFIGURE_OPTS=--enable-shared pyenv "
            "install 3.11`, or Debian/Ubuntu's python3, then recreate the virtual environment."
        )
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "python3").exists():
        # The stub imports packages from the `python3` first on PATH.
        raise ServerError(
            f"{bin_dir} has no `python3`; the Triton Python backend stub runs the `python3` first on "
            f"PATH, so model packages would come from another interpreter. Run trtspec from a virtual "
            f"environment (which has bin/python3) or add a python3 link next to {sys.executable}."
        )
    # The interpreter's own libpython first: otherwise the stub may bind another patch release's
    # libpython (e.g. the system one) and C extensions then fail with undefined symbols.
    libs = [sysconfig.get_config_var("LIBDIR"), str(binary.parents[3] / "nvidia_pytriton.libs")]
    return {
        "LD_LIBRARY_PATH": _prepend(libs, os.environ.get("LD_LIBRARY_PATH")),
        "PATH": _prepend([str(bin_dir)], os.environ.get("PATH")),
    }


def _prepend(first: Sequence[str | None], existing: str | None) -> str:
    parts = [p for p in first if p] + ([existing] if existing else [])
    return os.pathsep.join(parts)


def _prepare_pytriton(binary: Path, kind: str, cache_dir: str | os.PathLike[str] | None) -> ServerBinary:
    env = _pytriton_environment(binary)
    return ServerBinary(binary, kind, prepare_backend_dir(binary.parents[1], cache_dir), env)


def _default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trtspec" / "triton-backends"


def prepare_backend_dir(tritonserver_root: Path, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Assemble `<dir>/python/` from the wheel's Python backend and the stub for this Python.

    The directory is keyed by Python version and a hash of the source files, so it is reused across
    runs; it is built in a temporary directory and renamed into place, so concurrent callers are safe.
    """
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    backend = tritonserver_root / "backends" / "python"
    stub = tritonserver_root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        stubs_dir = tritonserver_root / "python_backend_stubs"
        have = sorted(p.name for p in stubs_dir.iterdir()) if stubs_dir.is_dir() else []
        raise ServerError(
            f"the installed nvidia-pytriton has no Python backend stub for Python {version} "
            f"(it has: {', '.join(have) or 'none'}). Run trtspec with one of those Python versions."
        )
    sources = {
        "libtriton_python.so": backend / "libtriton_python.so",
        "triton_python_backend_utils.py": backend / "triton_python_backend_utils.py",
        "triton_python_backend_stub": stub,
    }
    for src in sources.values():
        if not src.is_file():
            raise ServerError(f"{src} is missing: the nvidia-pytriton install is incomplete; reinstall it.")

    digest = hashlib.sha256()
    for name, src in sources.items():
        digest.update(name.encode())
        digest.update(src.read_bytes())
    root = Path(cache_dir) if cache_dir is not None else _default_cache_root()
    final = root / f"{version}-{digest.hexdigest()[:16]}"
    if all((final / "python" / n).is_file() for n in sources):
        return final

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        (tmp / "python").mkdir()
        for name, src in sources.items():
            shutil.copy2(src, tmp / "python" / name)  # copies keep working if the wheel is reinstalled
        try:
            os.rename(tmp, final)
        except OSError as exc:
            # Another process finished first; its directory has the same content.
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
