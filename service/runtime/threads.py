"""torch's CPU threads: the model thread runs torch on all of them, every other thread on one.

torch's OpenMP runtime (libgomp) keeps a pool of worker threads for each thread that ran a parallel region, and once
the pools' threads outnumber the CPUs its workers stop spinning between regions and go to sleep, so every parallel
region pays a wake-up. A decode step is hundreds of small regions. Measured on this 2-core box (docs/BENCHMARKS.md,
"Packed decode", bench/threads.py): a cache-resident oneDNN linear (1536x576, one row) from a second thread took
~150 us once the main thread had run one parallel op, ~60 us when it had not; with one torch thread there is no pool
and no difference. In the
service the model used to load on a worker thread of asyncio's executor and store threads copy tensors, so the
serving engine's thread was always the second pool.

`claim(n)` is called on the model thread before it touches the model: it gets n threads (0: one per CPU this
process may run on), and torch's default for every thread that has not run torch yet becomes 1 (ATen starts a
thread's OpenMP on its first parallel op from one process-wide count, which `torch.set_num_threads` sets; it is set
to 1 from a short-lived thread, so the model thread keeps its own n).
"""

from __future__ import annotations

import os
import threading


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def claim(n: int = 0) -> int:
    """Give the calling thread n torch threads (0: one per CPU) and every thread that has not run torch yet one;
    returns n."""
    import torch

    n = n or cpu_count()
    torch.set_num_threads(n)
    torch.get_num_threads()  # this thread's OpenMP starts now, with n, before the process-wide count changes
    if n > 1:
        other = threading.Thread(target=torch.set_num_threads, args=(1,), name="torch-threads")
        other.start()
        other.join()
    return n
