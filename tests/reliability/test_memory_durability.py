"""Durability of user memories: kill -9 a real service (the embedded model, disk store) while memories are created
and edited, restart it on the same SKILLCACHE_HOME, and check every acknowledged write is there, whole."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from conftest import ServiceProcess

pytestmark = pytest.mark.slow

WRITERS = 3
KILL_AFTER_ACKS = 30  # creations and edits acknowledged, then kill -9 with requests in flight


def _text(i: int) -> str:
    return (f"# USER MEMORY\n- [profile] name: customer {i}\n- [billing] counter: 0\n"
            f"- [shipping] city: city number {i}\nPrefers short answers.")


def test_kill9_during_memory_writes_loses_no_acknowledged_revision(tmp_path):
    svc = ServiceProcess(tmp_path / "home", SKILLCACHE_STORE="disk")
    svc.start()
    try:
        print(f"service ready in {svc.wait_ready():.1f} s")
        acked: dict[str, int] = {}  # memory name -> last acknowledged revision
        lock, stop = threading.Lock(), threading.Event()
        n_acks = [0]

        def writer(w: int) -> None:
            with httpx.Client(base_url=svc.url, timeout=60) as http:
                for j in range(10_000):
                    name = f"m-{w}-{j}"
                    try:  # half compiled now (blocks written too), half on first use
                        r = http.post("/v1/memories", params={"compile": str(j % 2 == 0).lower()},
                                      json={"name": name, "text": _text(w * 1000 + j)})
                        assert r.status_code == 201, r.text
                        with lock:
                            acked[name] = 1
                            n_acks[0] += 1
                        for k in range(1, 4):  # each edit sets counter to the revision it makes, minus one
                            if stop.is_set():
                                return
                            mode = ("erratum", "recompile", "in_place")[k - 1]
                            r = http.patch(f"/v1/memories/{name}",
                                           json={"edits": [{"label": "counter", "value": str(k), "mode": mode}]})
                            assert r.status_code == 200, r.text
                            with lock:
                                acked[name] = r.json()["revision"]
                                n_acks[0] += 1
                    except httpx.TransportError:
                        return  # the server died under us
                    if stop.is_set():
                        return

        threads = [threading.Thread(target=writer, args=(w,), daemon=True) for w in range(WRITERS)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        while n_acks[0] < KILL_AFTER_ACKS and time.monotonic() - t0 < 180:
            time.sleep(0.01)
        svc.kill9()
        stop.set()
        for t in threads:
            t.join(30)
        print(f"killed after {time.monotonic() - t0:.1f} s with {n_acks[0]} writes acknowledged "
              f"({len(acked)} memories)")
        assert n_acks[0] >= KILL_AFTER_ACKS

        svc.start()
        print(f"restarted, ready in {svc.wait_ready():.1f} s")
        with httpx.Client(base_url=svc.url, timeout=120) as http:
            listed = {m["name"]: m for m in http.get("/v1/memories").json()["memories"]}
            for name, revision in acked.items():
                r = http.get(f"/v1/memories/{name}")
                assert r.status_code == 200, (name, r.text)
                body = r.json()
                # an edit in flight may have been stored without its answer: never less than acknowledged
                assert body["revision"] >= revision, (name, body["revision"], revision)
                facts = {f["label"]: f["value"] for f in body["facts"]}
                assert facts["counter"] == str(body["revision"] - 1), (name, body)  # whole: text and revision agree
                w, j = (int(x) for x in name.split("-")[1:])
                assert facts["city"] == f"city number {w * 1000 + j}" and name in listed
            for name, m in listed.items():  # nothing half-written: a listed memory reads back whole
                assert http.get(f"/v1/memories/{name}").status_code == 200
            # usable after the crash: a compose and a session turn with a memory edited before the kill
            name = max(acked, key=acked.get)
            r = http.post("/v1/compose", json={"memory": name, "user": "Which city?", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["memory"]["revision"] == http.get(f"/v1/memories/{name}").json()["revision"]
            s = http.post("/v1/sessions", json={"system": "Be brief.", "memory": name}).json()
            assert http.post(f"/v1/sessions/{s['id']}/turns", json={"user": "hi", "max_tokens": 2}).status_code == 200
    finally:
        svc.stop()
