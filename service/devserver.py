"""`python -m service` as a subprocess on a free loopback port: the one launcher the end-to-end
tests, the reliability and replica tests and bench/load.py share.

Each process gets its own SKILLCACHE_HOME (its store, definitions and log) but reuses the model
already converted under the caller's home, so a start costs a model load, not a GGUF conversion.
The caller's own SKILLCACHE_* variables are not inherited: what the process runs with is what the
caller passes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


class ServiceNotReady(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def caller_home() -> Path:
    return Path(os.environ.get("SKILLCACHE_HOME") or "~/.cache/skillcache").expanduser()


class ServiceProcess:
    def __init__(self, home: Path, env: dict[str, str] | None = None, *, name: str = "service",
                 threads: int | None = 1, root: Path = ROOT, command: list[str] | None = None) -> None:
        """`env`: SKILLCACHE_* settings (and anything else) for the process, over the defaults below.
        `threads`: torch intra-op threads (OMP_NUM_THREADS); one by default, since several processes
        share two cores in CI and torch's one-per-core default thrashes there. None: torch decides.
        `root`: the source tree to run (a checkout of another commit, for a side-by-side benchmark).
        `command`: what to run instead of `python -m service` (a launcher that takes --port, from `root`)."""
        self.name, self.home, self.root = name, Path(home), Path(root)
        self.command = command or [sys.executable, "-m", "service"]
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fp_cache = caller_home() / "fingerprints.json"  # skip re-hashing the weights in a fresh home
        if fp_cache.is_file() and not (self.home / "fingerprints.json").exists():
            (self.home / "fingerprints.json").write_bytes(fp_cache.read_bytes())
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SKILLCACHE_")}
        self.env.update({
            "SKILLCACHE_HOME": str(self.home),
            "SKILLCACHE_MODEL_CACHE": os.environ.get("SKILLCACHE_MODEL_CACHE") or str(caller_home() / "models"),
            "SKILLCACHE_SKILLS_DIR": "",  # nothing preloaded unless asked for
        })
        if threads:
            self.env["OMP_NUM_THREADS"] = str(threads)
        self.env.update(env or {})
        self.log_path = self.home / "server.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.t_start = 0.0

    def start(self) -> "ServiceProcess":
        self.starts += 1
        with open(self.log_path, "a") as log:
            log.write(f"\n=== start {self.starts} ===\n")
            log.flush()
            self.proc = subprocess.Popen([*self.command, "--port", str(self.port)], cwd=self.root,
                                         env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.t_start = time.monotonic()
        return self

    def wait_ready(self, timeout_s: float = 300) -> httpx.Response:
        """Poll /readyz until 200; returns that response. ServiceNotReady (with the log) otherwise."""
        deadline = self.t_start + timeout_s
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{self.url}/readyz", timeout=5)
                if r.status_code == 200:
                    self.ready_s = time.monotonic() - self.t_start
                    return r
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                raise ServiceNotReady(f"{self.name} exited with {self.proc.returncode}\n{self.log_tail()}")
            time.sleep(0.2)
        raise ServiceNotReady(f"{self.name} not ready in {timeout_s:.0f} s\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return f"--- {self.name} log ---\n" + self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def proc_status(self, key: str) -> int:
        """A kB figure from /proc/<pid>/status, e.g. VmRSS (resident now) or VmHWM (peak resident)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise KeyError(f"no {key} in /proc/{self.proc.pid}/status")

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill9()

    def __enter__(self) -> "ServiceProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
