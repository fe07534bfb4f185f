"""`trtspec promote`: a new draft into a running deployment, without a restart; `--previous` goes back.

What it does, on a repository `trtspec deploy` wrote for the embedded engine:
  1. builds the draft's engine with the build config the repository was deployed from (its `draft.checkpoint` the new
     draft), into `<repo>/tensorrt_llm_draft/<N>/draft`, N the next version;
  2. writes version N (its model.py, a copy of the deployed one) and points the draft model's config at it:
     `engine_dir` the new engine, `version_policy { specific { versions: [N] } }`;
  3. asks Triton to load the model (POST /v2/repository/models/tensorrt_llm_draft/load, with the admin key: the API is
     restricted): Triton loads version N beside the running one and unloads the old one once N is ready, so draft
     calls go on throughout; the BLS calls the draft without a version and gets whichever is ready;
  4. records the promotion in `<repo>/tensorrt_llm_draft/promotions.json` (`active`, and each version's engine and
     checkpoint), which the BLS reads for the `draft_version` label of its acceptance metrics.
Nothing is written when the build fails; when Triton refuses the load, the config is put back as it was.
`--previous` points the config back at the version before the active one (its engine is still on disk) and loads.

TensorRT-LLM deployments are refused, before anything is built or written: `trtspec serve` starts their tritonserver
in Triton's default model-control mode, `none` (the engines run inside the server process, under MPI in orchestrator
mode), as TensorRT-LLM's scripts/launch_triton_server.py starts rank 0 (only ranks >= 1 get
`--model-control-mode=explicit`, and only to load the engine models at start); Triton answers every load and unload
with an error in that mode, so a new draft engine there takes a rolling restart: build, deploy, restart the pods.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from trtspec.deploy.launch import DRAFT_MODEL
from trtspec.errors import TrtspecError

BLS_MODEL = "tensorrt_llm_bls"
PROMOTIONS = "promotions.json"
ENGINE_SUBDIR = "draft"
CONFIG = "config.pbtxt"


class PromoteError(TrtspecError):
    """A promotion that cannot go ahead or did not take; the message says what was left as it was."""


# ---- reading a repository -------------------------------------------------------------------------------------


def _parse(path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
    except (OSError, text_format.ParseError) as exc:
        raise PromoteError(f"{path}: not a readable Triton model config ({exc})") from None


def bls_parameters(repo: str | os.PathLike) -> dict[str, str]:
    path = Path(repo) / BLS_MODEL / CONFIG
    if not path.is_file():
        raise PromoteError(f"--repo {repo}: no {BLS_MODEL}/{CONFIG}; give a repository written by `trtspec deploy`")
    config = _parse(path)
    return {key: value.string_value for key, value in config.parameters.items()}


def stored_calibration(repo: str | os.PathLike) -> Path | None:
    """The start-up calibration `trtspec serve` stored for this repository, where there is one."""
    from trtspec.bench.calibrate import calibration_path

    path = calibration_path(repo)
    return path if path.is_file() else None


@dataclass
class DraftModel:
    repo: Path
    dir: Path
    engine_dir: Path
    history: dict

    @property
    def active(self) -> int:
        return int(self.history["active"])


def read_draft_model(repo: str | os.PathLike) -> DraftModel:
    repo = Path(repo)
    folder = repo / DRAFT_MODEL
    if not (folder / CONFIG).is_file():
        raise PromoteError(f"--repo {repo}: no {DRAFT_MODEL}/{CONFIG}: this deployment has no draft model to replace")
    params = {k: v.string_value for k, v in _parse(folder / CONFIG).parameters.items()}
    if "engine_dir" not in params:
        raise PromoteError(f"{folder / CONFIG}: no engine_dir parameter; regenerate it with `trtspec deploy`")
    engine_dir = Path(params["engine_dir"])
    history_file = folder / PROMOTIONS
    if history_file.is_file():
        history = json.loads(history_file.read_text())
    else:  # the deployed draft is version 1
        history = {
            "active": 1,
            "versions": {"1": {"engine_dir": str(engine_dir), "checkpoint": _checkpoint(engine_dir)}},
        }
    return DraftModel(repo, folder, engine_dir, history)


def _checkpoint(engine_dir: Path) -> str | None:
    """The checkpoint an engine was built from (its manifest's first source's folder), when it says."""
    try:
        sources = json.loads((engine_dir / "manifest.json").read_text()).get("sources") or []
        return str(Path(sources[0]["file"]).parent) if sources else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def deployed_draft_checkpoint(repo: str | os.PathLike) -> str:
    model = read_draft_model(repo)
    entry = model.history["versions"].get(str(model.active), {})
    found = entry.get("checkpoint") or _checkpoint(model.engine_dir)
    if not found or not Path(found).exists():
        raise PromoteError(
            f"--repo {repo}: the active draft's checkpoint is not known here (engine {model.engine_dir}); "
            "give it with --against"
        )
    return found


def draft_version(repo: str | os.PathLike) -> str:
    """The active draft version's label (the BLS's `draft_version`): "1" until a promotion."""
    try:
        return str(json.loads((Path(repo) / DRAFT_MODEL / PROMOTIONS).read_text())["active"])
    except (OSError, ValueError, KeyError, TypeError):
        return "1"


class DraftVersionWatch:
    """The active draft version of a repository, for the BLS's metric label: `promotions.json` read again when it
    changes, looked at no more than once a second."""

    def __init__(self, repo: str | os.PathLike, interval: float = 1.0):
        self.path, self.interval = Path(repo) / DRAFT_MODEL / PROMOTIONS, interval
        self._checked, self._mtime, self.version = 0.0, None, draft_version(repo)

    def current(self) -> str:
        now = time.monotonic()
        if now - self._checked >= self.interval:
            self._checked = now
            try:
                mtime = self.path.stat().st_mtime_ns
            except OSError:
                mtime = None
            if mtime != self._mtime:
                self._mtime, self.version = mtime, draft_version(self.path.parent.parent)
        return self.version


def refuse_mpi(repo: str | os.PathLike) -> None:
    from trtspec.marker import read_marker

    marker = read_marker(repo) or {}
    if marker.get("backend") == "trtllm":
        launch = marker.get("launch") or {}
        how = "under mpirun in orchestrator mode" if launch.get("mpi") else "with the engines inside the server"
        raise PromoteError(
            f"--repo {repo} is a TensorRT-LLM deployment, served {how} in Triton's model-control mode `none` (as "
            "TensorRT-LLM's launch_triton_server.py starts rank 0), where Triton refuses every model load: a new "
            "draft there takes a rolling restart. Nothing was built or written. Instead: put the draft in the build "
            "config, `trtspec build`, `trtspec deploy`, and restart the server (or roll the pods)"
        )


# ---- changing it ----------------------------------------------------------------------------------------------------


def _configured(text: str, engine_dir: Path, version: int) -> str:
    from trtspec.bench.tuning import set_parameters

    text, _ = set_parameters(text, {"engine_dir": str(engine_dir)})
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("version_policy")]
    at = next(i for i, line in enumerate(lines) if line.lstrip().startswith("max_batch_size")) + 1
    lines.insert(at, f"version_policy: {{ specific: {{ versions: [ {version} ] }} }}")
    return "\n".join(lines) + "\n"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def build_draft_engine(repo: Path, checkpoint: str, out_dir: Path, console=None) -> Path:
    """The draft's engine, built as the repository's build config builds its draft, into `out_dir/draft`."""
    import yaml

    from trtspec.checkpoint import PACKAGE_SCHEME, resolve_checkpoint_path
    from trtspec.compile import torch as backend
    from trtspec.config import load_config
    from trtspec.marker import read_marker

    config_path = (read_marker(repo) or {}).get("config_path")
    if not config_path or not Path(config_path).is_file():
        raise PromoteError(
            f"--repo {repo}: the build config it was deployed from ({config_path}) is not here; the draft is built "
            "with its settings"
        )
    raw = yaml.safe_load(Path(config_path).read_text())
    base = Path(config_path).resolve().parent
    target = raw["target"]["checkpoint"]
    if not str(target).startswith(PACKAGE_SCHEME):
        raw["target"]["checkpoint"] = str(resolve_checkpoint_path(target, base))
    if not checkpoint.startswith(PACKAGE_SCHEME):
        checkpoint = str(Path(checkpoint).expanduser().resolve())
    if "draft" not in raw:
        raise PromoteError(f"{config_path} has no draft section: this deployment drafts with no model")
    raw["draft"]["checkpoint"] = checkpoint
    out_dir.mkdir(parents=True, exist_ok=True)
    config_file = out_dir / "build.yaml"
    config_file.write_text(yaml.safe_dump(raw))
    loaded = load_config(config_file)
    (build,) = [b for b in backend.plan(loaded, out_dir, check_existing=False) if b.role == "draft"]
    if console:
        console.print(f"building the draft engine: {build.describe()}", highlight=False, markup=False)
    backend.build_model(build, loaded.config)
    return build.output


def _load(url: str, headers: dict[str, str], version: int, timeout: float) -> None:
    """Triton's repository API: load the draft model (its new config), then wait for the version to be ready."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"http://{url}/v2/repository/models/{DRAFT_MODEL}/load", data=b"{}", method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:400]
        hint = " (the admin key: --admin-key-file or $TRTSPEC_ADMIN_KEY)" if exc.code in (401, 403) else ""
        raise PromoteError(f"Triton refused to load {DRAFT_MODEL}{hint}: HTTP {exc.code} {body}") from None
    except OSError as exc:
        raise PromoteError(f"no Triton at {url} ({exc}); give the deployment's HTTP address with --url") from None
    ready = f"http://{url}/v2/models/{DRAFT_MODEL}/versions/{version}/ready"
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(ready, timeout=10) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise PromoteError(f"{DRAFT_MODEL} version {version} was not ready within {timeout:.0f} s")


def _switch(model: DraftModel, version: int, entry: dict, trail: list[int], url: str, headers, timeout) -> None:
    """Point the config at `version`, load it, and record it (`trail`: the versions made active, in order)."""
    config_path = model.dir / CONFIG
    old_text = config_path.read_text()
    _write_atomic(config_path, _configured(old_text, Path(entry["engine_dir"]), version))
    try:
        _load(url, headers, version, timeout)
    except BaseException:
        _write_atomic(config_path, old_text)  # the server keeps the version it had; so does the repository
        raise
    model.history["versions"][str(version)] = entry
    model.history["active"] = version
    model.history["trail"] = trail
    _write_atomic(model.dir / PROMOTIONS, json.dumps(model.history, indent=2) + "\n")


def promote(
    repo: str | os.PathLike,
    checkpoint: str,
    *,
    url: str,
    headers: dict[str, str],
    timeout: float = 300.0,
    console=None,
) -> int:
    """Build `checkpoint`'s engine as the next version of the draft model and load it; returns the version."""
    repo = Path(repo)
    refuse_mpi(repo)
    model = read_draft_model(repo)
    versions = [int(p.name) for p in model.dir.iterdir() if p.is_dir() and p.name.isdigit()]
    version = max(versions + [int(v) for v in model.history["versions"]]) + 1
    folder = model.dir / str(version)
    scratch = model.dir / f".{version}.building"
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        build_draft_engine(repo, checkpoint, scratch, console)
        shutil.copyfile(model.dir / str(model.active) / "model.py", scratch / "model.py")
        os.replace(scratch, folder)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    entry = {"engine_dir": str(folder / ENGINE_SUBDIR), "checkpoint": checkpoint, "at": _now()}
    try:
        _switch(model, version, entry, model.history.get("trail", [1]) + [version], url, headers, timeout)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return version


def previous(repo: str | os.PathLike, *, url: str, headers: dict[str, str], timeout: float = 300.0) -> int:
    """Load the version that was active before the current one again; returns it."""
    repo = Path(repo)
    refuse_mpi(repo)
    model = read_draft_model(repo)
    trail = model.history.get("trail", [1])
    if len(trail) < 2:
        raise PromoteError(f"--previous: {DRAFT_MODEL} of {repo} has had no promotion to go back from")
    back = trail[-2]
    entry = model.history["versions"][str(back)]
    if not Path(entry["engine_dir"]).is_dir():
        raise PromoteError(f"--previous: version {back}'s engine {entry['engine_dir']} is gone; promote it again")
    if not (model.dir / str(back)).is_dir():
        raise PromoteError(f"--previous: {model.dir / str(back)} is gone; promote that draft again")
    _switch(model, back, entry, trail[:-1], url, headers, timeout)
    return back


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
