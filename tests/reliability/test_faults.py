"""Faults, one at a time, against the app on the tiny model: Redis stopped / restarted / black-holed, a corrupt
block on disk and in Redis, a full or read-only disk, a client that disconnects mid-stream, an exception inside
generation. Each affects at most the requests it hits; the service recovers without a restart."""

from __future__ import annotations

import errno
import functools
import json
import signal
import threading
import time

import httpx
import pytest

from conftest import app_client, sse_events, uvicorn_thread
from redis_server import RedisServer, redis_or_skip
from service.metrics import STORE_CORRUPT
from service.store import factory, fsutil

TEXT = "Refunds are allowed within 30 days of delivery when the item is unused."
ASK = {"user": "Can I get a refund?", "max_tokens": 6, "seam_tokens": 4}  # explicit seam: deterministic


def _compose(c, *skills, **extra):
    return c.post("/v1/compose", json={"skills": list(skills), **ASK, **extra})


def _corrupt_count(tier: str) -> float:
    return sum(s.value for m in STORE_CORRUPT.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels.get("tier") == tier)


@pytest.fixture
def fast_redis_timeouts(monkeypatch):
    """Short Redis timeouts and retry interval, so an outage costs the tests seconds, not minutes."""
    fast = functools.partial(factory.build_store, redis_connect_timeout_s=0.5, redis_op_timeout_s=0.5,
                             retry_interval_s=0.5)
    monkeypatch.setattr("service.state.build_store", fast)


@pytest.fixture
def durable_redis():
    """A redis-server of this test alone, with an fsync-always AOF: a stop or restart loses nothing."""
    redis_or_skip()
    with RedisServer(extra_args=["--appendonly", "yes", "--appendfsync", "always"]) as srv:
        yield srv


def _wait(pred, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = pred()
        if out:
            return out
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.redis
def test_redis_stopped_restarted_and_black_holed(tmp_path, durable_redis, fast_redis_timeouts):
    with app_client(tmp_path, store="redis", redis_url=durable_redis.url) as c:
        for name in ("a", "b"):
            assert c.post("/v1/skills", json={"name": name, "text": f"{TEXT} ({name})"}).status_code == 201
        before = _compose(c, "a", "b").json()["text"]

        durable_redis.stop()  # --- Redis down ---
        r = _compose(c, "a", "b")
        assert r.status_code == 200 and r.json()["text"] == before  # known skills: cached definitions
        assert c.get("/v1/skills/a").status_code == 200
        for r in (c.post("/v1/skills", json={"name": "new", "text": "x y z"}),  # nothing acknowledged unstored
                  c.delete("/v1/skills/a"), c.get("/v1/skills"), _compose(c, "never-seen")):
            assert r.status_code == 503 and r.json()["error"]["type"] == "store_unavailable", r.text
        ready = c.get("/readyz")
        assert ready.status_code == 200 and ready.json()["definitions"].startswith("down: serving cached")
        assert ready.json()["store"]["redis"].startswith("down")

        durable_redis.start()  # --- back (same port, same AOF) ---
        _wait(lambda: c.post("/v1/skills", json={"name": "new", "text": "x y z"}).status_code == 201, what="recovery")
        assert {s["name"] for s in c.get("/v1/skills").json()["skills"]} == {"a", "b", "new"}
        assert _compose(c, "a", "b", "new").status_code == 200
        assert c.get("/readyz").json()["definitions"] == "ok"

        durable_redis.proc.send_signal(signal.SIGSTOP)  # --- black hole: accepts, never answers ---
        try:
            t0 = time.monotonic()
            r = _compose(c, "a", "b")
            assert r.status_code == 200 and r.json()["text"] == before
            assert time.monotonic() - t0 < 10  # bounded by the op timeout, not hung
            r = c.post("/v1/skills", json={"name": "late", "text": "late text"})
            assert r.status_code == 503 and r.json()["error"]["type"] == "store_unavailable"
        finally:
            durable_redis.proc.send_signal(signal.SIGCONT)
        _wait(lambda: c.post("/v1/skills", json={"name": "late", "text": "late text"}).status_code == 201,
              what="recovery after the black hole")
        assert _compose(c, "late").status_code == 200


def _drop_memory_tier(c, text: str, namespace: str = "default") -> None:
    state = c.app.state.skillcache
    c.portal.call(state.store.tiers[0].delete, state.registry.block_key(namespace, text))


def test_corrupt_block_on_disk_is_dropped_and_recompiled(tmp_path):
    with app_client(tmp_path) as c:
        assert c.post("/v1/skills", json={"name": "a", "text": TEXT}).status_code == 201
        before = _compose(c, "a").json()["text"]
        files = list((tmp_path / "store" / "blocks").rglob("*.safetensors"))
        assert len(files) == 1
        data = bytearray(files[0].read_bytes())
        for i in range(len(data) - 64, len(data) - 32):  # tensor bytes near the end
            data[i] ^= 0xFF
        files[0].write_bytes(bytes(data))
        _drop_memory_tier(c, TEXT)
        n0 = _corrupt_count("disk")
        r = _compose(c, "a")
        assert r.status_code == 200 and r.json()["text"] == before
        assert r.json()["skills"][0]["source"] == "compiled"  # not the corrupt copy
        assert _corrupt_count("disk") == n0 + 1
        _drop_memory_tier(c, TEXT)
        _wait(lambda: _compose(c, "a").json()["skills"][0]["source"] == "disk", what="the rewritten disk copy")
        truncated = files[0].read_bytes()[:100]  # a torn file: same outcome
        files[0].write_bytes(truncated)
        _drop_memory_tier(c, TEXT)
        r = _compose(c, "a")
        assert r.status_code == 200 and r.json()["text"] == before


@pytest.mark.redis
def test_corrupt_block_in_redis_is_dropped_and_recompiled(tmp_path, durable_redis, fast_redis_timeouts):
    import redis

    with app_client(tmp_path, store="redis", redis_url=durable_redis.url) as c:
        assert c.post("/v1/skills", json={"name": "a", "text": TEXT}).status_code == 201
        before = _compose(c, "a").json()["text"]
        with redis.Redis.from_url(durable_redis.url) as r:
            chunks = [k for k in r.scan_iter(match="skillcache:{*}:chunk:*")]
            assert chunks
            r.setrange(chunks[0], 100, b"\x00garbage\x00" * 4)
        for f in (tmp_path / "store" / "blocks").rglob("*.safetensors"):
            f.unlink()  # so the block must come from Redis
        _drop_memory_tier(c, TEXT)
        n0 = _corrupt_count("redis")
        resp = _compose(c, "a")
        assert resp.status_code == 200 and resp.json()["text"] == before
        assert resp.json()["skills"][0]["source"] == "compiled"
        assert _corrupt_count("redis") == n0 + 1


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_full_or_read_only_disk(tmp_path, monkeypatch, code):
    with app_client(tmp_path) as c:
        assert c.post("/v1/skills", json={"name": "a", "text": TEXT}).status_code == 201
        before = _compose(c, "a").json()["text"]

        def refuse(fd, view):
            raise OSError(code, "simulated")

        monkeypatch.setattr(fsutil, "_write", refuse)
        r = c.post("/v1/skills", json={"name": "b", "text": TEXT + " B"})
        assert r.status_code == 507 and r.json()["error"]["type"] == "store_write_failed", r.text
        assert "SKILLCACHE_HOME" in r.json()["error"]["message"]  # says what to do
        r = _compose(c, "a")
        assert r.status_code == 200 and r.json()["text"] == before  # reads still work
        _drop_memory_tier(c, TEXT)
        (next((tmp_path / "store" / "blocks").rglob("*.safetensors"))).unlink()
        r = _compose(c, "a")  # recompiled; storing it on disk fails, serving it does not
        assert r.status_code == 200 and r.json()["text"] == before
        assert c.get("/readyz").json()["store"]["disk"].startswith("degraded")
        assert not list(tmp_path.rglob("*.tmp")), "no temp files left behind"

        monkeypatch.undo()  # space freed / remounted read-write
        assert c.post("/v1/skills", json={"name": "b", "text": TEXT + " B"}).status_code == 201
        assert _compose(c, "a", "b").status_code == 200


def test_client_disconnect_mid_stream_frees_the_engine(tmp_path, monkeypatch):
    from tiny import tiny_runtime

    rt = tiny_runtime("llama")
    monkeypatch.setattr(rt, "eos_ids", set())  # random weights may say EOS early: make it generate on
    with uvicorn_thread(tmp_path, runtime=rt) as (url, app):
        engine = app.state.skillcache.engine
        decode_steps = []
        real_step = engine.batch.step
        monkeypatch.setattr(engine.batch, "step", lambda tokens: decode_steps.append(len(tokens)) or real_step(tokens))
        jobs = []
        real_submit = engine.submit_sequence
        monkeypatch.setattr(engine, "submit_sequence", lambda *a, **k: jobs.append(real_submit(*a, **k)) or jobs[-1])
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.post("/v1/skills", json={"name": "a", "text": TEXT}).status_code == 201
            decode_steps.clear()
            with http.stream("POST", "/v1/compose", json={"skills": ["a"], "user": "Tell me everything.",
                                                          "max_tokens": 2000, "stream": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"delta"' in line:
                        break  # one token seen: now hang up
            t_gone = time.monotonic()
            job = jobs[-1]
            _wait(lambda: job.cancel_event.is_set(), 10, "the job's cancel event")
            _wait(lambda: not engine.busy, 10, "an idle engine")
            freed_s = time.monotonic() - t_gone
            decoded = len(decode_steps)
            print(f"engine freed {freed_s * 1e3:.0f} ms after the disconnect, {decoded} of 2000 tokens decoded")
            assert decoded < 1000, decoded  # generation stopped, it did not run to max_tokens
            r = http.post("/v1/compose", json={"skills": ["a"], "user": "hi", "max_tokens": 3})
            assert r.status_code == 200  # and the next request is served


def test_exception_inside_generation_fails_only_that_request(tmp_path, monkeypatch):
    from tiny import tiny_runtime

    rt = tiny_runtime("llama")
    monkeypatch.setattr(rt, "eos_ids", set())
    real_forward = rt.forward
    boom = {"after": None, "calls": 0}

    def flaky(ids, start, cache):
        if boom["after"] is not None and (len(ids) == 1 or boom["after"] == 0):  # decode steps (or any call)
            boom["calls"] += 1
            if boom["calls"] > boom["after"]:
                raise RuntimeError("simulated CUDA error")
        return real_forward(ids, start, cache)

    monkeypatch.setattr(rt, "forward", flaky)
    with app_client(tmp_path, runtime=rt) as c:
        batch = c.app.state.skillcache.engine.batch  # batched decode steps run the model through it
        real_step = batch.step

        def flaky_step(tokens):
            if boom["after"] is not None:
                boom["calls"] += 1
                if boom["calls"] > boom["after"]:
                    raise RuntimeError("simulated CUDA error")
            return real_step(tokens)

        monkeypatch.setattr(batch, "step", flaky_step)
        assert c.post("/v1/skills", json={"name": "a", "text": TEXT}).status_code == 201
        good = _compose(c, "a").json()["text"]
        boom.update(after=8, calls=0)  # fails in decoding, after the stream started
        with c.stream("POST", "/v1/compose", json={"skills": ["a"], **ASK, "max_tokens": 20, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        assert events[0]["type"] == "delta" and events[-1] == "[DONE]"
        assert events[-2] == {"type": "error", "error": {"type": "internal_error",
                                                          "message": "generation failed; see the server log"}}
        boom.update(after=0, calls=0)  # fails in prefill: an ordinary error response
        r = _compose(c, "a")
        assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
        boom.update(after=8, calls=0)
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
                                                 "stream": True})
        events = sse_events(r.iter_lines())
        assert events[-2]["error"]["type"] == "internal_error" and events[-1] == "[DONE]"
        boom.update(after=None)
        r = _compose(c, "a")
        assert r.status_code == 200 and r.json()["text"] == good  # the worker survived, nothing was left behind
        assert c.app.state.skillcache.engine.thread.is_alive()


def test_concurrent_requests_through_a_fault_only_hit_requests_fail(tmp_path, monkeypatch):
    """Twenty concurrent requests while every fifth one's generation raises: exactly those fail."""
    from tiny import tiny_runtime

    rt = tiny_runtime("llama")
    real_prefill = rt.prefill_steps
    lock = threading.Lock()
    n = {"i": 0}

    def flaky_prefill(plan, blocks, **kw):  # raises on the engine, inside the request's first step
        with lock:
            n["i"] += 1
            i = n["i"]
        if i % 5 == 0:
            raise RuntimeError("simulated")
        return (yield from real_prefill(plan, blocks, **kw))

    monkeypatch.setattr(rt, "prefill_steps", flaky_prefill)
    with uvicorn_thread(tmp_path, runtime=rt) as (url, _app):
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.post("/v1/skills", json={"name": "a", "text": TEXT}).status_code == 201
            results: list[int] = []

            def one():
                results.append(http.post("/v1/compose", json={"skills": ["a"], **ASK}).status_code)

            threads = [threading.Thread(target=one) for _ in range(20)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        assert sorted(results) == [200] * 16 + [500] * 4, results
        assert json.dumps(results)
