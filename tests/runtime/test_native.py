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


ISA = {"v3": "avx2", "v4": "avx512"}  # the vector path each variant runs


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """This process's kernels forgotten, and read from an empty folder."""
    monkeypatch.setattr(native, "_ext", None)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setattr(native, "loaded", None)
    monkeypatch.setattr(native, "KERNELS", tmp_path)
    return tmp_path


def offered(kernels: Path) -> str | None:
    """What this CPU and an install's kernels folder offer: the best variant the CPU runs, if the install built it
    from these sources; None when either is missing (a CPU with neither level, no compiler at install)."""
    try:
        want = native.variant()
    except native.KernelsUnavailable:
        return None
    try:
        built = json.loads((kernels / "kernels.json").read_text())
    except (OSError, ValueError):
        return None
    ok = built.get("sources") == native.sources_digest() and built.get("variants", {}).get(want) == "built"
    return want if ok else None


# A fresh process as the Docker runtime stage starts it (no compiler on PATH, no torch JIT cache) builds the
# embedded runtime, then prints what it serves decode steps with and how a decode step compares with torch's own
# ops on the same float32 weights (packed linears as F.linear, attention as sdpa).
PROBE = """
import json, sys
from pathlib import Path
sys.path.insert(0, "tests")
import torch
import torch.nn.functional as F
from service.runtime import native

case = sys.argv[1]
if case == "cpu-without-avx2":  # neither x86-64 level, as an older or another CPU lists its flags
    native.cpu_flags = lambda: "flags : fpu sse sse2 ssse3 sse4_1 sse4_2 avx"
elif case == "install-without-compiler":  # the kernels folder of an install whose build failed
    native.KERNELS = Path(sys.argv[2])

from embedded_model import embedded_settings
from service.kv.cache import new_cache
from service.phases import Phases
from service.runtime import build_runtime
from service.runtime.packed import PackedLinear
from service.runtime.serving.runner import DecodeBatch

rt = build_runtime(embedded_settings(device="cpu"), Phases())
ids = rt.tokenizer.encode("Refunds are allowed within 30 days of delivery.", add_special_tokens=False)


def decode_step():
    cache = new_cache(rt.model.config)
    token = int(rt.forward(ids, 0, cache).argmax())
    batch = DecodeBatch(rt)
    batch.join(cache, len(ids) + 4)
    return batch.step([token])[0]


try:
    isa = native.extension().isa()
except native.KernelsUnavailable:
    isa = None
report = {"loaded": native.loaded, "isa": isa, "off": native._error, "attention_kernel": rt.kernel_attention,
          "packed": sum(isinstance(m, PackedLinear) for m in rt.model.modules())}
with torch.inference_mode():
    served = decode_step()
    rt.kernel_attention = False
    PackedLinear.forward = lambda self, x: F.linear(x, self.weight, self.bias)
    reference = decode_step()
report.update(max_diff=float((served - reference).abs().max()), scale=float(reference.abs().max()),
              same_token=int(served.argmax()) == int(reference.argmax()))
print("REPORT " + json.dumps(report))
"""


@pytest.mark.parametrize("case", ["as-installed", "cpu-without-avx2", "install-without-compiler"])
def test_a_fresh_process_without_a_compiler_serves_what_the_cpu_and_install_offer(case, tmp_path, monkeypatch):
    """Where the CPU runs a variant and the install built it, packed decode and the attention kernel run on the
    prebuilt kernels; otherwise (simulated: a CPU with neither level, an install whose build failed for want of a
    compiler) torch's own ops serve. Either way the process starts without a compiler or a JIT build, and a decode
    step agrees with torch's ops on the same weights."""
    args = [case]
    want = offered(native.KERNELS)
    if case == "cpu-without-avx2":
        want = None
    elif case == "install-without-compiler":
        kernels = tmp_path / "kernels"
        monkeypatch.setenv("CC", "/nonexistent/cc")
        monkeypatch.setenv("CXX", "/nonexistent/c++")
        assert all(state.startswith("failed: ") for state in native.build(kernels).values())
        want = offered(kernels)
        assert want is None
        args.append(str(kernels))
    env = {"HOME": os.environ["HOME"], "PATH": str(tmp_path / "nothing"), "CC": "/nonexistent/cc",
           "CXX": "/nonexistent/c++", "TORCH_EXTENSIONS_DIR": str(tmp_path / "jit"), "SKILLCACHE_HOME":
           os.environ.get("SKILLCACHE_HOME", str(Path.home() / ".cache" / "skillcache"))}
    out = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("REPORT ")]
    got = json.loads(line.removeprefix("REPORT "))
    if want is not None:
        assert (got["loaded"], got["isa"], got["off"]) == (want, ISA[want], None), got
        assert got["packed"] > 0 and got["attention_kernel"], got  # decode steps run on the kernels
    else:
        assert got["loaded"] is None and got["isa"] is None and got["off"], got  # off, and why (said once)
        assert got["packed"] == 0 and not got["attention_kernel"], got  # torch's own ops
    assert got["same_token"] and got["max_diff"] <= 1e-4 * max(1.0, got["scale"]), got
    assert not (tmp_path / "jit").exists()  # nothing was compiled at start


def test_kernels_built_from_other_sources_are_refused_once(fresh, monkeypatch, caplog):
    monkeypatch.setattr(native, "cpu_flags", lambda: "flags : " + " ".join(native.VARIANTS["v3"][1]))  # any CPU
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
