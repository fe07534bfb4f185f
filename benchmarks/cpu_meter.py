"""Wall time of a block of work and the CPU that other processes used meanwhile (Linux /proc), so a benchmark can
say how noisy the machine was while it measured."""

from __future__ import annotations

import gc
import os
import time


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


def _own_jiffies() -> int:
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime of all threads


class CpuMeter:
    """Wall time of a block and how many cores other processes kept busy meanwhile (a noise indicator)."""

    def __enter__(self):
        gc.collect()
        self.start, self.busy, self.own = time.perf_counter(), _busy_jiffies(), _own_jiffies()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        hz = os.sysconf("SC_CLK_TCK")
        others = (_busy_jiffies() - self.busy) - (_own_jiffies() - self.own)
        self.others_cores = max(others, 0) / hz / max(self.seconds, 1e-9)
        return False

    def summary(self) -> dict:
        return {"seconds": round(self.seconds, 2), "other_processes_cores": round(self.others_cores, 2)}
