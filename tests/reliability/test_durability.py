"""Durability: kill -9 a real service (the embedded model, disk store) during a burst of registrations, restart
it on the same SKILLCACHE_HOME, and check that every acknowledged (2xx) skill is there, intact and usable."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from conftest import ServiceProcess

pytestmark = pytest.mark.slow

WRITERS = 4
KILL_AFTER_ACKS = 40  # then kill -9 while the writers still have requests in flight


def _text(i: int) -> str:
    return f"Policy note {i}: orders over {i * 7} euros ship free; answer customer {i} politely and briefly."


def test_kill9_during_registrations_loses_no_acknowledged_skill(tmp_path):
    svc = ServiceProcess(tmp_path / "home", SKILLCACHE_STORE="disk")
    svc.start()
    try:
        print(f"service ready in {svc.wait_ready():.1f} s")
        acked: dict[str, dict] = {}
        attempted: set[str] = set()
        lock = threading.Lock()
        stop = threading.Event()

        def writer(w: int) -> None:
            with httpx.Client(base_url=svc.url, timeout=60) as http:
                for j in range(10_000):
                    if stop.is_set():
                        return
                    i = w * 10_000 + j
                    name = f"d-{i}"
                    with lock:
                        attempted.add(name)
                    try:  # half compile now (a block written too), half on first use (definition only)
                        r = http.post("/v1/skills", params={"compile": str(j % 2 == 0).lower()},
                                      json={"name": name, "text": _text(i), "description": f"burst {w}"})
                    except httpx.TransportError:
                        return  # the server died under us
                    assert r.status_code in (200, 201), r.text  # before the kill nothing else is expected
                    with lock:
                        acked[name] = r.json()

        threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(WRITERS)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        while len(acked) < KILL_AFTER_ACKS and time.monotonic() - t0 < 90:
            time.sleep(0.01)
        svc.kill9()  # SIGKILL: no shutdown handler, no flush, requests in flight
        stop.set()
        for t in threads:
            t.join(30)
        n_acked = len(acked)
        print(f"killed after {time.monotonic() - t0:.1f} s: {n_acked} acknowledged, "
              f"{len(attempted) - n_acked} in flight or unanswered")
        assert n_acked >= KILL_AFTER_ACKS

        svc.start()  # same home, same port
        print(f"restarted, ready in {svc.wait_ready():.1f} s")
        with httpx.Client(base_url=svc.url, timeout=120) as http:
            listed = {s["name"]: s for s in http.get("/v1/skills").json()["skills"]}
            for name, rec in acked.items():  # every acknowledged skill: present, same version, same text
                got = http.get(f"/v1/skills/{name}")
                assert got.status_code == 200, (name, got.text)
                body = got.json()
                i = int(name.split("-")[1])
                assert (body["version"], body["content_hash"], body["text"]) == \
                    (rec["version"], rec["content_hash"], _text(i)), name
                assert name in listed
            for name in listed:  # and nothing half-written: whatever is listed is whole and was attempted
                assert name in attempted, name
                assert listed[name]["text"] == _text(int(name.split("-")[1]))
            names = sorted(acked)
            for k in range(0, len(names), 8):  # usable: compose with every acknowledged skill
                batch = names[k:k + 8]
                r = http.post("/v1/compose", json={"skills": batch, "user": "Does my order ship free?",
                                                   "max_tokens": 2, "seam_tokens": 4})
                assert r.status_code == 200, r.text
                assert [s["name"] for s in r.json()["skills"]] == batch
            # the service takes new work after the crash as usual
            r = http.post("/v1/skills", json={"name": "after-crash", "text": _text(99_999)})
            assert r.status_code == 201, r.text
    finally:
        svc.stop()
