"""Traffic capture: a sample of finished requests, written to JSONL for `trtspec distill --data DIR`.

`trtspec serve --capture DIR` turns it on (off by default); the BLS reads the settings from CAPTURE_ENV. What a record
holds (one JSON object a line, docs/distillation.md "Capture"):
  v, time, model, route      the format's version, when the request finished (UTC), the BLS model, the client's route
  input_ids, output_ids      the prompt's token ids as the engine saw them, and the target's output ids
  text_input, text_output    the same as text (NVIDIA's field names): user data, handle it as such
  temperature, greedy        how the output was sampled (greedy outputs are the target's exact argmax)
  num_draft_tokens, num_accepted_tokens, draft_version   what speculation did on it
Prompts are user data: the files are 0600 in a 0700 directory, and a request sent with `store` false is never
written (the OpenAI field of the same name; see `Capture.offer`).

Nothing here runs on the request path but a random draw and a non-blocking put on a bounded queue: one background
thread encodes and writes. When the disk is slow the queue fills and further records are dropped (and counted),
never waited for. Files rotate at `file_bytes`; past `max_bytes` in all, the oldest files are deleted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from trtspec.errors import TrtspecError

CAPTURE_ENV = "TRTSPEC_CAPTURE"  # JSON of CaptureSettings, set by `trtspec serve --capture`
FORMAT_VERSION = 1
PREFIX, SUFFIX = "capture-", ".jsonl"
DEFAULT_RATE = 0.05
DEFAULT_MAX_MB = 512
QUEUE_RECORDS = 256  # records waiting for the writer; beyond it they are dropped


class CaptureError(TrtspecError):
    """Capture settings that cannot work (a bad rate, size or directory)."""


@dataclass(frozen=True)
class CaptureSettings:
    dir: str
    rate: float = DEFAULT_RATE
    max_bytes: int = DEFAULT_MAX_MB << 20
    file_bytes: int = 0  # 0: max_bytes / 8 (at most 64 MiB), so that the cap deletes an eighth at a time

    def __post_init__(self):
        if not 0.0 <= self.rate <= 1.0:
            raise CaptureError(f"--capture-rate must lie in [0, 1], got {self.rate}")
        if self.max_bytes < 4096:
            raise CaptureError(f"--capture-max-mb must allow at least 4 KiB, got {self.max_bytes} bytes")

    @property
    def rotate_at(self) -> int:
        return self.file_bytes or min(max(self.max_bytes // 8, 1024), 64 << 20)

    def to_env(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls, environ=os.environ) -> CaptureSettings | None:
        raw = environ.get(CAPTURE_ENV)
        if not raw:
            return None
        try:
            return cls(**json.loads(raw))
        except (TypeError, ValueError) as exc:
            raise CaptureError(f"${CAPTURE_ENV} is not capture settings as `trtspec serve` writes them: {exc}") from exc


def prepare_dir(path: str | os.PathLike) -> Path:
    """The capture directory, made 0700 if new; CaptureError naming the fix when it cannot be written."""
    folder = Path(path).expanduser().resolve()
    if folder.exists() and not folder.is_dir():
        raise CaptureError(f"--capture {path}: is a file; give a directory")
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        probe = folder / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise CaptureError(f"--capture {path}: cannot write there ({exc.strerror}); give a writable directory") from exc
    return folder


def capture_files(folder: Path) -> list[Path]:
    """The capture files of a directory, oldest first (names sort by time)."""
    return sorted(p for p in folder.glob(f"{PREFIX}*{SUFFIX}") if p.is_file())


class Capture:
    """The sampler and its background writer. `offer` is the only call on the request path."""

    def __init__(self, settings: CaptureSettings, *, seed: int | None = None, on_error=None, decode=None):
        """`decode(ids) -> str`: the tokenizer's, run by the writer for the text fields a record lacks."""
        self.settings = settings
        self._decode = decode
        self.folder = prepare_dir(settings.dir)
        self._random = random.Random(seed)
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_RECORDS)
        self._on_error = on_error or (lambda message: None)
        self.offered = self.sampled = self.dropped = self.written = self.deleted = 0
        self._file = None
        self._file_path: Path | None = None
        self._serial = 0
        self._thread = threading.Thread(target=self._write_loop, name="trtspec-capture", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, **kwargs) -> Capture | None:
        settings = CaptureSettings.from_env()
        return cls(settings, **kwargs) if settings else None

    # ---- the request path -------------------------------------------------------------------------------------
    def offer(self, record: dict, *, store: bool | None = None) -> bool:
        """Sample a finished request's record and queue it for the writer; never blocks, never touches the disk.
        `store` False (the client asked that nothing be kept) is never sampled. True when queued."""
        self.offered += 1
        if store is False or self._random.random() >= self.settings.rate:
            return False
        self.sampled += 1
        try:
            self._queue.put_nowait((time.time(), record))
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (within `timeout`) and stop the writer."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)

    # ---- the writer thread ------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            try:
                self._write(*item)
                while not self._queue.empty():  # a burst: one flush for all of it
                    nxt = self._queue.get_nowait()
                    if nxt is None:
                        self._flush()
                        self._close_file()
                        return
                    self._write(*nxt)
                self._flush()
            except OSError as exc:  # a full or vanished disk drops records, never the server
                self.dropped += 1
                self._close_file()
                self._on_error(f"capture: a record could not be written to {self.folder}: {exc}")
        self._close_file()

    def _write(self, finished: float, record: dict) -> None:
        if self._decode is not None:
            for ids, text in (("input_ids", "text_input"), ("output_ids", "text_output")):
                if record.get(text) is None:
                    record[text] = self._decode(record[ids])
        line = json.dumps(
            {"v": FORMAT_VERSION, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(finished))} | record,
            ensure_ascii=False,
            separators=(",", ":"),
        ).encode()
        if self._file is not None and self._file.tell() + len(line) + 1 > self.settings.rotate_at:
            self._close_file()
        if self._file is None:
            self._open_file()
        self._file.write(line + b"\n")
        self.written += 1

    def _open_file(self) -> None:
        self._serial += 1
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        path = self.folder / f"{PREFIX}{stamp}-{os.getpid()}-{self._serial:06d}{SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._file, self._file_path = os.fdopen(fd, "ab"), path
        self._enforce_cap()

    def _flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            finally:
                self._file = None
                self._enforce_cap()

    def _enforce_cap(self) -> None:
        """Delete the oldest files (never the one being written) until the directory is within max_bytes."""
        files = [p for p in capture_files(self.folder) if p != self._file_path or self._file is None]
        sizes = {p: _size(p) for p in files}
        total = sum(sizes.values()) + (self._file.tell() if self._file is not None else 0)
        for path in files:
            if total <= self.settings.max_bytes:
                break
            try:
                path.unlink()
                self.deleted += 1
            except FileNotFoundError:
                pass
            total -= sizes[path]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def make_record(
    *,
    model: str,
    route: str | None,
    input_ids: list[int],
    output_ids: list[int],
    temperature: float,
    num_draft_tokens: int,
    num_accepted_tokens: int,
    draft_version: str | None = None,
    text_input: str | None = None,
    text_output: str | None = None,
    greedy: bool | None = None,
) -> dict:
    """One request's record (see the module doc), from values the request already has; text left None is decoded
    by the writer, off the request path."""
    return {
        "model": model,
        "route": route,
        "input_ids": list(input_ids),
        "output_ids": list(output_ids),
        "text_input": text_input,
        "text_output": text_output,
        "temperature": temperature,
        "greedy": temperature == 0.0 if greedy is None else greedy,
        "num_draft_tokens": num_draft_tokens,
        "num_accepted_tokens": num_accepted_tokens,
        "draft_version": draft_version,
    }


def captured(model: str, spec, output_ids: list[int], stats, draft_version: str | None) -> dict:
    """The record of a finished request (`spec`: its trtspec.orchestrator.loop.SpecRequest, `stats`: its
    RequestStats), from values it already holds: the writer decodes the text."""
    return make_record(
        model=model,
        route=None,
        input_ids=spec.prompt,
        output_ids=output_ids,
        temperature=float(spec.sampling.temperature),
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        draft_version=draft_version,
        greedy=spec.sampling.greedy,
    )


# ---- reading ----------------------------------------------------------------------------------------------------


def is_captured(item) -> bool:
    return (
        isinstance(item, dict)
        and isinstance(item.get("input_ids"), list)
        and isinstance(item.get("output_ids"), list)
        and bool(item["input_ids"])
        and bool(item["output_ids"])
    )


def read_records(path: str | os.PathLike) -> list[dict]:
    """Every captured record of a capture directory (or one capture file), oldest first; CaptureError naming the
    file and line that is not one. A last line cut short by a crash is skipped."""
    path = Path(path).expanduser()
    files = capture_files(path) if path.is_dir() else [path]
    if path.is_dir() and not files:
        raise CaptureError(f"{path}: holds no {PREFIX}*{SUFFIX} files (written by `trtspec serve --capture`)")
    records = []
    for file in files:
        lines = file.read_bytes().decode("utf-8", errors="replace").split("\n")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):  # the writer was stopped mid-line
                    continue
                raise CaptureError(f"{file}, line {number}: not valid JSON") from None
            if not is_captured(item):
                raise CaptureError(f'{file}, line {number}: not a captured request (no "input_ids" and "output_ids")')
            records.append(item)
    return records


def write_records(path: Path, records: list[dict]) -> None:
    """Records as JSONL in a file of the user's alone (they hold prompts), replaced whole."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def split_heldout(records: list[dict], fraction: float = 0.1, *, at_most: int = 64, seed: int = 0):
    """(train, held out): a seeded share of the records, greedy ones first (their outputs are the target's argmax,
    what greedy acceptance is measured against)."""
    if len(records) < 2:
        return records, []
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    order.sort(key=lambda i: not records[i].get("greedy", False))
    count = max(1, min(at_most, round(len(records) * fraction)))
    held = set(order[:count])
    return [r for i, r in enumerate(records) if i not in held], [records[i] for i in sorted(held)]


def route_of(record: dict) -> str:
    return record.get("route") or record.get("model") or "-"
