"""Plumbing of bench/peers.py: a peer (an engine behind an HTTP client), waiting for idle servers, the run's
environment (date, commit, CPU, load)."""

from __future__ import annotations

import asyncio
import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from service.devserver import ROOT


@dataclass
class Peer:
    engine: str  # "llama.cpp" | "skillcache"
    client: httpx.AsyncClient
    pid: int | None = None  # the server process, when this run started it


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) from /proc; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


async def quiesce(pids: list[int], max_s: float, window_s: float = 1.0, busy_cores: float = 0.05) -> float:
    """Wait until the servers together use under busy_cores of CPU over window_s (their background work, such as
    skillcache's calibrations and refinements, is done); at most max_s. Returns the seconds waited."""
    t0 = time.monotonic()
    while pids and time.monotonic() - t0 < max_s:
        c0 = sum(cpu_seconds(p) for p in pids)
        await asyncio.sleep(window_s)
        if (sum(cpu_seconds(p) for p in pids) - c0) / window_s < busy_cores:
            return time.monotonic() - t0
    if pids and max_s > 0:
        print(f"warning: servers still busy after {max_s:.0f} s; measuring anyway", flush=True)
    return time.monotonic() - t0


def loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def environment() -> dict:
    """What a reader needs to place the figures: when, which commit, which CPU, how loaded the machine was."""
    def git(*a: str) -> str | None:
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return None

    cpu = None
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), None)
    except OSError:
        pass
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": git("rev-parse", "--short", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")), "cpu": cpu,
            "cores": os.cpu_count(), "python": platform.python_version(), "loadavg_start": loadavg()}
