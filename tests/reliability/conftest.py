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


# The fidelity guard's background work (seam calibration, shadow checks) is not what these tests test; it
# would re-store blocks under them and compete for the worker, so the in-process apps turn it off.
QUIET = {"seam_auto": False, "shadow_sample_rate": 0.0}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def write_keys(path: Path, entries: list[dict] = KEYS) -> Path:
    path.write_text(json.dumps(entries))
    return path


@contextmanager
def one_torch_thread():
    """torch's default (one intra-op thread per core) thrashes on a shared 2-core machine: a tiny-model request
    is ~8x slower. The inference worker thread, started inside, inherits the setting."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def app_client(tmp_path: Path, runtime=None, **overrides):
    """A TestClient on the tiny model, ready (model loaded, self-check passed)."""
    settings = Settings(home=tmp_path, store=overrides.pop("store", "disk"), skills_dir=None,
                        **{**QUIET, **overrides})
    app = create_app(settings, runtime=runtime or tiny_runtime("llama"))
    with one_torch_thread(), TestClient(app, raise_server_exceptions=False) as c:  # a 500 is a response here
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
            # One intra-op thread: on a shared 2-core machine torch's default (one per core) thrashes, and a
            # compile that takes 0.15 s alone takes 5 s (see the report). The fidelity guard's background
            # calibration holds the one worker for seconds per new skill; not what these tests measure.
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "SKILLCACHE_SEAM_AUTO": "false",
            "SKILLCACHE_SHADOW_SAMPLE_RATE": "0",
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

    settings = Settings(home=tmp_path, store=overrides.pop("store", "disk"), skills_dir=None,
                        **{**QUIET, **overrides})
    app = create_app(settings, runtime=runtime or tiny_runtime("llama"))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    threads = one_torch_thread()
    threads.__enter__()
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
        threads.__exit__(None, None, None)


def documented_error_types() -> set[str]:
    """Every stable error_type the API can answer with (service/errors.py, the store errors, the HTTP mapping)."""
    from service.api.errors import _HTTP_TYPES
    from service.errors import ServiceError
    from service.store.errors import StoreError

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    types = {c.error_type for c in subclasses(ServiceError)} | {c.error_type for c in subclasses(StoreError)}
    return types | set(_HTTP_TYPES.values()) | {"invalid_request"}
