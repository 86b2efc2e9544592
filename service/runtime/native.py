"""The C++ kernels (packed_blocks.cpp: packed decode's linears; decode_attention.cpp: a decode step's attention),
one torch extension built on first use for this CPU (-march=native) by torch's extension builder: a C++ compiler and
ninja, ~35 s on two cores, cached by torch under ~/.cache/torch_extensions. Where it cannot build (the slim
Docker image has no compiler), `extension()` raises and its callers keep torch's own ops."""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

_HERE = Path(__file__).parent
SOURCES = [_HERE / "native.cpp", _HERE / "packed_blocks.cpp", _HERE / "decode_attention.cpp"]
_ext = None


def extension():
    """The built module: blocks_mm(...), decode_attention(...). Raises if it cannot be built here, or if this CPU has
    neither AVX-512 nor AVX2 with FMA: the kernels' portable code is slower than torch's own ops (on an AVX2 CPU,
    built without its AVX2 path: a decode step 2.3x slower at one row, 2.9x at eight; docs/BENCHMARKS.md, "Kernels
    by instruction set")."""
    global _ext
    if _ext is None:
        from torch.utils.cpp_extension import load

        # -ffp-contract=off: packed_blocks' weights must decode to exactly the float32 values (no fused multiply-add
        # merging d * q + m); named for this CPU's instruction sets: torch caches builds by name, and a
        # -march=native build from another machine (a shared home) could hold instructions this one lacks
        ext = load(f"skillcache_native_{_cpu_tag()}", [str(s) for s in SOURCES],
                   extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"])
        if ext.isa() == "portable":
            raise RuntimeError("this CPU has neither AVX-512 nor AVX2 with FMA (the kernels' portable code is slower "
                               "than torch's own ops)")
        _ext = ext
    return _ext


def cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them (elsewhere: platform.processor())."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def _cpu_tag() -> str:
    return hashlib.sha256(f"{platform.machine()} {cpu_flags()}".encode()).hexdigest()[:12]
