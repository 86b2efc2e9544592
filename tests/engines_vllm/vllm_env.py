"""Where the vLLM venv is, and the skip-or-fail rule for tests that need it (SKILLCACHE_REQUIRE_VLLM=1 in CI)."""

from __future__ import annotations

import os

from service.vllm.launch import VLLM_PYTHON

REQUIRE_ENV = "SKILLCACHE_REQUIRE_VLLM"


def vllm_python_or_skip() -> str:
    import pytest

    if not VLLM_PYTHON.exists():
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{VLLM_PYTHON} missing and {REQUIRE_ENV}=1 (install it: scripts/install-vllm.sh)")
        pytest.skip("vLLM's venv not installed (scripts/install-vllm.sh)")
    return str(VLLM_PYTHON)
