"""The connector's cases (connector_cases.py) run in vLLM's own venv: it imports vllm, which the service's does not."""

from __future__ import annotations

import os
import subprocess

from service.vllm.launch import ROOT
from vllm_env import vllm_python_or_skip


def test_connector_cases_pass_inside_vllm():
    python = vllm_python_or_skip()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([python, "-m", "pytest", "-q", "--noconftest", "-p", "no:cacheprovider",
                        str(ROOT / "tests/engines_vllm/connector_cases.py")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout
