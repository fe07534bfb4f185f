"""What every backend's build shares: input fingerprints, skip-if-unchanged, and atomic engine dirs."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from trtspec.checkpoint import CheckpointInfo
from trtspec.engine.manifest import MANIFEST_FILE, read_manifest


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def source_files(info: CheckpointInfo) -> list[Path]:
    if info.is_gguf:
        return [info.path]
    return sorted(p for p in info.path.iterdir() if p.is_file() and not p.name.startswith("."))


def describe_sources(info: CheckpointInfo) -> list[dict]:
    """Each source file with its size and checksum: what the manifest records and the skip test compares."""
    return [{"file": str(p), "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in source_files(info)]


def fingerprint(sources: list[dict], settings: dict) -> str:
    blob = json.dumps({"sources": sources, "settings": settings}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def is_up_to_date(engine_dir: Path, expected: str) -> bool:
    """A finished build of the same inputs whose outputs are still as written."""
    manifest = read_manifest(engine_dir)
    if not manifest or manifest.get("fingerprint") != expected:
        return False
    for entry in manifest.get("outputs", []):
        out = engine_dir / entry["file"]
        if not out.is_file() or out.stat().st_size != entry["bytes"] or sha256_file(out) != entry["sha256"]:
            return False
    return True


def describe_outputs(engine_dir: Path) -> list[dict]:
    return [
        {"file": p.relative_to(engine_dir).as_posix(), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(engine_dir.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE
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
