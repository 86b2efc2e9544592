"""Memory stays bounded: 50 concurrent streaming clients against a real service (the embedded model); the
server's resident set is sampled from /proc during the load and compared with the resident set before it plus
the serving engine's KV budget and a stated margin, and the engine's own K/V gauge stays within the budget."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from conftest import ServiceProcess, sse_events

pytestmark = pytest.mark.slow

CLIENTS = 50
GIB, MIB = 1024**3, 1024**2
KV_BUDGET = 128 * MIB  # small: the 50 requests (16 decoding at most) need more, so admission must hold some back
MARGIN = 384 * MIB  # activations of a batched step, allocator slack, request and response objects
SKILLS = {
    "returns": " ".join(f"Return rule {i}: items bought in store {i} may be returned within {i + 10} days "
                        "with a receipt." for i in range(8)),
    "tone": " ".join(f"Style rule {i}: keep answers short, friendly and specific to the customer's question."
                     for i in range(6)),
}


def test_fifty_concurrent_streams_keep_memory_bounded(tmp_path):
    svc = ServiceProcess(tmp_path / "home", SKILLCACHE_STORE="disk", SKILLCACHE_QUEUE_SIZE=str(CLIENTS + 8),
                         SKILLCACHE_KV_BUDGET_BYTES=str(KV_BUDGET))
    svc.start()
    try:
        svc.wait_ready()
        with httpx.Client(base_url=svc.url, timeout=120) as http:
            for name, text in SKILLS.items():
                assert http.post("/v1/skills", json={"name": name, "text": text}).status_code == 201
            for i in range(3):  # warm: blocks in the memory tier, allocator pools, code paths
                r = http.post("/v1/compose", json={"skills": list(SKILLS), "user": f"Warm-up {i}?", "max_tokens": 4,
                                                   "stream": True})
                assert r.status_code == 200
        rss_before = svc.rss_kib() * 1024
        hwm_before = svc.rss_peak_kib() * 1024

        results: list[tuple[int, int, bool]] = []  # (status, deltas, done)
        errors: list[str] = []
        lock = threading.Lock()
        start = threading.Barrier(CLIENTS)

        def client(i: int) -> None:
            start.wait()
            try:
                with httpx.Client(base_url=svc.url, timeout=300) as h, h.stream("POST", "/v1/compose", json={
                        "skills": list(SKILLS), "user": f"Customer {i}: can I return a lamp after {i} days?",
                        "max_tokens": 16, "stream": True}) as r:
                    events = sse_events(r.iter_lines()) if r.status_code == 200 else []
                    done = bool(events) and events[-1] == "[DONE]" and events[-2].get("type") == "done"
                    with lock:
                        results.append((r.status_code, sum(1 for e in events if isinstance(e, dict)
                                                           and e.get("type") == "delta"), done))
            except httpx.HTTPError as e:
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")

        samples: list[int] = []
        kv: list[float] = []
        stop = threading.Event()

        def sampler() -> None:
            with httpx.Client(base_url=svc.url, timeout=30) as h:
                while not stop.is_set():
                    try:
                        samples.append(svc.rss_kib() * 1024)
                        kv.append(_gauge(h.get("/metrics").text, "skillcache_engine_kv_bytes"))
                    except (OSError, AssertionError, httpx.HTTPError):
                        return
                    time.sleep(0.1)

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
        mon = threading.Thread(target=sampler, daemon=True)
        t0 = time.monotonic()
        mon.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        stop.set()
        mon.join(5)
        elapsed = time.monotonic() - t0
        hwm = svc.rss_peak_kib() * 1024
        rss_after = svc.rss_kib() * 1024
        print(f"{CLIENTS} concurrent streams in {elapsed:.1f} s: server RSS before {rss_before / 2**20:.0f} MiB, "
              f"peak during the load {max(samples, default=0) / 2**20:.0f} MiB (VmHWM {hwm / 2**20:.0f} MiB, "
              f"{hwm_before / 2**20:.0f} MiB before), after {rss_after / 2**20:.0f} MiB; engine K/V at most "
              f"{max(kv, default=0) / 2**20:.0f} MiB of a {KV_BUDGET / 2**20:.0f} MiB budget")
        assert not errors, errors[:3]
        assert len(results) == CLIENTS and all(s == 200 and done for s, _, done in results), results
        assert 0 < max(kv) <= KV_BUDGET  # the decode batch never held more K/V than its budget
        assert max(samples, default=0) - rss_before < KV_BUDGET + MARGIN  # the load adds a bounded working set
        assert hwm < 3 * GIB  # the model (~0.5 GB fp32) + tiers + 50 requests, generously
        with httpx.Client(base_url=svc.url, timeout=60) as http:  # and the service is fine afterwards
            assert http.get("/readyz").status_code == 200
            assert http.post("/v1/compose", json={"skills": ["tone"], "user": "Hi", "max_tokens": 2}).status_code == 200
    finally:
        svc.stop()


def _gauge(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))
