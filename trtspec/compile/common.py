"""What every backend's build shares: input fingerprints, skip-if-unchanged, atomic engine dirs, and steps that run
as logged subprocesses.

A fingerprint covers the inputs (each file's size and checksum) and the settings. Checkpoints of tens or hundreds of
gigabytes take minutes to checksum, so large files may be described by size and modification time instead
(`hash_limit`); a manifest's output entries carry either a checksum or size + mtime, and `is_up_to_date` compares
whichever the entry has."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
from collections import deque
from contextlib import contextmanager
from pathlib import Path

from trtspec.checkpoint import CheckpointInfo
from trtspec.engine.manifest import MANIFEST_FILE, read_manifest
from trtspec.errors import TrtspecError


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def source_files(info: CheckpointInfo) -> list[Path]:
    """The files a checkpoint is made of; a draft that takes weights from its target includes the target's."""
    if info.is_gguf:
        return [info.path]
    own = sorted(p for p in info.path.iterdir() if p.is_file() and not p.name.startswith("."))
    return own + (source_files(info.shared.target) if info.shared is not None else [])


def describe_sources(info: CheckpointInfo, *, hash_limit: int | None = None) -> list[dict]:
    """Each source file with its size and checksum: what the manifest records and the skip test compares.
    Files larger than `hash_limit` bytes are described by size and modification time instead of a checksum."""
    return [describe_file(p, str(p), hash_limit=hash_limit) for p in source_files(info)]


def describe_file(path: Path, name: str, *, hash_limit: int | None = None) -> dict:
    stat = path.stat()
    if hash_limit is not None and stat.st_size > hash_limit:
        return {"file": name, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    return {"file": name, "bytes": stat.st_size, "sha256": sha256_file(path)}


def file_unchanged(path: Path, entry: dict) -> bool:
    """A file still as a manifest entry describes it (checksum, or size and mtime)."""
    if not path.is_file():
        return False
    stat = path.stat()
    if stat.st_size != entry.get("bytes"):
        return False
    if "sha256" in entry:
        return sha256_file(path) == entry["sha256"]
    return stat.st_mtime_ns == entry.get("mtime_ns")


def fingerprint(sources: list[dict], settings: dict) -> str:
    blob = json.dumps({"sources": sources, "settings": settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def is_up_to_date(engine_dir: Path, expected: str) -> bool:
    """A finished build of the same inputs whose outputs are still as written."""
    manifest = read_manifest(engine_dir)
    if not manifest or manifest.get("fingerprint") != expected:
        return False
    return all(file_unchanged(engine_dir / entry["file"], entry) for entry in manifest.get("outputs", []))


def describe_outputs(engine_dir: Path, *, hash_limit: int | None = None) -> list[dict]:
    return [
        describe_file(p, p.relative_to(engine_dir).as_posix(), hash_limit=hash_limit)
        for p in sorted(engine_dir.rglob("*"))
        if p.is_file() and p.name != MANIFEST_FILE
    ]


@contextmanager
def atomic_dir(final: Path):
    """Yield a scratch dir beside `final`; on success it replaces `final`, on failure it is removed.
    A failed build therefore never leaves a dir that looks complete."""
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        yield scratch
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    scratch.rename(final)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


# ---- steps that run as subprocesses ---------------------------------------------------------------------------


class StepFailed(TrtspecError):
    """A build step's command failed: names the step, the command and the end of its log."""

    def __init__(self, step: str, argv: list[str], returncode: int | None, tail: list[str], log_path: Path | None):
        self.step, self.argv, self.returncode, self.tail, self.log_path = step, argv, returncode, tail, log_path
        how = "could not start" if returncode is None else f"exited with code {returncode}"
        lines = [f"step '{step}' failed: the command {how}", f"  command: {shlex.join(argv)}"]
        if log_path is not None:
            lines.append(f"  log: {log_path}")
        if tail:
            lines.append(f"  last {len(tail)} lines:")
            lines += [f"    {line}" for line in tail]
        super().__init__("\n".join(lines))


def run_logged(
    step: str,
    argv: list[str],
    *,
    log_path: Path,
    cwd: Path | None = None,
    env: dict | None = None,
    on_line=None,
    tail_lines: int = 30,
) -> None:
    """Run `argv`, writing its output (stdout and stderr) to `log_path` and passing each line to `on_line` as it
    arrives; raises StepFailed with the last `tail_lines` lines when it cannot start or exits non-zero.
    Progress bars that redraw with carriage returns count as lines."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tail: deque[str] = deque(maxlen=tail_lines)
    with open(log_path, "w", encoding="utf-8", errors="replace") as log:
        log.write(f"$ {shlex.join(argv)}\n")
        log.flush()
        try:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env={**os.environ, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            log.write(f"{exc}\n")
            raise StepFailed(step, argv, None, [str(exc)], log_path) from exc
        try:
            pending = b""
            while chunk := proc.stdout.read1(65536):
                pending += chunk
                *lines, pending = pending.replace(b"\r", b"\n").split(b"\n")
                for raw in lines:
                    _emit(raw, log, tail, on_line)
            if pending:
                _emit(pending, log, tail, on_line)
            proc.wait()
        except BaseException:
            proc.kill()  # Ctrl-C or a display error: do not leave a GPU job running
            proc.wait()
            raise
    if proc.returncode != 0:
        raise StepFailed(step, argv, proc.returncode, list(tail), log_path)


def _emit(raw: bytes, log, tail: deque, on_line) -> None:
    line = raw.decode("utf-8", errors="replace").rstrip()
    if not line:
        return
    log.write(line + "\n")
    log.flush()
    tail.append(line)
    if on_line is not None:
        on_line(line)
