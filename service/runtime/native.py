"""The C++ kernels (packed_blocks.cpp: packed decode's linears; decode_attention.cpp: a decode step's attention),
built when the service is installed, not when it starts.

`python -m service.runtime.native build` (scripts/install.sh runs it, so `make`, CI and the Docker builder stage all
do) compiles one torch extension per x86-64 level into service/runtime/kernels/:

    v4  -march=x86-64-v4  AVX-512 (F, BW, CD, DQ, VL): the kernels' AVX-512 path
    v3  -march=x86-64-v3  AVX2 and FMA (with BMI1/2, F16C, MOVBE): their AVX2 path

`extension()` loads the best variant this CPU runs, with no compiler: the image's runtime stage carries the built
files. Every variant is built with -ffp-contract=off: packed_blocks' weights must decode to exactly the float32
values (no fused multiply-add merging d * q + m). A CPU with neither level (the kernels' portable code is slower than
torch's own ops: docs/BENCHMARKS.md, "Kernels by instruction set"), a build that failed at install, or kernels built
from other sources: one log line, `extension()` raises KernelsUnavailable (every call, without trying again), and
its callers keep torch's own ops.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)
_HERE = Path(__file__).parent
SOURCES = [_HERE / "native.cpp", _HERE / "packed_blocks.cpp", _HERE / "decode_attention.cpp"]
KERNELS = _HERE / "kernels"  # the built variants and kernels.json (what was built, from which sources)
VARIANTS = {  # best first: (the -march level, the /proc/cpuinfo flags it needs)
    "v4": ("x86-64-v4", {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma"}),
    "v3": ("x86-64-v3", {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"}),
}
CFLAGS = ["-O3", "-g0", "-fopenmp", "-ffp-contract=off"]
_ext = None
_error: str | None = None  # why the kernels are off in this process: said once, raised on every call
loaded: str | None = None  # the variant loaded ("v3", "v4"), for the start-up log


class KernelsUnavailable(RuntimeError):
    """No usable kernels here: torch's own ops serve (logged once per process)."""


def extension():
    """The loaded module: isa(), blocks_mm(...), decode_attention(...). Raises KernelsUnavailable when this process
    has none (the reason is logged at the first call only)."""
    global _ext, _error, loaded
    if _ext is not None:
        return _ext
    if _error is None:
        try:
            v = variant()
            _ext, loaded = _load(v), v
            log.info("kernels: %s (%s, %s path), prebuilt in %s", v, VARIANTS[v][0], _ext.isa(), KERNELS)
            return _ext
        except KernelsUnavailable as e:
            _error = str(e)
            log.warning("kernels off, torch's own ops serve: %s", _error)
    raise KernelsUnavailable(_error)


def variant() -> str:
    """The best variant this CPU runs."""
    flags = set(cpu_flags().split())
    for v, (_, need) in VARIANTS.items():
        if need <= flags:
            return v
    raise KernelsUnavailable(f"this CPU ({platform.machine()}) has neither AVX-512 nor AVX2 with FMA; the kernels' "
                             "portable code is slower than torch's own ops")


def _load(v: str):
    import torch  # noqa: F401 - the extension's symbols (c10, libtorch, OpenMP) come from torch's libraries

    built = _built()
    state = built.get("variants", {}).get(v, "not built")
    if built.get("sources") != sources_digest():
        raise KernelsUnavailable(f"no kernels built from this source tree in {KERNELS}: run `make install` "
                                 "(scripts/install.sh builds them)")
    if state != "built":
        raise KernelsUnavailable(f"the {v} kernels were not built at install ({state})")
    path = KERNELS / f"skillcache_native_{v}.so"
    try:
        spec = importlib.util.spec_from_file_location(f"skillcache_native_{v}", path)
        ext = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ext)
    except (ImportError, OSError) as e:
        raise KernelsUnavailable(f"{path} does not load: {e}") from e
    if ext.isa() == "portable":
        raise KernelsUnavailable(f"{path} was built without a vector path")
    return ext


def _built() -> dict:
    try:
        return json.loads((KERNELS / "kernels.json").read_text())
    except (OSError, ValueError):
        return {}


def sources_digest() -> str:
    h = hashlib.sha256()
    for s in SOURCES:
        h.update(s.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    return h.hexdigest()[:16]


def cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them (elsewhere: platform.processor())."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


# ---- the build (install time) -----------------------------------------------------------------------------------
def build(out: Path = KERNELS, variants: list[str] | None = None) -> dict[str, str]:
    """Build every variant (each in its own process, side by side) into `out`; what became of each. Up to date
    (the same sources and flags, every variant built): nothing is done."""
    variants = variants or list(VARIANTS)
    done = _built() if out == KERNELS else {}
    if done.get("sources") == sources_digest() and all(done["variants"].get(v) == "built" for v in variants):
        return done["variants"]
    out.mkdir(parents=True, exist_ok=True)
    procs = {v: subprocess.Popen([sys.executable, "-m", "service.runtime.native", "build-one", v, str(out)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 cwd=_HERE.parent.parent) for v in variants}
    result = {}
    for v, p in procs.items():
        text = p.communicate()[0]
        so = out / f"skillcache_native_{v}.so"
        result[v] = "built" if p.returncode == 0 and so.exists() else "failed: " + _last_error(text)
    (out / "kernels.json").write_text(json.dumps({"sources": sources_digest(), "variants": result}, indent=1))
    return result


def _build_one(v: str, out: Path) -> None:
    """One variant, with setuptools and torch's CppExtension (no ninja; nothing is imported: a v4 build must not run
    on a CPU without AVX-512)."""
    from setuptools import setup
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    name = f"skillcache_native_{v}"
    (out / f"{name}.so").unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ext = CppExtension(name, [str(s) for s in SOURCES], extra_compile_args=[*CFLAGS, f"-march={VARIANTS[v][0]}"])
        setup(name=name, ext_modules=[ext], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
              script_args=["--quiet", "build_ext", "--build-lib", tmp, "--build-temp", f"{tmp}/obj"])
        shutil.copy(next(Path(tmp).glob(f"{name}*.so")), out / f"{name}.so")


def _last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["no output"])[-1][:300]


def main(argv: list[str]) -> int:
    if argv[:1] == ["build-one"]:
        _build_one(argv[1], Path(argv[2]))
        return 0
    if argv[:1] != ["build"]:
        print("usage: python -m service.runtime.native build", file=sys.stderr)
        return 2
    import time

    t0 = time.perf_counter()
    result = build()
    for v, state in result.items():
        print(f"kernels {v} ({VARIANTS[v][0]}): {state}")
    print(f"kernels: {time.perf_counter() - t0:.0f} s, in {KERNELS}")
    return 0  # a failed build is not a failed install: the service runs on torch's ops (and says so once)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
