"""What the benchmark scripts share: the machine's CPU flags, wall time with the CPU other processes used meanwhile
(Linux /proc, so a benchmark can say how noisy the machine was), the serving processes' own CPU, and the
--num-prompts option. A script beside this file imports it by name (`from common import ...`): run as
`python benchmarks/NAME.py`, its own folder is first on the path."""

from __future__ import annotations

import argparse
import gc
import os
import time

PROMPTS_MOVED = "in trtspec --prompts names a prompt source (a file or spec), not a count"


class _PromptsMoved(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"--prompts {values}: {PROMPTS_MOVED}; give --num-prompts {values}")


def add_num_prompts(parser: argparse.ArgumentParser, default: int, help: str) -> None:
    """--num-prompts N, and a hidden --prompts that refuses a count with an error naming --num-prompts (as the
    trtspec commands do)."""
    parser.add_argument("--num-prompts", type=int, default=default, help=help)
    parser.add_argument("--prompts", action=_PromptsMoved, help=argparse.SUPPRESS)


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def _busy_jiffies() -> int:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return sum(values[:8]) - idle


def process_jiffies(pid: str) -> int:
    """utime + stime of all of a process's threads (0 for a process that is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def serving_processes(server: int | None = None) -> dict[str, str]:
    """The processes of a trtspec deployment on this machine, by role: `tritonserver`, each Python-backend model's
    stub by its model's name, and `trtspec serve` (which hosts the OpenAI front); empty where none runs here.
    `server`: the pid of the tritonserver or of the `trtspec serve` that started it, to take that server's processes
    alone where several servers run."""
    found, parents, argvs = {}, {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argvs[int(pid)] = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            argvs.pop(int(pid), None)

    def under(pid: int) -> bool:
        for _ in range(3):  # the server itself, its children, their children
            if pid == server:
                return True
            pid = parents.get(pid, 0)
        return False

    for number, argv in argvs.items():
        pid = str(number)
        program = os.path.basename(argv[0].decode(errors="replace"))
        if server is not None and not under(number):
            continue
        if program == "tritonserver":
            found["tritonserver"] = pid
        elif program == "triton_python_backend_stub" and len(argv) > 1:
            found[os.path.basename(os.path.dirname(os.path.dirname(argv[1].decode(errors="replace"))))] = pid
        elif b"serve" in argv and any(os.path.basename(a.decode(errors="replace")) == "trtspec" for a in argv[:2]):
            found["trtspec serve"] = pid
    return found


class ProcessCpu:
    """CPU seconds each serving process (and this one, as `client`) used during a block of work."""

    def __init__(self, processes: dict[str, str]):
        self.processes = processes | {"client": "self"}

    def __enter__(self):
        self.start = {role: process_jiffies(pid) for role, pid in self.processes.items()}
        return self

    def __exit__(self, *exc):
        hz = os.sysconf("SC_CLK_TCK")
        self.seconds = {role: (process_jiffies(pid) - self.start[role]) / hz for role, pid in self.processes.items()}
        return False


class CpuMeter:
    """Wall time of a block and how many cores other processes kept busy meanwhile (a noise indicator)."""

    def __enter__(self):
        gc.collect()
        self.start, self.busy, self.own = time.perf_counter(), _busy_jiffies(), process_jiffies("self")
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        hz = os.sysconf("SC_CLK_TCK")
        others = (_busy_jiffies() - self.busy) - (process_jiffies("self") - self.own)
        self.others_cores = max(others, 0) / hz / max(self.seconds, 1e-9)
        return False

    def summary(self) -> dict:
        return {"seconds": round(self.seconds, 2), "other_processes_cores": round(self.others_cores, 2)}
