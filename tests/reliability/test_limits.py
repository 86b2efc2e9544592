"""Limits and backpressure: body size, skill tokens, skills per request, context length, max_tokens, the per-key
rate limit, the bounded inference queue and live sessions per tenant. Each is refused with a documented
error and the service keeps serving."""

from __future__ import annotations

import threading
import time

import pytest

from conftest import ADMIN, OTHER, USER, ServiceProcess, app_client, bearer, sse_events, write_keys
from service.api.auth import RateLimiter

TEXT = "Refunds are allowed within 30 days of delivery when the item is unused."


def _err(r) -> str:
    return r.json()["error"]["type"]


def test_size_limits(tmp_path):
    with app_client(tmp_path, max_body_bytes=12000, max_skill_tokens=40, max_skills_per_request=2,
                    max_tokens_cap=16) as c:
        for i in range(3):
            assert c.post("/v1/skills", json={"name": f"s{i}", "text": f"{TEXT} {i}"}).status_code == 201
        # body size: declared and chunked (no content-length) bodies alike
        r = c.post("/v1/skills", json={"name": "huge", "text": "a " * 7000})
        assert r.status_code == 413 and _err(r) == "limit_exceeded" and "SKILLCACHE_MAX_BODY_BYTES" in r.text
        r = c.post("/v1/skills", content=iter([b'{"name": "x", "text": "', b"a" * 13000, b'"}']),
                   headers={"content-type": "application/json"})
        assert r.status_code == 413 and _err(r) == "limit_exceeded"
        # skill tokens
        r = c.post("/v1/skills", json={"name": "long", "text": TEXT * 5})
        assert r.status_code == 413 and "SKILLCACHE_MAX_SKILL_TOKENS" in r.text
        # skills per request
        r = c.post("/v1/compose", json={"skills": ["s0", "s1", "s2"], "user": "hi", "max_tokens": 1})
        assert r.status_code == 413 and "SKILLCACHE_MAX_SKILLS_PER_REQUEST" in r.text
        # max_tokens over the cap, and over the schema's own bound
        r = c.post("/v1/compose", json={"skills": ["s0"], "user": "hi", "max_tokens": 17})
        assert r.status_code == 413 and _err(r) == "limit_exceeded"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 17})
        assert r.status_code == 413 and _err(r) == "limit_exceeded"
        r = c.post("/v1/compose", json={"user": "hi", "max_tokens": 10**12})
        assert r.status_code == 422 and _err(r) == "invalid_request"
        # context length: the tiny model has 4096 positions
        r = c.post("/v1/compose", json={"skills": ["s0"], "user": "zq " * 2500, "max_tokens": 16})
        assert r.status_code == 422 and _err(r) == "context_too_long"
        # nothing above broke anything
        r = c.post("/v1/compose", json={"skills": ["s0", "s1"], "user": "hi", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert len(c.get("/v1/skills").json()["skills"]) == 3


def test_token_bucket():
    rl = RateLimiter(rps=2, burst=3)
    assert [rl.acquire("a", now=0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert rl.acquire("a", now=0.0) == pytest.approx(0.5)  # one token every 0.5 s
    assert rl.acquire("b", now=0.0) == 0.0  # buckets are per caller
    assert rl.acquire("a", now=0.5) == 0.0
    assert rl.acquire("a", now=0.5) > 0
    assert rl.acquire("a", now=100.0) == 0.0  # refilled, but never above the burst
    assert [rl.acquire("a", now=100.0) for _ in range(3)][-1] > 0
    assert RateLimiter(rps=0.5).burst == 1 and RateLimiter(rps=10).burst == 10
    small = RateLimiter(rps=1, max_buckets=100)
    for i in range(1000):
        small.acquire(f"k{i}", now=float(i))
    assert len(small._buckets) == 100  # bounded however many callers come


class _Clock:
    """service.api.auth's `time` in a test: the rate limiter's buckets refill only when the test moves `now`."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


def test_rate_limit_per_key_is_429_with_retry_after(tmp_path, monkeypatch):
    from service.api import auth

    clock = _Clock()
    monkeypatch.setattr(auth, "time", clock)  # however long the requests take, no token refills until it moves
    with app_client(tmp_path, api_keys_file=write_keys(tmp_path / "keys.json"), rate_limit_rps=2,
                    rate_limit_burst=3) as c:
        codes = [c.get("/v1/skills", headers=bearer(USER)).status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429], codes
        r = c.get("/v1/skills", headers=bearer(USER))
        assert r.status_code == 429 and _err(r) == "rate_limited"
        assert r.headers["retry-after"] == "1" and "SKILLCACHE_RATE_LIMIT_RPS" in r.text  # 0.5 s, rounded up
        assert c.get("/v1/skills", headers=bearer(ADMIN)).status_code == 200  # another key: its own bucket
        assert c.get("/v1/skills", headers=bearer(OTHER)).status_code == 200
        assert c.get("/livez").status_code == 200 and c.get("/metrics").status_code == 200  # never limited
        r = c.get("/v1/skills", headers=bearer("unknown-key-000000000000"))
        assert r.status_code == 401  # unknown keys are refused before they reach a bucket
        clock.now += 0.25  # half a token at 2 a second
        assert c.get("/v1/skills", headers=bearer(USER)).status_code == 429
        clock.now += 0.25
        assert c.get("/v1/skills", headers=bearer(USER)).status_code == 200  # refilled: one token
        assert c.get("/v1/skills", headers=bearer(USER)).status_code == 429  # and only one


def test_bounded_queue_sheds_load_then_recovers(tmp_path):
    with app_client(tmp_path, queue_size=2) as c:
        assert c.post("/v1/skills", json={"name": "a", "text": TEXT}).status_code == 201
        engine = c.app.state.skillcache.engine
        gate = threading.Event()

        async def block():
            return engine.submit(lambda cancelled: gate.wait(60))

        try:
            c.portal.call(block)  # occupies the engine
            deadline = time.monotonic() + 60  # only a hang guard, as the ones below
            while not engine.busy or engine.n_waiting:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            c.portal.call(block)
            c.portal.call(block)  # the queue (2) is full
            r = c.post("/v1/compose", json={"skills": ["a"], "user": "hi", "max_tokens": 1})
            assert r.status_code == 429 and _err(r) == "overloaded" and r.headers["retry-after"] == "1"
        finally:
            gate.set()
        deadline = time.monotonic() + 60
        while engine.busy:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = c.post("/v1/compose", json={"skills": ["a"], "user": "hi", "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_live_sessions_are_limited_per_tenant(tmp_path):
    with app_client(tmp_path, api_keys_file=write_keys(tmp_path / "keys.json"), max_sessions=2) as c:
        for key in (ADMIN, OTHER):
            assert c.post("/v1/skills", json={"name": "a", "text": TEXT}, headers=bearer(key)).status_code == 201
        for _ in range(2):
            assert c.post("/v1/sessions", json={"skills": ["a"]}, headers=bearer(USER)).status_code == 201
        r = c.post("/v1/sessions", json={"skills": ["a"]}, headers=bearer(ADMIN))  # same tenant, other key
        assert r.status_code == 413 and _err(r) == "limit_exceeded" and "SKILLCACHE_MAX_SESSIONS" in r.text
        assert c.post("/v1/sessions", json={"skills": ["a"]}, headers=bearer(OTHER)).status_code == 201


def test_sigterm_waits_a_bounded_time_for_open_streams(monkeypatch, tmp_path):
    """uvicorn waits for open responses forever by default: a long stream outlasted compose's 30 s grace and was
    SIGKILLed before shutdown ran. `python -m service` bounds it with SKILLCACHE_SHUTDOWN_GRACE_S."""
    import sys

    import uvicorn

    from service import __main__ as entry

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    monkeypatch.setattr(sys, "argv", ["python -m service", "--port", "18999"])
    monkeypatch.setenv("SKILLCACHE_SHUTDOWN_GRACE_S", "7.5")
    monkeypatch.setenv("SKILLCACHE_HOME", str(tmp_path))
    entry.main()
    assert seen["timeout_graceful_shutdown"] == 7.5 and seen["port"] == 18999
    assert seen["proxy_headers"] is False  # X-Forwarded-For from loopback must not pick the rate-limit bucket


@pytest.mark.slow
def test_sigterm_drains_the_running_sequences(tmp_path):
    """On SIGTERM the engine keeps stepping the batch: every stream that was decoding ends with its done event
    and [DONE] within the grace period, and the process exits cleanly."""
    import signal

    import httpx


    svc = ServiceProcess(tmp_path / "home", SKILLCACHE_SHUTDOWN_GRACE_S="120")
    svc.start()
    try:
        svc.wait_ready()
        assert httpx.post(f"{svc.url}/v1/skills", json={"name": "a", "text": TEXT}, timeout=60).status_code == 201
        started = threading.Barrier(4)
        results: list[list] = []

        def stream(i: int) -> None:
            with httpx.Client(timeout=120) as h, h.stream("POST", f"{svc.url}/v1/compose", json={
                    "skills": ["a"], "user": f"Explain the rule, reader {i}.", "max_tokens": 24, "stream": True}) as r:
                lines = r.iter_lines()
                first = []
                for line in lines:
                    first.append(line)
                    if '"delta"' in line or '"done"' in line:
                        break
                started.wait(60)
                results.append(sse_events(first + list(lines)))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        started.wait(120)  # all three are decoding
        svc.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        for t in threads:
            t.join(120)
        assert len(results) == 3
        for events in results:
            assert events[-1] == "[DONE]" and events[-2]["type"] == "done", events[-3:]
        # uvicorn re-raises the signal once it has shut down: the exit status says SIGTERM, after a clean shutdown
        assert svc.proc.wait(60) in (0, -signal.SIGTERM) and time.monotonic() - t0 < 120
        assert "Application shutdown complete" in svc.log_tail(20000)
    finally:
        svc.stop()
