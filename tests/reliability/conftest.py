"""Helpers for the reliability tests: in-process apps on the tiny model (with API keys), and real service
processes (`python -m service` on the embedded model) that can be killed, restarted and measured."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from redis_server import free_port

from service.config import Settings
from service.main import create_app
from tiny import tiny_runtime

ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 240

# keys used by the in-process tests: two tenants, an admin and a user in "acme", a user in "globex"
ADMIN, USER, OTHER = "acme-admin-key-0123456789", "acme-user-key-0123456789", "globex-user-key-0123456789"
KEYS = [
    {"key": ADMIN, "namespace": "acme", "role": "admin"},
    {"key": USER, "namespace": "acme", "role": "user"},
    {"key": OTHER, "namespace": "globex", "role": "admin"},
]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def write_keys(path: Path, entries: list[dict] = KEYS) -> Path:
    path.write_text(json.dumps(entries))
    return path


@contextmanager
def app_client(tmp_path: Path, runtime=None, **overrides):
    """A TestClient on the tiny model, ready (model loaded, self-check passed)."""
    settings = Settings(home=tmp_path, store=overrides.pop("store", "disk"), skills_dir=None, **overrides)
    app = create_app(settings, runtime=runtime or tiny_runtime("llama"))
    with TestClient(app) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        assert state.ready, state.load_error
        yield c


@pytest.fixture
def keyed_client(tmp_path):
    """Auth on (keys file with KEYS), disk store, tiny model."""
    with app_client(tmp_path, api_keys_file=write_keys(tmp_path / "keys.json")) as c:
        yield c


def sse_events(lines) -> list[dict | str]:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


class ServiceProcess:
    """`python -m service` (the embedded model) on a free port with its own SKILLCACHE_HOME."""

    def __init__(self, home: Path, **env_overrides: str) -> None:
        self.home = home
        home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        default_home = Path(os.environ.get("SKILLCACHE_HOME", Path("~/.cache/skillcache").expanduser()))
        fp_cache = default_home / "fingerprints.json"  # skip re-hashing the weights in a fresh home
        if fp_cache.is_file() and not (home / "fingerprints.json").exists():
            (home / "fingerprints.json").write_bytes(fp_cache.read_bytes())
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SKILLCACHE_")},
            "SKILLCACHE_HOME": str(home),
            "SKILLCACHE_MODEL_CACHE": str(default_home / "models"),  # the converted model, shared read-only
            "SKILLCACHE_SKILLS_DIR": "",
            "SKILLCACHE_DEVICE": "cpu",
            **env_overrides,
        }
        self.proc: subprocess.Popen | None = None
        self.log_path = home / "server.log"
        self.starts = 0

    def start(self) -> "ServiceProcess":
        self.starts += 1
        log = open(self.log_path, "a")
        log.write(f"\n=== start {self.starts} ===\n")
        log.flush()
        self.proc = subprocess.Popen([sys.executable, "-m", "service", "--port", str(self.port)], cwd=ROOT,
                                     env=self.env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.t_start = time.monotonic()
        return self

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        deadline = self.t_start + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=5).status_code == 200:
                    return time.monotonic() - self.t_start
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, f"service exited with {self.proc.returncode}\n{self.log_tail()}"
            time.sleep(0.2)
        pytest.fail(f"service not ready in {timeout_s} s\n{self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def rss_peak_kib(self) -> int:
        """VmHWM: the peak resident set of the server process so far."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise AssertionError("no VmHWM in /proc/<pid>/status")

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS in /proc/<pid>/status")

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


@contextmanager
def uvicorn_thread(tmp_path: Path, runtime=None, **overrides):
    """The app on the tiny model behind a real uvicorn (in a thread of this process), for real sockets:
    client disconnects, concurrent streams. Yields (base url, app)."""
    import threading

    import uvicorn

    settings = Settings(home=tmp_path, store=overrides.pop("store", "disk"), skills_dir=None, **overrides)
    app = create_app(settings, runtime=runtime or tiny_runtime("llama"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert thread.is_alive(), "uvicorn exited"
            time.sleep(0.05)
        else:
            pytest.fail("in-process uvicorn not ready in 60 s")
        yield url, app
    finally:
        server.should_exit = True
        thread.join(timeout=30)
