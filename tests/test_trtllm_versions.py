"""Which TensorRT-LLM trtspec runs on: the production line is 1.2.x (pinned 1.2.1, NVIDIA's 26.07 Triton container).
Upstream removed the TensorRT engine backend (trtllm-build, the Triton tensorrtllm backend) after 1.3.0rc20. Each
faked install gets the guard's verdict: accepted, accepted with a note (a 1.3.0 pre-release that still has the
backend), or refused in one sentence naming the release and image to use, from the guard itself and from
`trtspec doctor` (`trtspec build` is tested in test_trtllm_build.py)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from click.testing import CliRunner

from trtspec import doctor
from trtspec.cli import cli
from trtspec.environment import (
    CONTAINER_IMAGE,
    PINNED_TRTLLM,
    Package,
    UnsupportedVersion,
    build_command_present,
    check_trtllm_install,
    outside_line_note,
)

TRTLLM_BUILD = "/usr/local/bin/trtllm-build"


def one_sentence_naming_what_to_use(text: str) -> bool:
    """One sentence (no line break, no full stop followed by a new sentence), naming the pinned release and image."""
    return (
        "\n" not in text
        and text.endswith(".")
        and re.search(r"[.!?]\s+[A-Z]", text) is None
        and f"TensorRT-LLM {PINNED_TRTLLM}" in text
        and CONTAINER_IMAGE in text
    )


@pytest.mark.parametrize(
    "version,note",
    [
        ("1.2.1", False),
        ("1.2.0", False),
        ("1.1.0", False),
        ("0.20.0", False),
        ("1.3.0rc5", True),
        ("1.3.0rc20", True),
        ("1.3.0rc20.post1", True),
    ],
)
def test_releases_with_the_engine_backend_are_accepted(version, note):
    parsed = check_trtllm_install(version, TRTLLM_BUILD, True)
    text = outside_line_note(parsed)
    assert (text is not None) is note
    if note:
        assert "pre-release outside trtspec's production line (1.2.x)" in text and CONTAINER_IMAGE in text


@pytest.mark.parametrize(
    "version,trtllm_build,build_command,why",
    [
        ("1.3.0rc21", TRTLLM_BUILD, True, "has no TensorRT engine backend"),
        ("1.3.0", TRTLLM_BUILD, True, "has no TensorRT engine backend"),
        ("1.3.1", None, False, "has no TensorRT engine backend"),
        ("1.4.0rc1", None, None, "has no TensorRT engine backend"),
        ("2.0.0", None, False, "has no TensorRT engine backend"),
        # the version allows it, but the install has no trtllm-build: its module gone, or only off PATH
        ("1.3.0rc20", None, False, "has no trtllm-build"),
        ("1.2.1", TRTLLM_BUILD, False, "has no trtllm-build"),
        ("1.2.1", None, True, "trtllm-build is not on PATH"),
        ("1.2.1", None, None, "trtllm-build is not on PATH"),
        ("0.19.0", TRTLLM_BUILD, True, "older than 0.20.0"),
        (None, None, None, "TensorRT-LLM is not installed"),
        ("banana", None, None, "not a version number"),
    ],
)
def test_installs_without_the_engine_backend_are_refused_in_one_sentence(version, trtllm_build, build_command, why):
    with pytest.raises(UnsupportedVersion) as exc:
        check_trtllm_install(version, trtllm_build, build_command)
    text = str(exc.value)
    assert why in text
    assert one_sentence_naming_what_to_use(text), text


def test_the_build_command_module_is_looked_for_without_importing(tmp_path):
    package = tmp_path / "site-packages" / "tensorrt_llm"
    (package / "commands").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    assert build_command_present(Package("tensorrt_llm", "1.3.0", str(package))) is False
    (package / "commands" / "build.py").write_text("")
    assert build_command_present(Package("tensorrt_llm", "1.2.1", str(package))) is True
    # a distribution's location (site-packages), as find_package gives when the module cannot be found
    assert build_command_present(Package("tensorrt_llm", "1.2.1", str(package.parent))) is True
    assert build_command_present(Package("tensorrt_llm", "1.2.1", str(tmp_path / "elsewhere"))) is None
    assert build_command_present(Package("tensorrt_llm", None, None)) is None


# ---- trtspec doctor ---------------------------------------------------------------------------------------------


def _fake_install(tmp_path, monkeypatch, version: str, *, trtllm_build: bool, build_module: bool) -> None:
    package = tmp_path / "site-packages" / "tensorrt_llm"
    (package / "commands").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if build_module:
        (package / "commands" / "build.py").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if trtllm_build:
        script = bin_dir / "trtllm-build"
        script.write_text("#!/bin/sh\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))  # nvidia-smi and mpirun absent too: doctor reports them as such
    monkeypatch.setattr(doctor, "installed_trtllm", lambda: Package("tensorrt_llm", version, str(package)))


@pytest.mark.parametrize(
    "version,trtllm_build,build_module,supported,why",
    [
        ("1.2.1", True, True, True, None),
        ("1.3.0rc20", True, True, True, "pre-release outside trtspec's production line"),
        ("1.3.0rc21", False, False, False, "has no TensorRT engine backend"),
        ("1.3.0", False, False, False, "has no TensorRT engine backend"),
        ("2.0.0", False, False, False, "has no TensorRT engine backend"),
        ("1.2.1", False, True, False, "trtllm-build is not on PATH"),
    ],
)
def test_doctor_names_the_release_and_image_to_use(
    tmp_path, monkeypatch, version, trtllm_build, build_module, supported, why
):
    if shutil.which("trtllm-build"):
        pytest.skip("this machine has a trtllm-build of its own")
    _fake_install(tmp_path, monkeypatch, version, trtllm_build=trtllm_build, build_module=build_module)
    result = CliRunner().invoke(cli, ["doctor", "--json"])
    assert result.exit_code == 0, result.output  # a report, not a failure
    report = json.loads(result.output)["tensorrt_llm"]
    assert (report["version"], report["supported"]) == (version, supported)
    assert (report["trtllm_build"] is not None) is trtllm_build
    if supported:
        assert report["verdict"] == "supported (trtllm-build with draft_tokens_external)"
        assert (report["note"] is not None) is (why is not None)
    else:
        assert why in report["verdict"] and one_sentence_naming_what_to_use(report["verdict"])
        assert report["note"] is None

    result = CliRunner().invoke(cli, ["doctor"], env={"COLUMNS": "1000"})
    assert result.exit_code == 0, result.output
    shown = report["note"] if supported else report["verdict"]
    if shown:  # the sentence, on a line of its own
        assert any(line.strip() == shown for line in result.output.splitlines()), result.output
