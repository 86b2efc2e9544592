"""service/runtime/threads.py: the model thread keeps its torch threads, every thread that starts torch later runs one.

In a subprocess: claim() changes torch's process-wide default, which the rest of the suite should not inherit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import threading
    import torch
    from service.runtime.threads import claim

    seen = {}

    def model_thread():
        seen["claimed"] = claim(2)
        torch.randn(512, 512) @ torch.randn(512, 512)
        seen["model"] = torch.get_num_threads()
        other = threading.Thread(target=lambda: seen.setdefault("other", torch.get_num_threads()))
        other.start()
        other.join()
        seen["model_after"] = torch.get_num_threads()

    t = threading.Thread(target=model_thread)
    t.start()
    t.join()
    late = threading.Thread(target=lambda: seen.setdefault("late", torch.get_num_threads()))
    late.start()
    late.join()
    print(seen["claimed"], seen["model"], seen["other"], seen["model_after"], seen["late"])
""")


def test_model_thread_keeps_its_threads_others_get_one():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=100, check=True)
    claimed, model, other, model_after, late = map(int, out.stdout.split())
    assert (claimed, model, model_after) == (2, 2, 2)
    assert (other, late) == (1, 1)


def test_default_is_the_cpus_this_process_may_use():
    from service.runtime.threads import cpu_count

    import os

    assert cpu_count() == len(os.sched_getaffinity(0))
