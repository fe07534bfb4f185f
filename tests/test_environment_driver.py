"""The NVIDIA driver against the CUDA of NVIDIA's container (`trtspec doctor`), and the container build that must not
move the image's TensorRT-LLM stack (docker/Dockerfile)."""

from __future__ import annotations

import json
import re
import shutil
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from trtspec import environment
from trtspec.cli import cli
from trtspec.environment import (
    CONTAINER_CUDA,
    CONTAINER_IMAGE,
    IMAGE_TEMPLATE,
    check_driver,
    detect_driver,
    forward_compat_libcuda,
    parse_proc_driver_version,
)

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


# ---- the verdict, a pure function of version strings --------------------------------------------------------------


@pytest.mark.parametrize(
    "driver,ok",
    [
        ("590.44.01", True),  # exactly CUDA 13.1 GA's driver
        ("590.48.01", True),
        ("595.58.03", True),
        ("610.43.02", True),
        ("620.10", True),
        ("590.44.00", False),  # one build short
        ("580.95.05", False),  # R580: CUDA 13.x by minor version compatibility only
        ("580.65.06", False),
        ("575.57.08", False),
        ("550.54.15", False),
        ("535.104.05", False),  # the H100 hosts still on R535
        ("470.57.02", False),
        (None, None),  # no driver: nothing to judge
        ("N/A", None),
        ("", None),
    ],
)
def test_the_pinned_image_needs_the_cuda_13_1_driver(driver, ok):
    check = check_driver(driver)
    assert (check.image, check.cuda, check.required) == (CONTAINER_IMAGE, "13.1.0", "590.44.01")
    assert check.ok is ok
    assert "590.44.01" in check.verdict
    if ok is True:
        assert "OK" in check.verdict and "NOT OK" not in check.verdict and not check.advice
    if ok is False:
        assert f"driver {driver}: NOT OK" in check.verdict
        assert check.advice[0].startswith("upgrade the host driver to 590.44.01 or newer")
        assert "forward compatibility" in check.advice[1] and "cuda-compat-13-1" in check.advice[1]
        assert "/usr/local/cuda-13.1/compat" in check.advice[1]
    if driver is None:
        assert "no NVIDIA driver on this machine" in check.verdict and "embedded CPU backend works" in check.verdict


@pytest.mark.parametrize(
    "driver,tag",
    [
        ("580.95.05", "26.02"),  # CUDA 13.0.2, TensorRT-LLM 1.1.0
        ("580.65.06", "25.10"),  # 13.0 GA's driver is below 13.0 Update 2's: back to CUDA 12.9
        ("575.57.08", "25.10"),  # CUDA 12.9.1, TensorRT-LLM 1.0.0
        ("575.51.03", "25.08"),
        ("535.104.05", None),  # below every supported image: forward compatibility or a new driver
    ],
)
def test_an_old_driver_is_told_the_newest_image_it_runs(driver, tag):
    advice = check_driver(driver).advice
    assert len(advice) == 3
    if tag is None:
        assert advice[2].startswith("no supported image runs on this driver")
    else:
        assert f"--build-arg BASE_IMAGE={IMAGE_TEMPLATE.format(tag)}" in advice[2]
        assert f"TensorRT-LLM {environment.CONTAINER_TRTLLM[tag]}" in advice[2]
        assert check_driver(driver, IMAGE_TEMPLATE.format(tag)).ok is True


def test_older_images_need_older_drivers():
    assert check_driver("580.95.05", IMAGE_TEMPLATE.format("26.02")).ok is True
    assert check_driver("580.82.07", IMAGE_TEMPLATE.format("26.02")).ok is False
    assert check_driver("575.51.03", IMAGE_TEMPLATE.format("25.06")).ok is True
    with pytest.raises(ValueError, match="no CUDA on record"):
        check_driver("590.44.01", IMAGE_TEMPLATE.format("24.10"))


def test_forward_compatibility_in_use_makes_an_old_driver_ok():
    check = check_driver("535.104.05", compat="590.44.01")
    assert check.ok is True and "forward compatibility is on" in check.verdict
    assert check_driver("535.104.05", compat="580.95.05").ok is False  # a compat package older than the image's CUDA


def test_the_facts_are_one_table_that_covers_every_image_on_record():
    assert CONTAINER_CUDA.keys() == environment.CONTAINER_TRTLLM.keys()
    assert CONTAINER_CUDA[environment.container_tag(CONTAINER_IMAGE)] == ("13.1.0", "590.44.01")
    by_cuda: dict[str, str] = {}
    for tag, (cuda, driver) in CONTAINER_CUDA.items():
        assert re.fullmatch(r"\d\d\.\d\d", tag) and re.fullmatch(r"\d+\.\d+\.\d+", cuda)
        assert check_driver(driver, IMAGE_TEMPLATE.format(tag)).ok is True
        assert by_cuda.setdefault(cuda, driver) == driver  # one CUDA release, one driver
    tags = sorted(CONTAINER_CUDA)
    drivers = [tuple(int(p) for p in CONTAINER_CUDA[t][1].split(".")) for t in tags]
    assert drivers == sorted(drivers)  # newer images never need less


# ---- reading the driver ---------------------------------------------------------------------------------------------


def test_proc_driver_version_formats():
    proprietary = (
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
        "GCC version:  gcc version 12.2.0 (Ubuntu 12.2.0-14ubuntu2)\n"
    )
    open_module = (
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  590.44.01  Release Build  "
        "(dvs-builder@U22-I3-AE18-23-3)  Mon Nov 24 12:00:00 UTC 2025\n"
    )
    assert parse_proc_driver_version(proprietary) == "535.104.05"
    assert parse_proc_driver_version(open_module) == "590.44.01"
    assert parse_proc_driver_version("GCC version: gcc 12\n") is None


def _fake_nvidia_smi(directory: Path, driver_lines: str) -> None:
    smi = directory / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nprintf '{driver_lines}'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)


def test_detect_driver_asks_nvidia_smi_then_proc(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    proc = tmp_path / "version"
    probe = detect_driver(proc)
    assert probe.version is None and probe.tried == ["nvidia-smi: not on PATH", f"{proc}: absent"]

    proc.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  Thu Sep 25 2025\n")
    probe = detect_driver(proc)
    assert (probe.version, probe.source) == ("580.95.05", str(proc))

    _fake_nvidia_smi(bin_dir, "590.48.01\\n590.48.01\\n")  # one line per GPU
    probe = detect_driver(proc)
    assert (probe.version, probe.source) == ("590.48.01", "nvidia-smi")


def test_forward_compat_libcuda_is_found_on_ld_library_path(tmp_path):
    compat = tmp_path / "cuda-13.1" / "compat"
    compat.mkdir(parents=True)
    (compat / "libcuda.so.1").touch()
    (compat / "libcuda.so.590.44.01").touch()
    plain = tmp_path / "lib64"
    plain.mkdir()
    (plain / "libcuda.so.535.104.05").touch()  # the host's own: not a compat package
    assert forward_compat_libcuda(f"{plain}:{compat}") == ("590.44.01", str(compat / "libcuda.so.590.44.01"))
    assert forward_compat_libcuda(f"{plain}:{tmp_path / 'missing-compat'}") is None
    assert forward_compat_libcuda("") is None


# ---- trtspec doctor -------------------------------------------------------------------------------------------------


def test_doctor_on_this_machine_says_there_is_no_driver():
    """This machine has no GPU: doctor says so plainly and exits 0, as it did before the driver check."""
    if shutil.which("nvidia-smi") or environment.PROC_DRIVER_VERSION.exists():
        pytest.skip("this machine has an NVIDIA driver")
    result = CliRunner().invoke(cli, ["doctor"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    driver = next(i for i, line in enumerate(lines) if line.strip().startswith("driver"))
    assert "none found (nvidia-smi: not on PATH; /proc/driver/nvidia/version: absent)" in lines[driver]
    assert "no NVIDIA driver on this machine, so no GPU: the embedded CPU backend works here" in lines[driver + 1]
    assert "needs driver >= 590.44.01" in lines[driver + 1]

    result = CliRunner().invoke(cli, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)["driver"]
    assert report["version"] is None and report["ok"] is None and report["advice"] == []
    assert (report["image"], report["cuda"], report["required"]) == (CONTAINER_IMAGE, "13.1.0", "590.44.01")


def test_doctor_with_an_old_driver_says_not_ok_and_what_to_do(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, "535.104.05\\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    monkeypatch.delenv("NVIDIA_TRITON_SERVER_VERSION", raising=False)
    result = CliRunner().invoke(cli, ["doctor"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output  # a report, not a failure
    assert "535.104.05  (nvidia-smi)" in result.output
    assert "driver 535.104.05: NOT OK" in result.output and "needs driver >= 590.44.01" in result.output
    assert "- upgrade the host driver to 590.44.01 or newer" in result.output
    assert "cuda-compat-13-1" in result.output

    report = json.loads(CliRunner().invoke(cli, ["doctor", "--json"]).output)["driver"]
    assert (report["version"], report["source"], report["ok"]) == ("535.104.05", "nvidia-smi", False)
    assert len(report["advice"]) == 3


def test_doctor_inside_an_older_nvidia_image_compares_with_that_image(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, "580.95.05\\n")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("NVIDIA_TRITON_SERVER_VERSION", "26.02")  # what NVIDIA's Triton images set
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)
    report = json.loads(CliRunner().invoke(cli, ["doctor", "--json"]).output)["driver"]
    assert (report["image"], report["cuda"], report["ok"]) == (IMAGE_TEMPLATE.format("26.02"), "13.0.2", True)


# ---- the container build ----------------------------------------------------------------------------------------


def _instructions(text: str) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined and comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return [i.strip() for i in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines() if i.strip()]


def test_dockerfile_pins_tritonclient_constrains_to_the_image_and_runs_pip_check():
    """An unpinned tritonclient pulls today's protobuf/grpcio/ml-dtypes into TensorRT-LLM's Python."""
    runs = [i for i in _instructions(DOCKERFILE.read_text()) if i.startswith("RUN ")]
    steps = [step.strip() for run in runs for step in run.removeprefix("RUN ").split("&&")]
    installs = " ".join(s for s in steps if "pip install" in s)
    specs = re.findall(r"\btritonclient(?:\[[^\]]*\])?([^\"'\s]*)", installs)
    assert specs and all(spec.startswith("==") for spec in specs), specs
    # pinned to the base image's own Triton release (2.71.0 in 26.07), whatever BASE_IMAGE is
    assert '"tritonclient[grpc,http]==${TRITON_SERVER_VERSION:?' in installs

    freeze = next(
        i
        for i, s in enumerate(steps)
        if re.search(r"pip (list --format=freeze|freeze)\b", s) and "> /tmp/image-constraints.txt" in s
    )
    install = next(i for i, s in enumerate(steps) if "pip install" in s and "tritonclient" in s)
    assert freeze < install and "-c /tmp/image-constraints.txt" in steps[install]
    checks = [i for i, s in enumerate(steps) if re.search(r"\bpip check\b(?!:)", s)]
    assert checks and max(checks) > install  # after the installs, and the build fails on it
    assert any("exit 1" in s for s in steps[max(checks) :])


def test_dockerfile_starts_through_nvidia_entrypoint_for_forward_compatibility():
    instructions = _instructions(DOCKERFILE.read_text())
    entrypoint = json.loads(next(i for i in instructions if i.startswith("ENTRYPOINT ")).removeprefix("ENTRYPOINT "))
    assert entrypoint == ["/opt/nvidia/nvidia_entrypoint.sh", "trtspec"]
    assert any("test -x /opt/nvidia/nvidia_entrypoint.sh" in i for i in instructions if i.startswith("RUN "))
