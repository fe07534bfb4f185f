"""What a deployment's engines cost on the machine they run on, measured when it starts.

A `Calibration` is a table of seconds, measured through Triton by `trtspec serve` (trtspec/calibrate_run.py):

- plain_seconds {batch: s}: one plain target step while `batch` requests decode together (per token of a stretch;
  the call's own overhead is in round_trip_seconds);
- verify_seconds {batch: {k: s}}: one target pass where each of `batch` requests verifies k draft tokens (k + 1
  rows each), the engine's part of the call;
- draft_seconds {k: s}: one draft-model call producing k tokens, the engine's part;
- round_trip_seconds: what an engine call costs outside the engine (Triton, the BLS's request and response);
- long_*: the same at batch 1 on a sequence of `context_tokens` tokens (the table's own rows hold
  `short_context_tokens`): attention reads every cached token, so a verification's k + 1 rows cost more plain steps
  on a long prompt than on a short one (on the demo target at 1000 tokens, 5 rows cost 1.9 steps where at 100 they
  cost 1.4). Optional: 0 / empty where the engine could not take a long sequence.

The measured table is put in the order the work sets before it is stored (`Calibration.monotone`).

`cost_model(load)` turns the table into the adaptive policy's `CostModel` (trtspec/orchestrator/adaptive.py) in
units of one plain step at that load: a speculative iteration of k costs a draft call and a verification call,

    cost(k) = (draft(k) + rt + verify(B, k) + rt) / plain(B)  ~  1 + v0 + d0 + (c + b) * k

with d0, c fitted as a line over k on the draft calls (a call's fixed part and its cost a token; prompt lookup makes
no call and pays neither) and v0, b as a line over k on the verification calls. The batch B of a load is
interpolated between measured batches (linear), clamped to the ends. `cost_model(load, context)` adds what a
request's own rows cost more on a sequence of `context` tokens: each figure grows linearly with the context (as
attention does) from the short measurement to the long one, extrapolated beyond it.

The server writes the calibration as JSON to a file whose path is in TRTSPEC_CALIBRATION_FILE (the Python-backend
stubs inherit it); the BLS re-reads it with `CalibrationWatch` when the file changes (after `trtspec bench --apply`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from trtspec.orchestrator.adaptive import CostModel

CALIBRATION_ENV = "TRTSPEC_CALIBRATION_FILE"
FILE_NAME = "calibration.json"
FORMAT = 2  # bumped when the JSON's meaning changes; an older file is measured again


class CalibrationError(ValueError):
    """A calibration file or table that cannot be used; the message names the field."""


def _interpolate(table: dict[int, float], x: float) -> float:
    """Linear between the measured points around x, clamped to the first and last."""
    points = sorted(table.items())
    if not points:
        raise CalibrationError("an empty table has no value to interpolate")
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y over x; one point: (y, 0)."""
    n = len(points)
    if n == 1:
        return points[0][1], 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - slope * mx, slope


def _isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence nearest `values` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for value in values:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [mean for mean, count in blocks for _ in range(int(count))]


def _cummax(values: list[float]) -> list[float]:
    out, top = [], float("-inf")
    for value in values:
        top = max(top, value)
        out.append(top)
    return out


def machine_identity() -> str:
    """Where the calibration was measured: host, processor, device count (a pod on other hardware measures again)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()} | {cpu} | {os.cpu_count()} cpus"


def engine_identity(paths: list[str | os.PathLike[str]]) -> str:
    """A hash of the engines: each file's name, size and modification time (a rebuilt engine is another), and the
    text of config.json / config.pbtxt. `paths`: engine dirs, or files (an engine model's config.pbtxt)."""
    digest = hashlib.sha256()
    for given in paths:
        given = Path(given)
        for path in sorted(given.glob("*")) if given.is_dir() else [given]:
            if path.is_file():
                st = path.stat()
                digest.update(f"{path.name} {st.st_size} {st.st_mtime_ns}".encode())
                if path.name in ("config.json", "config.pbtxt"):
                    digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


@dataclass
class Calibration:
    plain_seconds: dict[int, float]
    verify_seconds: dict[int, dict[int, float]]
    draft_seconds: dict[int, float] = field(default_factory=dict)  # empty: no draft model deployed
    round_trip_seconds: float = 0.0
    machine: str = ""
    engines: str = ""  # engine_identity of the engines measured
    measured_at: float = 0.0  # time.time()
    took_seconds: float = 0.0  # how long the measurement took
    short_context_tokens: int = 0  # the sequence length the table above was measured on
    context_tokens: int = 0  # the long sequence of the long_* figures (0: not measured)
    long_plain_seconds: float = 0.0
    long_verify_seconds: dict[int, float] = field(default_factory=dict)
    long_draft_seconds: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.plain_seconds:
            raise CalibrationError("plain_seconds: no batch measured; measure at least batch 1")
        if not self.verify_seconds or not all(self.verify_seconds.values()):
            raise CalibrationError("verify_seconds: no verifying pass measured; measure k = 1 at batch 1 at least")
        for name, value in self.durations():
            if not (value >= 0.0 and value < float("inf")):
                raise CalibrationError(f"{name}: {value!r} is not a duration in seconds (finite, at least 0)")
        if min(self.plain_seconds.values()) <= 0.0:
            raise CalibrationError("plain_seconds: a plain step of 0 s cannot be a unit of cost")
        if self.context_tokens:
            if self.context_tokens <= self.short_context_tokens or 1 not in self.plain_seconds:
                raise CalibrationError(
                    f"context_tokens: {self.context_tokens} must exceed short_context_tokens "
                    f"({self.short_context_tokens}), with batch 1 measured"
                )
            if self.long_plain_seconds <= 0.0 or sorted(self.long_verify_seconds) != sorted(self.verify_seconds[1]):
                raise CalibrationError("long_plain_seconds, long_verify_seconds: measure every k of batch 1 at length")

    def durations(self):
        """(name, seconds) of every figure in the table."""
        yield from ((f"plain_seconds[{b}]", s) for b, s in self.plain_seconds.items())
        yield from ((f"verify_seconds[{b}][{k}]", s) for b, ks in self.verify_seconds.items() for k, s in ks.items())
        yield from ((f"draft_seconds[{k}]", s) for k, s in self.draft_seconds.items())
        yield "round_trip_seconds", self.round_trip_seconds
        if self.context_tokens:
            yield "long_plain_seconds", self.long_plain_seconds
            yield from ((f"long_verify_seconds[{k}]", s) for k, s in self.long_verify_seconds.items())
            yield from ((f"long_draft_seconds[{k}]", s) for k, s in self.long_draft_seconds.items())

    def monotone(self) -> Calibration:
        """The table in the order the work sets, each cell moved as little as it can be: a plain step no cheaper at
        a larger batch; a verifying pass no cheaper with more requests or more draft tokens, and no cheaper than a
        plain step of its batch (it computes that step's rows and k more each); a draft call no cheaper for more
        tokens. Timing noise on a busy machine breaks these orders, and the cost model reads differences between
        cells: a verification measured cheaper than the plain step beside it would make speculation look free.
        Least squares under the order (isotonic regression) along each axis in turn, then the order made exact."""
        batches = sorted(self.plain_seconds)
        plain = _cummax(_isotonic([self.plain_seconds[b] for b in batches]))
        ks = sorted(set().union(*self.verify_seconds.values()))
        verify = {b: dict(ks_) for b, ks_ in self.verify_seconds.items()}
        if all(sorted(v) == ks for v in verify.values()) and sorted(verify) == batches:
            grid = [[verify[b][k] for k in ks] for b in batches]
            for _ in range(8):
                grid = [_isotonic(row) for row in grid]
                grid = [list(row) for row in zip(*(_isotonic(list(col)) for col in zip(*grid)))]
            grid = [_cummax(row) for row in grid]
            grid = [list(row) for row in zip(*(_cummax(list(col)) for col in zip(*grid)))]
            verify = {b: {k: max(grid[i][j], plain[i]) for j, k in enumerate(ks)} for i, b in enumerate(batches)}
        else:  # a table whose batches measured different k (written by hand): each batch along k alone
            verify = {b: dict(zip(sorted(v), _cummax(_isotonic([v[k] for k in sorted(v)])))) for b, v in verify.items()}
        dks = sorted(self.draft_seconds)
        drafts = dict(zip(dks, _cummax(_isotonic([self.draft_seconds[k] for k in dks]))))
        long = {}
        if self.context_tokens:  # a longer sequence costs no less than the short one, cell by cell, in the same order
            plain_long = max(self.long_plain_seconds, plain[0])
            lks = sorted(self.long_verify_seconds)
            fitted = _cummax(_isotonic([self.long_verify_seconds[k] for k in lks]))
            lds = sorted(self.long_draft_seconds)
            fitted_drafts = _cummax(_isotonic([self.long_draft_seconds[k] for k in lds]))
            long = dict(
                long_plain_seconds=plain_long,
                long_verify_seconds={k: max(v, verify[batches[0]][k], plain_long) for k, v in zip(lks, fitted)},
                long_draft_seconds={k: max(v, drafts.get(k, 0.0)) for k, v in zip(lds, fitted_drafts)},
            )
        return replace(
            self, plain_seconds=dict(zip(batches, plain)), verify_seconds=verify, draft_seconds=drafts, **long
        )

    # --- the table at a load ---------------------------------------------------------------------------------
    @property
    def max_batch(self) -> int:
        return max(self.plain_seconds)

    def plain_at(self, batch: float, context: int = 0) -> float:
        """Seconds of one plain step with `batch` requests in the pass, for a request on a sequence of `context`
        tokens (0: as short as the table's)."""
        f = self.context_share(context)
        extra = f * (self.long_plain_seconds - _interpolate(self.plain_seconds, 1)) if f else 0.0
        return _interpolate(self.plain_seconds, batch) + extra

    def verify_at(self, batch: float, k: int) -> float:
        """Seconds of a pass where each of `batch` requests verifies k draft tokens (engine's part of the call);
        k beyond the measured ones follows the line through the largest two."""
        by_batch = {b: self._verify_k(ks, k) for b, ks in self.verify_seconds.items()}
        return _interpolate(by_batch, batch)

    @staticmethod
    def _verify_k(ks: dict[int, float], k: int) -> float:
        if k in ks:
            return ks[k]
        intercept, slope = _line(sorted(ks.items()))
        return max(intercept + slope * k, 0.0) if k > max(ks) or k < min(ks) else _interpolate(ks, k)

    def draft_at(self, k: int) -> float:
        """Seconds of a draft call of k tokens (engine's part); 0 where no draft model was measured."""
        if not self.draft_seconds or k <= 0:
            return 0.0
        if k in self.draft_seconds:
            return self.draft_seconds[k]
        intercept, slope = _line(sorted(self.draft_seconds.items()))
        return max(intercept + slope * k, 0.0)

    def context_share(self, context: int) -> float:
        """How far a sequence of `context` tokens is from the short measurement toward the long one (0: as short or
        no long measurement; 1: the long one; beyond it, linear as attention grows)."""
        if not self.context_tokens or context <= self.short_context_tokens:
            return 0.0
        return (context - self.short_context_tokens) / (self.context_tokens - self.short_context_tokens)

    def cost_model(self, load: int, context: int = 0) -> CostModel:
        """The adaptive policy's costs at `load` requests in flight for a request on a sequence of `context` tokens
        (0: as short as the table's), in plain steps of that request at that load."""
        batch = min(max(load, 1), self.max_batch)
        f = self.context_share(context)
        plain = self.plain_at(batch, context)
        ks = sorted(set().union(*self.verify_seconds.values()))
        rt = self.round_trip_seconds

        def verify(k: int) -> float:  # its own k + 1 rows attend over its whole sequence
            extra = f * (self._verify_k(self.long_verify_seconds, k) - self.verify_at(1, k)) if f else 0.0
            return self.verify_at(batch, k) + extra

        def draft(k: int) -> float:
            extra = (
                f * (self._verify_k(self.long_draft_seconds, k) - self.draft_at(k))
                if f and self.long_draft_seconds
                else 0
            )
            return self.draft_seconds[k] + extra

        intercept, slope = _line([(k, (verify(k) + rt) / plain) for k in ks])
        drafts = [(k, (draft(k) + rt) / plain) for k in sorted(self.draft_seconds)]
        # a draft call: a fixed part (its round trip, the call's own work) and c a token, as the verification has v0
        # and b; prompt lookup makes no call and pays neither. One k alone, or a line that would start below zero,
        # says nothing of the split: through the origin then
        d0, c = _line(drafts) if len(drafts) > 1 else (0.0, 0.0)
        if drafts and (len(drafts) == 1 or d0 < 0):
            d0, c = 0.0, sum(k * y for k, y in drafts) / sum(k * k for k, _ in drafts)
        return CostModel(
            draft_cost_ratio=max(c, 0.0),
            verify_cost_per_token=max(slope, 0.0),
            verify_cost_fixed=max(intercept - 1, 0),
            draft_cost_fixed=d0,
        )

    # --- stored -------------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT,
                "plain_seconds": {str(b): s for b, s in sorted(self.plain_seconds.items())},
                "verify_seconds": {
                    str(b): {str(k): s for k, s in sorted(ks.items())} for b, ks in sorted(self.verify_seconds.items())
                },
                "draft_seconds": {str(k): s for k, s in sorted(self.draft_seconds.items())},
                "round_trip_seconds": self.round_trip_seconds,
                "machine": self.machine,
                "engines": self.engines,
                "measured_at": self.measured_at,
                "took_seconds": self.took_seconds,
                "short_context_tokens": self.short_context_tokens,
                "context_tokens": self.context_tokens,
                "long_plain_seconds": self.long_plain_seconds,
                "long_verify_seconds": {str(k): s for k, s in sorted(self.long_verify_seconds.items())},
                "long_draft_seconds": {str(k): s for k, s in sorted(self.long_draft_seconds.items())},
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise CalibrationError(f"not JSON ({exc}); measure again (trtspec bench --apply)") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CalibrationError(
                f"format: {data.get('format') if isinstance(data, dict) else None!r} is not {FORMAT}; "
                "measure again (trtspec bench --apply)"
            )
        try:
            return cls(
                plain_seconds={int(b): float(s) for b, s in data["plain_seconds"].items()},
                verify_seconds={
                    int(b): {int(k): float(s) for k, s in ks.items()} for b, ks in data["verify_seconds"].items()
                },
                draft_seconds={int(k): float(s) for k, s in data.get("draft_seconds", {}).items()},
                round_trip_seconds=float(data.get("round_trip_seconds", 0.0)),
                machine=str(data.get("machine", "")),
                engines=str(data.get("engines", "")),
                measured_at=float(data.get("measured_at", 0.0)),
                took_seconds=float(data.get("took_seconds", 0.0)),
                short_context_tokens=int(data.get("short_context_tokens", 0)),
                context_tokens=int(data.get("context_tokens", 0)),
                long_plain_seconds=float(data.get("long_plain_seconds", 0.0)),
                long_verify_seconds={int(k): float(s) for k, s in data.get("long_verify_seconds", {}).items()},
                long_draft_seconds={int(k): float(s) for k, s in data.get("long_draft_seconds", {}).items()},
            )
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            if isinstance(exc, CalibrationError):
                raise
            raise CalibrationError(f"{exc.__class__.__name__}: {exc}; measure again (trtspec bench --apply)") from None

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write atomically (a BLS reading it never sees half of it)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json())
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Calibration:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise CalibrationError(f"{path}: {exc.strerror or exc}") from None
        try:
            return cls.from_json(text)
        except CalibrationError as exc:
            raise CalibrationError(f"{path}: {exc}") from None

    def matches(self, engines: str, machine: str | None = None) -> bool:
        """Whether this calibration was measured on these engines on this machine (then it can be reused)."""
        return self.engines == engines and self.machine == (machine_identity() if machine is None else machine)

    def table(self) -> list[list[str]]:
        """Rows for a printed table: batch, plain step ms, verify ms for each k, and the cost model's c, d0, v0, b."""
        ks = sorted(set().union(*self.verify_seconds.values()))
        rows = [["batch", "plain ms", *(f"verify k={k} ms" for k in ks), "c", "d0", "v0", "b"]]
        for batch in sorted(self.plain_seconds):
            costs = self.cost_model(batch)
            rows.append(
                [
                    str(batch),
                    f"{self.plain_seconds[batch] * 1e3:.1f}",
                    *(f"{self.verify_at(batch, k) * 1e3:.1f}" for k in ks),
                    f"{costs.draft_cost_ratio:.2f}",
                    f"{costs.draft_cost_fixed:.2f}",
                    f"{costs.verify_cost_fixed:.2f}",
                    f"{costs.verify_cost_per_token:.2f}",
                ]
            )
        return rows

    def summary(self) -> str:
        drafts = ", ".join(f"k={k}: {s * 1e3:.1f} ms" for k, s in sorted(self.draft_seconds.items())) or "none"
        rt = self.round_trip_seconds * 1e3
        long = ""
        if self.context_tokens:
            ks = ", ".join(f"k={k}: {s * 1e3:.1f}" for k, s in sorted(self.long_verify_seconds.items()))
            costs = self.cost_model(1, self.context_tokens)
            long = (
                f"; at {self.context_tokens} tokens (batch 1): plain {self.long_plain_seconds * 1e3:.1f} ms, verify "
                f"{ks} ms (c {costs.draft_cost_ratio:.2f}, d0 {costs.draft_cost_fixed:.2f}, "
                f"v0 {costs.verify_cost_fixed:.2f}, b {costs.verify_cost_per_token:.2f})"
            )
        return f"draft calls {drafts}; round trip {rt:.2f} ms{long}; measured in {self.took_seconds:.1f} s"


class CalibrationWatch:
    """The BLS's side: the calibration file re-read when it changed, at most every `interval` seconds."""

    def __init__(self, path: str | os.PathLike[str] | None = None, interval: float = 1.0):
        path = path if path is not None else os.environ.get(CALIBRATION_ENV)
        self.path = Path(path) if path else None
        self.interval = interval
        self._checked = float("-inf")
        self._stamp: tuple | None = None
        self.error: str | None = None  # why the file last read could not be used

    def poll(self) -> Calibration | None:
        """A Calibration newly read from the file, or None (no file, unchanged, or unusable: see `error`)."""
        if self.path is None or time.monotonic() - self._checked < self.interval:
            return None
        self._checked = time.monotonic()
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            return None
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            calibration = Calibration.load(self.path)
        except CalibrationError as exc:
            self.error = str(exc)
            return None
        self.error = None
        return calibration
