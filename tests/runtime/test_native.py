"""The kernels are built at install (scripts/install.sh: `python -m service.runtime.native build`) and loaded by a
process with no compiler; a build that failed, or kernels of other sources, are said once and torch's ops serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.runtime import native

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """This process's kernels forgotten, and read from an empty folder."""
    monkeypatch.setattr(native, "_ext", None)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setattr(native, "KERNELS", tmp_path)
    return tmp_path


def test_a_fresh_process_without_a_compiler_serves_packed_decode_on_the_prebuilt_kernels(tmp_path):
    """What the Docker runtime stage is: the install step's build, no compiler on PATH, no torch JIT cache."""
    code = ("import logging, sys\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(name)s %(message)s')\n"
            "sys.path.insert(0, 'tests')\n"
            "from embedded_model import embedded_settings\n"
            "from service.phases import Phases\n"
            "from service.runtime import build_runtime\n"
            "build_runtime(embedded_settings(device='cpu'), Phases())\n")
    env = {"HOME": os.environ["HOME"], "PATH": str(tmp_path / "nothing"), "CC": "/nonexistent/cc",
           "CXX": "/nonexistent/c++", "TORCH_EXTENSIONS_DIR": str(tmp_path / "jit"), "SKILLCACHE_HOME":
           os.environ.get("SKILLCACHE_HOME", str(Path.home() / ".cache" / "skillcache"))}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    want = native.variant()
    isa = {"v3": "avx2", "v4": "avx512"}[want]
    assert f"kernels: {want} ({native.VARIANTS[want][0]}, {isa} path), prebuilt in" in out.stdout, out.stdout
    assert f"(kernels {want}, {isa} path)" in out.stdout  # packed decode runs on them
    assert "kernels off" not in out.stdout and not (tmp_path / "jit").exists()
    assert "start-up: kernels: loading the prebuilt ones, packing and checking the linears done in" in out.stdout


def test_kernels_built_from_other_sources_are_refused_once(fresh, caplog):
    (fresh / "kernels.json").write_text(json.dumps({"sources": "0123",
                                                    "variants": {v: "built" for v in native.VARIANTS}}))
    with caplog.at_level("INFO", logger="service.runtime.native"):
        for _ in range(3):
            with pytest.raises(native.KernelsUnavailable, match="run `make install`"):
                native.extension()
    assert len(caplog.records) == 1 and caplog.records[0].levelname == "WARNING"


def test_a_build_that_failed_at_install_is_logged_once_and_torchs_ops_serve(fresh, monkeypatch, caplog):
    """No compiler at install: the install goes on, says so, and every start after says it once, without a retry."""
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(native, "cpu_flags", lambda: "flags : " + " ".join(native.VARIANTS["v3"][1]))
    result = native.build(fresh, ["v3"])
    assert result["v3"].startswith("failed: ") and not (fresh / "skillcache_native_v3.so").exists()
    with caplog.at_level("INFO", logger="service.runtime.native"):
        for _ in range(2):
            with pytest.raises(native.KernelsUnavailable, match=r"the v3 kernels were not built at install \(failed"):
                native.extension()
    assert len(caplog.records) == 1
    from service.runtime import attention
    from tiny import build_random_model, tiny_config, tiny_tokenizer

    monkeypatch.setattr(attention, "_usable", None)
    cfg = tiny_config("llama")
    cfg._attn_implementation = "sdpa"
    model = build_random_model(cfg, tiny_tokenizer(), seed=0).model  # not tiny_runtime's: it keeps what it saw
    assert attention.usable(model) is False and len(caplog.records) == 1  # torch's sdpa, nothing said again
