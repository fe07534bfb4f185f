"""What this machine offers the production (TensorRT-LLM) path: GPUs, the NVIDIA driver, and the TensorRT-LLM,
TensorRT and Triton installs, each found without importing the heavy packages. `trtspec doctor` prints it;
`trtspec build` uses the GPU list for its memory plan and the version guard before it runs any TensorRT-LLM step.

The production line is TensorRT-LLM 1.2.x (pinned 1.2.1, in NVIDIA's 26.07 Triton container): upstream removed
`trtllm-build` and the legacy Triton backend after it. The version guard is a pure function over version strings
(`check_trtllm_version`): releases from SUPPORTED_MIN up to and including 1.3.0rc20 ship `trtllm-build` with
`--speculative_decoding_mode draft_tokens_external` and the Triton C++ `tensorrtllm` backend; the next release
candidate removed the TensorRT engine backend (v1.3.0rc20's release notes, 2026-06-30: "This RC version will be the
last one supporting the TensorRT backend"; NVIDIA/TensorRT-LLM PRs #15763, #15767, #15907, #15918 and #16369 removed it
on main, #15918 deleting `tensorrt_llm/commands/build.py`, trtllm-build's entry point). `check_trtllm_install` adds what
the version alone cannot tell: an install whose `trtllm-build` is gone.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

# ---- versions ----------------------------------------------------------------------------------------------

# Oldest release whose Triton backend takes the tensor names of trtspec.contract (`seed`, `min_tokens`: renamed from
# `random_seed`/`min_length` after v0.19.0) and returns the speculative-decoding perf outputs (`acceptance_rate`, ...).
SUPPORTED_MIN = Version("0.20.0")
# Last release with the TensorRT engine backend; everything after it (1.3.0rc21, 1.3.0, 1.4, ...) has none.
LAST_WITH_TRT_BACKEND = Version("1.3.0rc20")
# The release trtspec pins (pyproject `trtllm` extra) and the NVIDIA container that ships it. Source: Triton's
# release compatibility matrix (triton-inference-server/server docs/introduction/compatibility.md): the
# 26.04 to 26.07 trtllm-python-py3 images carry TensorRT-LLM 1.2.1 (26.03: 1.2.0; 25.12 to 26.02: 1.1.0).
PINNED_TRTLLM = "1.2.1"
IMAGE_TEMPLATE = "nvcr.io/nvidia/tritonserver:{}-trtllm-python-py3"
CONTAINER_IMAGE = IMAGE_TEMPLATE.format("26.07")
CONTAINER_TRTLLM = {
    "26.07": "1.2.1",
    "26.06": "1.2.1",
    "26.05": "1.2.1",
    "26.04": "1.2.1",
    "26.03": "1.2.0",
    "26.02": "1.1.0",
    "26.01": "1.1.0",
    "25.12": "1.1.0",
    "25.11": "1.0.3.2510",
    "25.10": "1.0.0",
    "25.09": "1.0.0",
    "25.08": "0.21.0",
    "25.07": "0.20.0",
    "25.06": "0.20.0",
}
TRTLLM_DISTRIBUTIONS = ("tensorrt_llm", "tensorrt-llm")
TENSORRT_DISTRIBUTIONS = ("tensorrt", "tensorrt-cu13", "tensorrt_cu13", "tensorrt-cu12", "tensorrt_cu12")


class UnsupportedVersion(Exception):
    """A TensorRT-LLM install trtspec's production path cannot drive; its text is one sentence naming what to use."""


def use_instead() -> str:
    """The end of every refusal: the release and the image to use."""
    return (
        f"use TensorRT-LLM {PINNED_TRTLLM}, trtspec's production line (1.2.x), in NVIDIA's container "
        f"{CONTAINER_IMAGE} or with `pip install 'trtspec[trtllm]'`"
    )


def has_engine_backend(version: Version) -> bool:
    """Whether a release still ships the TensorRT engine backend: everything up to 1.3.0rc20 (and rc20's post and dev
    builds); 1.3.0rc21, 1.3.0 and every later release do not."""
    if version.release != LAST_WITH_TRT_BACKEND.release:
        return version.release < LAST_WITH_TRT_BACKEND.release
    return not _after_rc20(version)


def check_trtllm_version(version: str | None) -> Version:
    """The parsed version when trtspec can build and serve with it; UnsupportedVersion saying why and what works."""
    if version is None:
        raise UnsupportedVersion(f"TensorRT-LLM is not installed, and the trtllm backend needs it: {use_instead()}.")
    try:
        parsed = Version(version)
    except InvalidVersion as exc:
        raise UnsupportedVersion(f"TensorRT-LLM version {version!r} is not a version number: {use_instead()}.") from exc
    if not has_engine_backend(parsed):
        raise UnsupportedVersion(
            f"TensorRT-LLM {version} has no TensorRT engine backend (upstream removed trtllm-build and the Triton "
            f"tensorrtllm backend after {LAST_WITH_TRT_BACKEND}), so trtspec cannot build or serve with it: "
            f"{use_instead()}."
        )
    if parsed < SUPPORTED_MIN:
        raise UnsupportedVersion(
            f"TensorRT-LLM {version} is older than {SUPPORTED_MIN}, the oldest release whose Triton backend speaks "
            f"trtspec's tensor contract: {use_instead()}."
        )
    return parsed


def check_trtllm_install(version: str | None, trtllm_build: str | None, build_command: bool | None = None) -> Version:
    """`check_trtllm_version`, and `trtllm-build` on PATH (`trtllm_build`: its path, or None). `build_command`: whether
    the package still holds trtllm-build's module (tensorrt_llm/commands/build.py; None: not known), which tells an
    install without the engine backend from one whose `trtllm-build` is merely off PATH."""
    parsed = check_trtllm_version(version)
    if build_command is False:  # a trtllm-build left on PATH without its module cannot run either
        raise UnsupportedVersion(
            f"TensorRT-LLM {version} has no trtllm-build (tensorrt_llm/commands/build.py is gone, as in the releases "
            f"after {LAST_WITH_TRT_BACKEND}), so trtspec cannot build or serve with it: {use_instead()}."
        )
    if trtllm_build is None:
        raise UnsupportedVersion(
            f"trtllm-build is not on PATH although TensorRT-LLM {version} is installed, so trtspec cannot build with "
            f"it: run in the environment that installed it, or {use_instead()}."
        )
    return parsed


def outside_line_note(version: Version) -> str | None:
    """A sentence for a release trtspec accepts but that is not its production line: a 1.3.0 pre-release that still has
    the engine backend. No Triton container ships one (Triton's compatibility matrix: 26.07 carries 1.2.1), and
    TensorRT engines run only under the release that built them."""
    if version.release != LAST_WITH_TRT_BACKEND.release:
        return None
    return (
        f"TensorRT-LLM {version} is a pre-release outside trtspec's production line (1.2.x): it still has "
        "trtllm-build, but no Triton container ships it, so its engines need a tensorrtllm backend built from the "
        f"same release; the supported path is {PINNED_TRTLLM} in {CONTAINER_IMAGE}"
    )


def _after_rc20(v: Version) -> bool:
    """On 1.3.0: rc20 and its post/dev builds keep the backend; rc21 onwards and the final release do not."""
    if v.pre is None:
        return v.dev is None  # 1.3.0 final (a 1.3.0.devN build predates every rc: keep it)
    kind, number = v.pre
    return kind != "a" and kind != "b" and number > LAST_WITH_TRT_BACKEND.pre[1]


@dataclass(frozen=True)
class Package:
    name: str
    version: str | None
    location: str | None

    @property
    def found(self) -> bool:
        return self.version is not None


def find_package(distributions: tuple[str, ...], module: str | None = None) -> Package:
    """A package's version (from its metadata) and where it is, without importing it."""
    for dist in distributions:
        try:
            meta = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        location = None
        if module:
            spec = importlib.util.find_spec(module)
            location = str(Path(spec.origin).parent) if spec is not None and spec.origin else None
        return Package(dist, meta.version, location or str(meta.locate_file("")))
    return Package(distributions[0], None, None)


def installed_trtllm() -> Package:
    return find_package(TRTLLM_DISTRIBUTIONS, "tensorrt_llm")


def build_command_present(package: Package) -> bool | None:
    """Whether the installed package holds trtllm-build's module (tensorrt_llm/commands/build.py), read from its
    files without importing it; None when the package's directory is not known."""
    if package.location is None:
        return None
    location = Path(package.location)
    for directory in (location, location / "tensorrt_llm"):
        if (directory / "__init__.py").is_file():
            return (directory / "commands" / "build.py").is_file()
    return None


def require_trtllm() -> Version:
    """The installed TensorRT-LLM's version when it can build engines (trtllm-build on PATH), or UnsupportedVersion:
    one sentence naming the release and the image to use."""
    package = installed_trtllm()
    return check_trtllm_install(package.version, shutil.which("trtllm-build"), build_command_present(package))


# ---- GPUs --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuType:
    name: str
    memory_gib: float  # as nvidia-smi reports it (MiB / 1024)
    sm: int
    nominal: str  # how NVIDIA sells it


# Named GPUs a build config may plan for. Memory is the usable total nvidia-smi reports, not the marketing figure.
GPU_TYPES = {
    "H100": GpuType("H100", 81559 / 1024, 90, "80 GB"),
    "H100-NVL": GpuType("H100-NVL", 95830 / 1024, 90, "94 GB"),
    "H200": GpuType("H200", 143771 / 1024, 90, "141 GB"),
    "GH200": GpuType("GH200", 97871 / 1024, 90, "96 GB"),
    "A100": GpuType("A100", 81920 / 1024, 80, "80 GB"),
    "L40S": GpuType("L40S", 46068 / 1024, 89, "48 GB"),
    "L4": GpuType("L4", 23034 / 1024, 89, "24 GB"),
}
FP8_MIN_SM = 89  # Ada (SM89), Hopper (SM90) and Blackwell run FP8; Ampere (SM80/86) does not


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_gib: float
    sm: int | None
    source: str  # "nvidia-smi", "torch" or "config"

    @property
    def fp8(self) -> bool:
        return self.sm is not None and self.sm >= FP8_MIN_SM


@dataclass
class GpuReport:
    gpus: list[Gpu] = field(default_factory=list)
    tried: list[str] = field(default_factory=list)  # what was asked, and why it gave nothing


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """Rows of `nvidia-smi --query-gpu=index,name,memory.total,compute_cap --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        sm = None
        if len(parts) > 3:
            try:
                major, _, minor = parts[3].partition(".")
                sm = int(major) * 10 + int(minor or 0)
            except ValueError:
                sm = None
        try:
            memory = float(parts[2]) / 1024
        except ValueError:
            continue
        gpus.append(Gpu(int(parts[0]), parts[1], memory, sm, "nvidia-smi"))
    return gpus


def nvidia_smi(args: list[str], tried: list[str]) -> subprocess.CompletedProcess | None:
    """nvidia-smi's answer to `args`; None, with the reason added to `tried`, when it is absent or fails to run."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        tried.append("nvidia-smi: not on PATH")
        return None
    try:
        return subprocess.run([smi, *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        tried.append(f"nvidia-smi: {exc}")
        return None


def detect_gpus() -> GpuReport:
    """The GPUs this machine has: nvidia-smi first, then torch.cuda; an empty list (with the reasons) when none."""
    report = GpuReport()
    out = nvidia_smi(["--query-gpu=index,name,memory.total,compute_cap", "--format=csv,noheader,nounits"], report.tried)
    if out is not None:
        report.gpus = parse_nvidia_smi(out.stdout)
        if not report.gpus:
            report.tried.append(f"nvidia-smi: no GPU listed (exit {out.returncode}: {out.stderr.strip()[:200]})")
    if report.gpus:
        return report
    try:
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                report.gpus.append(
                    Gpu(i, props.name, props.total_memory / 2**30, props.major * 10 + props.minor, "torch")
                )
        else:
            report.tried.append(f"torch {torch.__version__}: torch.cuda.is_available() is False")
    except Exception as exc:  # a broken CUDA install raises many kinds
        report.tried.append(f"torch: {exc}")
    return report


def named_gpus(gpu_type: str, count: int, memory_gib: float | None = None) -> list[Gpu]:
    """The GPUs a build config names (`gpu: {type, count, memory_gb}`)."""
    known = GPU_TYPES.get(gpu_type)
    memory = memory_gib if memory_gib is not None else (known.memory_gib if known else None)
    if memory is None:
        raise ValueError(f"GPU type {gpu_type!r} is not one of {', '.join(GPU_TYPES)}: give gpu.memory_gb")
    return [Gpu(i, gpu_type, memory, known.sm if known else None, "config") for i in range(count)]


def available_gpus(config) -> tuple[list[Gpu], str]:
    """The GPUs to plan against (for a BuildConfig) and where they came from: the machine's, else the config's."""
    report = detect_gpus()
    if report.gpus:
        return report.gpus, "detected: " + ", ".join(f"{g.index}:{g.name}" for g in report.gpus)
    g = config.gpu
    if g.type or g.memory_gb:
        count = g.count or max(max(getattr(g, f"{r}_devices") or [0]) + 1 for r in ("target", "draft"))
        count = max(count, config.target.tp_size * config.target.pp_size)
        return named_gpus(g.type or "custom", count, g.memory_gb), f"named in the config: {count} x {g.type or 'GPU'}"
    return [], "no GPU detected and none named in the config (gpu: {type, count})"


# ---- the NVIDIA driver -------------------------------------------------------------------------------------

# The one place for image -> CUDA -> driver. CUDA: the "CUDA version" column of Triton's release compatibility matrix
# for the trtllm-python-py3 images (triton-inference-server/server, docs/introduction/compatibility.md); these are
# older than the same month's plain Triton image (Triton's 26.07 release notes say CUDA 13.3.1; its trtllm-python-py3
# image is CUDA 13.1.0). Driver: the Linux x86_64 driver NVIDIA's CUDA Toolkit Release Notes give for that CUDA
# release, table "CUDA Toolkit and Corresponding Driver Versions" (13.1 GA >= 590.44.01, 13.0 Update 2 >= 580.95.05,
# 12.9 Update 1 >= 575.57.08, 12.9 GA >= 575.51.03), which is also the matrix's "CUDA Driver version" column.
# An older driver of the same CUDA major (R580 under a 13.1 image) runs it only by minor version compatibility, which
# lacks the newer CUDA's features and its PTX JIT (NVIDIA's CUDA Compatibility guide): NVIDIA's images ask for the full
# driver, or forward compatibility on data-center GPUs.
CONTAINER_CUDA = {
    "26.07": ("13.1.0", "590.44.01"),
    "26.06": ("13.1.0", "590.44.01"),
    "26.05": ("13.1.0", "590.44.01"),
    "26.04": ("13.1.0", "590.44.01"),
    "26.03": ("13.1.0", "590.44.01"),
    "26.02": ("13.0.2", "580.95.05"),
    "26.01": ("13.0.2", "580.95.05"),
    "25.12": ("13.0.2", "580.95.05"),
    "25.11": ("13.0.2", "580.95.05"),
    "25.10": ("12.9.1", "575.57.08"),
    "25.09": ("12.9.1", "575.57.08"),
    "25.08": ("12.9.0", "575.51.03"),
    "25.07": ("12.9.0", "575.51.03"),
    "25.06": ("12.9.0", "575.51.03"),
}


def container_tag(image: str) -> str:
    """'26.07' of nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3."""
    return image.rpartition(":")[2].split("-")[0]


@dataclass(frozen=True)
class DriverCheck:
    driver: str | None  # the kernel driver found; None: none on this machine
    image: str  # the container whose CUDA it is compared with
    cuda: str
    required: str  # the least driver that CUDA asks for
    ok: bool | None  # None: nothing to judge (no driver, or a version not understood)
    verdict: str
    advice: tuple[str, ...] = ()


def _driver_tuple(version: str) -> tuple[int, ...] | None:
    """(590, 44, 1) of '590.44.01'; None when it is not a driver version."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+){0,3})\s*", version)
    return tuple(int(p) for p in match.group(1).split(".")) if match else None


def check_driver(driver: str | None, image: str = CONTAINER_IMAGE, compat: str | None = None) -> DriverCheck:
    """Whether a host driver runs `image`'s CUDA: a pure function of version strings. `compat` is the libcuda
    version of a CUDA forward-compatibility package this process runs with (see `forward_compat_libcuda`)."""
    tag = container_tag(image)
    if tag not in CONTAINER_CUDA:
        raise ValueError(f"no CUDA on record for {image}: known tags are {', '.join(CONTAINER_CUDA)}")
    cuda, required = CONTAINER_CUDA[tag]
    needs = f"{image} (CUDA {cuda}) needs driver >= {required}"
    if driver is None:
        return DriverCheck(
            None,
            image,
            cuda,
            required,
            None,
            f"no NVIDIA driver on this machine, so no GPU: the embedded CPU backend works here; {needs} "
            f"on its GPU host",
        )
    found = _driver_tuple(driver)
    if found is None:
        return DriverCheck(driver, image, cuda, required, None, f"driver version {driver!r} not understood; {needs}")
    if found >= _driver_tuple(required):
        return DriverCheck(driver, image, cuda, required, True, f"driver {driver}: OK ({needs})")
    compat_found = _driver_tuple(compat) if compat else None
    if compat_found is not None and compat_found >= _driver_tuple(required):
        return DriverCheck(
            driver,
            image,
            cuda,
            required,
            True,
            f"driver {driver} is older, but CUDA forward compatibility is on (libcuda {compat}): "
            f"OK on a data-center GPU ({needs})",
        )
    return DriverCheck(
        driver,
        image,
        cuda,
        required,
        False,
        f"driver {driver}: NOT OK: {needs}; TensorRT-LLM engines will not load",
        _driver_advice(found, tag, cuda, required),
    )


def _driver_advice(found: tuple[int, ...], tag: str, cuda: str, required: str) -> tuple[str, ...]:
    major_minor = "-".join(cuda.split(".")[:2])
    advice = [
        f"upgrade the host driver to {required} or newer (branch R{required.split('.')[0]} or later)",
        f"or, on a data-center GPU (H100, H200, ...) whose driver branch NVIDIA's CUDA Compatibility guide supports "
        f"for it (e.g. R535, R580): CUDA forward compatibility. The trtspec image turns it on (NVIDIA's entrypoint "
        f"loads the image's cuda-compat libcuda); elsewhere install cuda-compat-{major_minor} and put "
        f"/usr/local/cuda-{cuda.rsplit('.', 1)[0]}/compat first on LD_LIBRARY_PATH",
    ]
    older = [t for t in CONTAINER_CUDA if t < tag and _driver_tuple(CONTAINER_CUDA[t][1]) <= found]
    if older:
        best = max(older)
        advice.append(
            f"or build on an older base image this driver runs: docker build -f docker/Dockerfile --build-arg "
            f"BASE_IMAGE={IMAGE_TEMPLATE.format(best)} (CUDA {CONTAINER_CUDA[best][0]}, TensorRT-LLM "
            f"{CONTAINER_TRTLLM[best]}), then build the engines again with that image"
        )
    else:
        oldest = min(CONTAINER_CUDA)
        advice.append(
            f"no supported image runs on this driver without forward compatibility (the oldest, {oldest}, "
            f"needs >= {CONTAINER_CUDA[oldest][1]})"
        )
    return tuple(advice)


@dataclass
class DriverProbe:
    version: str | None = None
    source: str | None = None  # "nvidia-smi" or "/proc/driver/nvidia/version"
    tried: list[str] = field(default_factory=list)


PROC_DRIVER_VERSION = Path("/proc/driver/nvidia/version")


def parse_proc_driver_version(text: str) -> str | None:
    """'580.65.06' of /proc/driver/nvidia/version ('NVRM version: NVIDIA UNIX [Open ]Kernel Module [for x86_64]
    580.65.06  ...')."""
    match = re.search(r"^NVRM.*?Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text, re.MULTILINE)
    return match.group(1) if match else None


def detect_driver(proc_version: Path | None = None) -> DriverProbe:
    """The kernel driver's version: nvidia-smi when it is on PATH, else /proc/driver/nvidia/version."""
    proc_version = proc_version or PROC_DRIVER_VERSION
    probe = DriverProbe()
    out = nvidia_smi(["--query-gpu=driver_version", "--format=csv,noheader"], probe.tried)
    if out is not None:
        version = next((line.strip() for line in out.stdout.splitlines() if _driver_tuple(line)), None)
        if version:
            probe.version, probe.source = version, "nvidia-smi"
            return probe
        probe.tried.append(f"nvidia-smi: no driver version (exit {out.returncode}: {out.stderr.strip()[:200]})")
    try:
        version = parse_proc_driver_version(proc_version.read_text())
    except OSError:
        probe.tried.append(f"{proc_version}: absent")
        return probe
    if version:
        probe.version, probe.source = version, str(proc_version)
    else:
        probe.tried.append(f"{proc_version}: no version in it")
    return probe


def forward_compat_libcuda(ld_library_path: str | None = None) -> tuple[str, str] | None:
    """(version, path) of the CUDA forward-compatibility libcuda this process loads first, if any: a
    libcuda.so.<driver version> in a cuda-compat directory on LD_LIBRARY_PATH (.../compat, or .../compat/lib.real),
    as NVIDIA's entrypoint sets it."""
    if ld_library_path is None:
        ld_library_path = os.environ.get("LD_LIBRARY_PATH", "")
    for entry in filter(None, ld_library_path.split(":")):
        directory = Path(entry)
        if "compat" not in directory.parts[-2:] or not directory.is_dir():
            continue
        for lib in sorted(directory.glob("libcuda.so.*")):
            version = lib.name[len("libcuda.so.") :]
            if _driver_tuple(version) and version.count(".") >= 1:
                return version, str(lib)
    return None


def running_image() -> str:
    """The container this runs in when it is one of NVIDIA's on record (NVIDIA_TRITON_SERVER_VERSION), else the one
    trtspec pins."""
    tag = os.environ.get("NVIDIA_TRITON_SERVER_VERSION", "")
    return IMAGE_TEMPLATE.format(tag) if tag in CONTAINER_CUDA else CONTAINER_IMAGE


def driver_report() -> dict:
    """`trtspec doctor`'s driver entry: what was found, what the image needs, and the verdict."""
    probe = detect_driver()
    compat = forward_compat_libcuda()
    check = check_driver(probe.version, running_image(), compat[0] if compat else None)
    return {
        "version": probe.version,
        "source": probe.source,
        "probes": probe.tried,
        "image": check.image,
        "cuda": check.cuda,
        "required": check.required,
        "ok": check.ok,
        "verdict": check.verdict,
        "advice": list(check.advice),
        "forward_compat": {"version": compat[0], "path": compat[1]} if compat else None,
    }


# ---- servers -----------------------------------------------------------------------------------------------


def find_tritonserver_binaries() -> list[tuple[str, str]]:
    """(where, path) of each tritonserver this machine has: the container's, PATH's, the nvidia-pytriton wheel's."""
    found = []
    container = Path("/opt/tritonserver/bin/tritonserver")
    if container.is_file():
        found.append(("container", str(container)))
    on_path = shutil.which("tritonserver")
    if on_path and Path(on_path).resolve() != container.resolve():
        found.append(("PATH", on_path))
    spec = importlib.util.find_spec("pytriton")
    if spec is not None and spec.submodule_search_locations:
        wheel = Path(next(iter(spec.submodule_search_locations))) / "tritonserver" / "bin" / "tritonserver"
        if wheel.is_file():
            found.append(("nvidia-pytriton wheel", str(wheel)))
    return found


def tritonserver_version(where: str, path: str) -> str | None:
    """The server's version: the container's TRITON_SERVER_VERSION, the wheel's release, else None."""
    if where == "container" and os.environ.get("TRITON_SERVER_VERSION"):
        return os.environ["TRITON_SERVER_VERSION"]
    if where == "nvidia-pytriton wheel":
        try:
            return f"as shipped in nvidia-pytriton {importlib.metadata.version('nvidia-pytriton')}"
        except importlib.metadata.PackageNotFoundError:
            return None
    return None
