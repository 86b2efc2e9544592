"""Where the vLLM venv is, and the skip-or-fail rule for tests that need it (SKILLCACHE_REQUIRE_VLLM=1 in CI)."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

from service.vllm.launch import VLLM_PYTHON

REQUIRE_ENV = "SKILLCACHE_REQUIRE_VLLM"


def vllm_python_or_skip() -> str:
    import pytest

    if not VLLM_PYTHON.exists():
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{VLLM_PYTHON} missing and {REQUIRE_ENV}=1 (install it: scripts/install-vllm.sh)")
        pytest.skip("vLLM's venv not installed (scripts/install-vllm.sh)")
    return str(VLLM_PYTHON)


@contextmanager
def ready_client(settings, timeout_s: float = 300.0):
    """skillcache in process on `settings` (engine vllm), once /readyz says ready (vLLM answers, skills compiled)."""
    from fastapi.testclient import TestClient

    from service.main import create_app

    with TestClient(create_app(settings)) as c:
        deadline = time.monotonic() + timeout_s
        while c.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, c.get("/readyz").json()
            time.sleep(0.5)
        yield c
