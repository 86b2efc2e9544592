"""What a second OpenMP pool costs a small forward: one linear from a thread of its own, with and without the main
thread having run torch in parallel first (service/runtime/threads.py says why the service avoids it).

    python bench/threads.py none && python bench/threads.py main

none: nothing runs torch on the main thread; main: the main thread runs one matmul on torch's default threads
first (which starts its own OpenMP pool). Then, on a new thread with torch's default threads: a cache-resident
1536x576 linear of one row through oneDNN's prepacked float32 and bfloat16 paths, us per call (median of 5 x 2,000).
One process per case: a pool, once started, stays for the process.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import torch


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(200):
        fn()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def on_thread(case: str) -> None:
    w, x = torch.randn(1536, 576), torch.randn(1, 576)
    wf = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    wb, xb = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1), x.bfloat16()
    f32 = per_call_us(lambda: torch.ops.mkldnn._linear_pointwise(x, wf, None, "none", [], ""))
    bf16 = per_call_us(lambda: torch.ops.mkldnn._linear_pointwise(xb, wb, None, "none", [], ""))
    print(f"{case}: {torch.get_num_threads()} threads, float32 {f32:.1f} us, bfloat16 {bf16:.1f} us", flush=True)


def main() -> None:
    case = sys.argv[1] if len(sys.argv) > 1 else "none"
    if case == "main":
        torch.randn(1000, 1000) @ torch.randn(1000, 1000)
    t = threading.Thread(target=on_thread, args=(case,))
    t.start()
    t.join()


if __name__ == "__main__":
    main()
