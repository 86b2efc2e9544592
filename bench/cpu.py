"""CPU time of a process by thread, read from /proc: what a service spent over a window, and on which threads.

    before = snapshot(pid)
    ...                                   # the load
    split = by_thread(before, snapshot(pid), thread_names(pid))

Python threads are named by `py-spy dump` when py-spy is installed (`pip install py-spy`: it prints each thread's
OS id and Python name): the event loop ("MainThread"), the model's ("serving-engine"), executors' workers. Threads
it does not name (OpenMP's workers, which the thread that ran a parallel region started; libraries' own) count as
"native", and without py-spy every thread does. A thread that ended within the window counts in the total only
(/proc keeps its time in the process's, not under its id).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def py_spy() -> str | None:
    """py-spy on PATH or beside this Python (a venv's bin), else None."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return exe if Path(exe).exists() else None


def _seconds(stat: str) -> float:
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3, utime 14, stime 15
    return (int(fields[11]) + int(fields[12])) / TICK


def snapshot(pid: int) -> dict:
    """{"total": the process's CPU seconds (user + system, every thread it ever had), "threads": {tid: seconds},
    "faults": its minor page faults (a page touched for the first time since the OS gave it)}."""
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            threads[int(task.name)] = _seconds((task / "stat").read_text())
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            pass
    stat = Path(f"/proc/{pid}/stat").read_text()
    return {"total": _seconds(stat), "threads": threads, "faults": int(stat[stat.rindex(")") + 2:].split()[7])}


def thread_names(pid: int) -> dict[int, str]:
    """{tid: Python thread name} from `py-spy dump` ({} without py-spy, or when it cannot attach)."""
    exe = py_spy()
    if exe is None:
        return {}
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(m.group(1)): m.group(2) for m in re.finditer(r'^Thread (\d+) \(\w+\): "([^"]*)"', out, re.M)}


def by_thread(a: dict, b: dict, names: dict[int, str]) -> dict:
    """CPU seconds between two snapshots: the total and by thread name (threads of the same name summed; "native"
    for unnamed ones, "ended" for time of threads gone by the second snapshot)."""
    out: dict[str, float] = {}
    for tid, s in b["threads"].items():
        name = re.sub(r"[_ ]?\d+$", "", names.get(tid, "native"))  # executor workers: "asyncio_0" -> "asyncio"
        out[name] = out.get(name, 0.0) + s - a["threads"].get(tid, 0.0)
    total = b["total"] - a["total"]
    out["ended"] = max(0.0, total - sum(out.values()))
    ranked = sorted(out.items(), key=lambda kv: -kv[1])
    return {"total_s": total, "minor_faults": b["faults"] - a["faults"],
            "by_thread_s": {k: round(v, 2) for k, v in ranked}}


def profile(pid: int, seconds: float, out: str) -> subprocess.Popen:
    """py-spy sampling `pid`'s Python threads for `seconds` (25 a second, without pausing it) into `out`, py-spy's raw
    format: one line per distinct stack, thread name first, then its sample count."""
    exe = py_spy()
    if exe is None:
        raise SystemExit("--profile samples with py-spy: pip install py-spy")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "25",
                             "--format", "raw", "--threads", "--nonblocking", "--output", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
