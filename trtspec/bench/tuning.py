"""The tuning of a run (best K per concurrency, the speculation limit, the adaptive controller's costs) and
writing it into a deployed repository's BLS config (`trtspec bench --apply`)."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from trtspec.bench.arithmetic import best_k, fit_verify_cost, speculation_limit
from trtspec.errors import BenchError


def tune(cells: Sequence[dict]) -> dict:
    """Best K per concurrency, the deployment defaults they imply, and the cost model (module doc); from the cells
    with a fixed K only."""
    cells = [c for c in cells if not c.get("adaptive")]
    concurrencies = sorted({c["concurrency"] for c in cells})
    best = {}
    for conc in concurrencies:
        row = {c["k"]: c["speedup"] for c in cells if c["concurrency"] == conc and (c["requests"] or c["k"] == 0)}
        best[conc] = best_k(row)
    lowest = concurrencies[0] if concurrencies else None
    low = [c for c in cells if c["concurrency"] == lowest and c["k"] > 0 and c.get("bound")]
    draft_ms = sum(c["draft_ms"] for c in low)
    draft_steps = sum(c["draft_ms"] / c["bound"]["draft_cost_ratio"] for c in low if c["bound"]["draft_cost_ratio"])
    verify = fit_verify_cost((c["bound"]["mean_draft_length"], c["bound"]["verify_cost"]) for c in low)
    return {
        "best_k": {str(c): k for c, k in best.items()},
        "default_num_draft_tokens": best.get(lowest) if lowest is not None else None,
        "max_speculative_concurrency": speculation_limit(best),
        "from_concurrency": lowest,
        "draft_cost_ratio": draft_ms / draft_steps if draft_steps else None,
        "verify_cost_fixed": verify[0] if verify else None,
        "verify_cost_per_token": verify[1] if verify else None,
    }


# ---- applying the tuning to a deployed repository -----------------------------------------------------------

_PARAM = r'\{\s*key\s*:\s*"%s"\s*value\s*:?\s*\{\s*string_value\s*:\s*"((?:[^"\\]|\\.)*)"\s*\}\s*\}'
_ANY_PARAM_LINE = re.compile(r"^\s*parameters\s*:?\s*\{\s*key\s*:.*$", re.MULTILINE)


@dataclass(frozen=True)
class Change:
    parameter: str
    old: str | None  # None: the parameter was not there
    new: str


def set_parameters(text: str, values: Mapping[str, str]) -> tuple[str, list[Change]]:
    """A config.pbtxt's text with the string parameters `values` set: an existing entry's value is replaced in
    place, a missing one is added after the last `parameters` line (or at the end). Returns (text, changes)."""
    changes = []
    for name, value in values.items():
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        pattern = re.compile(_PARAM % re.escape(name))
        match = pattern.search(text)
        if match:
            old = match.group(1)
            if old != escaped:
                text = text[: match.start(1)] + escaped + text[match.end(1) :]
                changes.append(Change(name, old, value))
            continue
        line = f'parameters: {{ key: "{name}" value: {{ string_value: "{escaped}" }} }}'
        last = next(reversed(list(_ANY_PARAM_LINE.finditer(text))), None)
        if last is not None:
            text = text[: last.end()] + "\n" + line + text[last.end() :]
        else:
            text = text.rstrip("\n") + "\n" + line + "\n"
        changes.append(Change(name, None, value))
    return text, changes


def tuned_values(tuning: Mapping, max_draft_len: int | None = None) -> dict[str, str]:
    """The BLS parameters to write from a report's tuning (those it could measure)."""
    values = {}
    k = tuning.get("default_num_draft_tokens")
    if k is not None:
        values["default_num_draft_tokens"] = str(min(k, max_draft_len) if max_draft_len else k)
    values["max_speculative_concurrency"] = str(int(tuning.get("max_speculative_concurrency") or 0))
    for name in ("draft_cost_ratio", "verify_cost_fixed", "verify_cost_per_token"):
        if tuning.get(name) is not None:
            values[name] = f"{tuning[name]:.4g}"
    return values


@dataclass
class Applied:
    changes: list[Change]
    problems: list  # the repository's problems that were there before the edit (the edit added none)


def apply_tuning(repo: str | os.PathLike, tuning: Mapping) -> Applied:
    """Write the tuning into a deployed repository's BLS config.pbtxt, in place, and check the repository.

    The file is replaced atomically. If the parsed config does not hold the new values, or the edited repository
    has a problem (trtspec.deploy.checks.validate_repository) it did not have before, the old file is put back and
    BenchError says why. A running server keeps its loaded config until it is restarted or the model reloaded."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from trtspec.deploy.checks import validate_repository
    from trtspec.deploy.writer import BLS_MODEL

    path = Path(repo) / BLS_MODEL / "config.pbtxt"
    if not path.is_file():
        raise BenchError(f"{path} does not exist: --apply takes a model repository written by `trtspec deploy`")
    old_text = path.read_text()
    try:
        parsed = text_format.Parse(old_text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise BenchError(f"{path} does not parse as a Triton model config: {exc}") from exc
    longest = parsed.parameters["max_draft_len"].string_value if "max_draft_len" in parsed.parameters else ""
    values = tuned_values(tuning, int(longest) if longest.isdigit() else None)
    new_text, changes = set_parameters(old_text, values)
    before = {str(p) for p in validate_repository(repo)}
    if not changes:
        return Applied([], sorted(before))
    _write_atomic(path, new_text)
    try:
        check = text_format.Parse(new_text, model_config_pb2.ModelConfig())
        wrong = [n for n, v in values.items() if check.parameters[n].string_value != v]
        if wrong:
            raise BenchError(f"the edited {path} does not hold the new value of {', '.join(wrong)}")
        after = [p for p in validate_repository(repo) if str(p) not in before]
        if after:
            raise BenchError(
                f"the edited repository {repo} does not validate; it was left as it was:\n"
                + "\n".join(f"  - {p}" for p in after)
            )
    except BaseException:
        _write_atomic(path, old_text)
        raise
    return Applied(changes, sorted(before))


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
