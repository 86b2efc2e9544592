"""Helpers for the reliability tests: in-process apps on the tiny model (with API keys), and real service
processes (`python -m service` on the embedded model) that can be killed, restarted and measured."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from redis_server import free_port

from service import devserver
from service.devserver import ROOT  # noqa: F401  (the tests import it from here)
from service.config import Settings
from service.main import create_app
from tiny import tiny_runtime

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
QUIET = {"seam_auto": False, "shadow_sample_rate": 0.0, "refine_after": 0}  # no background model work


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


class ServiceProcess(devserver.ServiceProcess):
    """`python -m service` (the embedded model) on a free port with its own SKILLCACHE_HOME, CPU, one torch
    thread, and the fidelity guard's background work off (full prefills per new skill in the engine's background
    share: not what these tests measure)."""

    def __init__(self, home: Path, **env: str) -> None:
        super().__init__(home, {"SKILLCACHE_DEVICE": "cpu", "SKILLCACHE_SEAM_AUTO": "false",
                                "SKILLCACHE_SHADOW_SAMPLE_RATE": "0", **env})

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Seconds from start to ready."""
        try:
            super().wait_ready(timeout_s)
        except devserver.ServiceNotReady as e:
            pytest.fail(str(e))
        return self.ready_s

    def rss_peak_kib(self) -> int:
        return self.proc_status("VmHWM")

    def rss_kib(self) -> int:
        return self.proc_status("VmRSS")


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
