"""glibc's malloc told to keep freed memory for the next allocation instead of giving it back to the OS.

Each request's K/V caches are allocated when it is composed and freed when it ends (tens of MB on the embedded
model: 46 KB a token), and background work (calibration, shadow checks, refinement) allocates and frees caches of
whole prompts (~110 MB at 2.4k tokens) between them. With glibc's defaults, freed memory at the top of a heap is
trimmed back to the OS and the mmap threshold moves with the sizes freed, so after background work a live request's
caches came from fresh pages, each faulted in and zeroed by the kernel on first touch: under back-to-back load
with background work on, 16-25 thousand page faults a request against ~1 thousand with it off, and live requests
took 22% more engine time. With these settings (glibc's environment tunables in that run) 1.5 thousand, and no
excess (docs/BENCHMARKS.md, "Background work under load").

The price: memory freed by the process stays mapped to it (up to the trim threshold at the top of a heap), so its
resident size stays near its peak, which the KV budget bounds anyway. SKILLCACHE_MALLOC_KEEP_FREED=false keeps
glibc's defaults; other C libraries (musl) have no mallopt and keep their own behaviour.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's malloc.h
SETTINGS = {
    M_TRIM_THRESHOLD: 2**31 - 1,  # give memory at a heap's top back to the OS only past ~2 GiB free (mallopt: an int)
    M_TOP_PAD: 256 * 2**20,  # grow a heap by 256 MiB more than asked (address space; pages come on first touch)
    M_MMAP_THRESHOLD: 32 * 2**20,  # allocations up to 32 MiB (glibc's largest) from the heaps, reused once freed
}


def keep_freed_memory() -> bool:
    """Apply SETTINGS to this process's malloc; False where the C library has no mallopt or refuses one."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in SETTINGS.items())
