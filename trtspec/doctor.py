"""`trtspec doctor`: what this machine has for the production path, and whether trtspec can use it.

GPUs (nvidia-smi, else torch.cuda) with SM and FP8 capability (SM89+) and memory; the NVIDIA driver against the
one NVIDIA's container needs (trtspec.environment.driver_report); TensorRT, TensorRT-LLM (with the guard's verdict:
a release without the TensorRT engine backend, or an install without trtllm-build, gets one sentence naming the
release and image to use) and tritonserver, each with where it was found. Nothing is imported that needs a GPU; a
machine without any of it gets 'none found' lines, not errors.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trtspec.environment import (
    CONTAINER_IMAGE,
    FP8_MIN_SM,
    TENSORRT_DISTRIBUTIONS,
    UnsupportedVersion,
    build_command_present,
    check_trtllm_install,
    detect_gpus,
    driver_report,
    find_package,
    find_tritonserver_binaries,
    installed_trtllm,
    outside_line_note,
    tritonserver_version,
)
from trtspec.server_binary import DEV_SERVER_NOTE, is_pytriton_layout


def collect() -> dict:
    gpus = detect_gpus()
    trtllm = installed_trtllm()
    trtllm_build = shutil.which("trtllm-build")
    note = None
    try:
        version = check_trtllm_install(trtllm.version, trtllm_build, build_command_present(trtllm))
        verdict, supported = "supported (trtllm-build with draft_tokens_external)", True
        note = outside_line_note(version)
    except UnsupportedVersion as exc:
        verdict, supported = str(exc), False
    tensorrt = find_package(TENSORRT_DISTRIBUTIONS, "tensorrt")
    servers = [
        {
            "where": where,
            "path": path,
            "version": tritonserver_version(where, path),
            "loopback_only": is_pytriton_layout(Path(path)),
        }
        for where, path in find_tritonserver_binaries()
    ]
    return {
        "gpus": [
            {
                "index": g.index,
                "name": g.name,
                "memory_gib": round(g.memory_gib, 1),
                "sm": g.sm,
                "fp8": g.fp8,
                "source": g.source,
            }
            for g in gpus.gpus
        ],
        "gpu_probes": gpus.tried,
        "driver": driver_report(),
        "tensorrt": {"version": tensorrt.version, "location": tensorrt.location},
        "tensorrt_llm": {
            "version": trtllm.version,
            "location": trtllm.location,
            "supported": supported,
            "verdict": verdict,
            "note": note,
            "trtllm_build": trtllm_build,
        },
        "tritonserver": servers,
        "mpirun": shutil.which("mpirun"),
        "container": CONTAINER_IMAGE,
    }


def render(report: dict, console: Console) -> None:
    table = Table(title="GPUs", show_lines=False)
    for col in ("#", "name", "memory", "SM", f"FP8 (SM{FP8_MIN_SM}+)", "found by"):
        table.add_column(col)
    for g in report["gpus"]:
        sm = f"{g['sm'] // 10}.{g['sm'] % 10}" if g["sm"] else "?"
        table.add_row(
            str(g["index"]),
            escape(g["name"]),
            f"{g['memory_gib']} GiB",
            sm,
            "[green]yes[/]" if g["fp8"] else "[red]no[/]",
            g["source"],
        )
    if report["gpus"]:
        console.print(table)
    else:
        console.print("[bold]GPUs:[/] none found (" + escape("; ".join(report["gpu_probes"])) + ")", highlight=False)

    rows = Table(show_header=False, box=None, padding=(0, 2))
    rows.add_column(no_wrap=True)
    rows.add_column(overflow="fold")
    trt, llm = report["tensorrt"], report["tensorrt_llm"]
    rows.add_row("[bold]tensorrt[/]", _found(trt["version"], trt["location"]))
    rows.add_row("[bold]tensorrt_llm[/]", _found(llm["version"], llm["location"]))
    rows.add_row("", ("[green]" if llm["supported"] else "[yellow]") + escape(llm["verdict"]) + "[/]")
    if llm["note"]:
        rows.add_row("", f"[yellow]{escape(llm['note'])}[/]")
    rows.add_row("[bold]trtllm-build[/]", escape(llm["trtllm_build"]) if llm["trtllm_build"] else "none found on PATH")
    if report["tritonserver"]:
        for s in report["tritonserver"]:
            version = f" ({escape(s['version'])})" if s["version"] else ""
            rows.add_row("[bold]tritonserver[/]", f"{escape(s['path'])} [{s['where']}]{version}")
            if s["loopback_only"]:
                rows.add_row("", f"[yellow]{escape(DEV_SERVER_NOTE)}[/]")
    else:
        rows.add_row("[bold]tritonserver[/]", "none found")
    rows.add_row(
        "[bold]mpirun[/]",
        escape(report["mpirun"]) if report["mpirun"] else "none found (needed for TP>1 and draft+target serving)",
    )
    driver = report["driver"]
    rows.add_row(
        "[bold]driver[/]",
        f"{escape(driver['version'])}  ({escape(driver['source'])})"
        if driver["version"]
        else "none found (" + escape("; ".join(driver["probes"])) + ")",
    )
    colour = {True: "green", False: "red", None: "yellow"}[driver["ok"]]
    rows.add_row("", f"[{colour}]{escape(driver['verdict'])}[/]")
    for advice in driver["advice"]:
        rows.add_row("", f"- {escape(advice)}")
    console.print(rows)


def _found(version: str | None, location: str | None) -> str:
    if version is None:
        return "none found"
    return f"{escape(version)}  ({escape(location or '?')})"
