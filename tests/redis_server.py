"""A throwaway real redis-server for tests and benchmarks: free port, temp dir, no persistence.

    with RedisServer() as srv:        # or srv = RedisServer(); srv.start(); ...; srv.stop()
        url = srv.url                 # redis://127.0.0.1:<port>/0
        srv.stop(); srv.start()       # same port again: simulate an outage / restart

pytest helpers: `redis_or_skip()` skips when redis-server is missing, or fails when the
environment says SKILLCACHE_REQUIRE_REDIS=1 (CI).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

REQUIRE_ENV = "SKILLCACHE_REQUIRE_REDIS"


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def redis_or_skip() -> str:
    """The redis-server path; pytest.skip if absent (pytest.fail if SKILLCACHE_REQUIRE_REDIS=1)."""
    import pytest

    binary = redis_server_binary()
    if binary is None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"redis-server not found and {REQUIRE_ENV}=1 (install it: apt-get install -y redis-server)")
        pytest.skip("redis-server not installed")
    return binary


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process bound to 127.0.0.1 on a free port, data dir in a temp directory."""

    def __init__(self, port: int | None = None, extra_args: list[str] | None = None, binary: str | None = None):
        self.binary = binary or redis_server_binary() or "redis-server"
        self._fixed_port = port is not None
        self._started = False
        self.port = port or free_port()
        self.extra_args = list(extra_args or [])
        self._tmp = tempfile.TemporaryDirectory(prefix="skillcache-redis-")
        self.dir = Path(self._tmp.name)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        """Start and wait for PING. A port taken meanwhile is retried on another port unless one was given."""
        for attempt in range(3):
            try:
                return self._start(timeout_s)
            except RuntimeError as e:
                # a fresh port only on a first start: a restart must come back where clients expect it
                if self._fixed_port or self._started or "Address already in use" not in str(e) or attempt == 2:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start(self, timeout_s: float) -> "RedisServer":
        if self.proc is not None and self.proc.poll() is None:
            return self
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.dir), "--logfile", str(self.dir / "redis.log"), *self.extra_args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                log = (self.dir / "redis.log").read_text(errors="replace") if (self.dir / "redis.log").exists() else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}{log[-2000:]}")
            if _ping(self.port):
                self._started = True
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within {timeout_s}s")

    def stop(self) -> None:
        """Terminate (SIGTERM, then SIGKILL) and wait until the port is closed."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        if proc.stderr:
            proc.stderr.close()

    def restart(self) -> "RedisServer":
        self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
