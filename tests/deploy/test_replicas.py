"""Replicas sharing one store: one real redis-server, real service processes (the embedded model),
each with its own SKILLCACHE_HOME (own disk tier), all with SKILLCACHE_STORE=redis.

What a multi-replica deployment (docker compose --scale, the Helm chart's replicaCount) relies on:
  - a skill registered on one replica composes on another from Redis, without a compile there;
  - a replica started later serves skills registered before it, from Redis, without compiling;
  - a delete on one replica is seen by every other one (definitions are read from Redis per request);
  - two replicas asked for the same new block at once compile it once (the Redis compile lock);
  - a replica SIGKILLed under load leaves the others serving.

The tests share the processes and run in file order; the last one kills replica A.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from redis_server import RedisServer, redis_or_skip

from service import devserver

pytestmark = [pytest.mark.slow, pytest.mark.redis]

READY_TIMEOUT_S = 180
MAX_TOKENS = 4  # generation is not what is tested here: keep requests short on a CPU
# ~300 tokens: compiling takes long enough (hundreds of ms on a CPU) for two replicas to overlap
FILLER = " ".join(f"Rule {i}: answer politely and cite the policy section." for i in range(30))


class Replica(devserver.ServiceProcess):
    """`python -m service` on a free port with its own SKILLCACHE_HOME (own disk tier), store=redis."""

    def __init__(self, name: str, home: Path, redis_url: str) -> None:
        # one torch thread each: two or three replicas on a 2-core runner, each with a thread per core, leave
        # OpenMP's workers fighting for the cores (every test here took 25-60 s)
        super().__init__(home, {"SKILLCACHE_STORE": "redis", "SKILLCACHE_REDIS_URL": redis_url,
                                "SKILLCACHE_DEVICE": "cpu", "SKILLCACHE_TORCH_THREADS": "1"}, name=name)
        self.start()

    def wait_ready(self) -> None:
        try:
            body = super().wait_ready(READY_TIMEOUT_S).json()
        except devserver.ServiceNotReady as e:
            pytest.fail(str(e))
        assert body["skills_preloaded"] == {}, body  # nothing preloaded
        assert body["store"].get("redis") == "ok" and body["definitions"] == "ok", body

    def compiles(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        m = re.search(r"^skillcache_compiles_total (\S+)$", text, re.M)
        assert m, "skillcache_compiles_total missing from /metrics"
        return float(m.group(1))

    def lock_ops(self) -> float:
        """Redis compile-lock calls (try_lock + lock_held polls) this replica made."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        m = re.search(r'^skillcache_store_op_seconds_count\{op="lock",tier="redis"\} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    def register(self, name: str, text: str, compile: bool = True) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/skills", params={"compile": str(compile).lower()},
                          json={"name": name, "text": text}, timeout=120)

    def metric(self, name: str, labels: str = "") -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        m = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def compose(self, name: str, timeout: float = 120) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/compose", timeout=timeout,
                          json={"skills": [name], "user": "Say OK.", "max_tokens": MAX_TOKENS})


def _skill_text(tag: str) -> str:
    return f"Skill {tag} ({uuid.uuid4().hex}). {FILLER}"


@pytest.fixture(scope="module")
def redis_url():
    redis_or_skip()
    with RedisServer() as srv:
        yield srv.url


@pytest.fixture(scope="module")
def cluster(redis_url, tmp_path_factory):
    """Replicas A and B (started together); the tests may add C."""
    base = tmp_path_factory.mktemp("replicas")
    started: dict[str, Replica] = {}

    def spawn(name: str) -> Replica:
        r = Replica(name, base / name, redis_url)
        started[name] = r
        return r

    try:
        a, b = spawn("A"), spawn("B")
        a.wait_ready()
        b.wait_ready()
        print(f"\nA ready in {a.ready_s:.1f} s, B ready in {b.ready_s:.1f} s")
        yield {"A": a, "B": b, "spawn": spawn}
    finally:
        for r in started.values():
            r.stop()


def test_skill_registered_on_a_composes_on_b_from_redis(cluster):
    a, b = cluster["A"], cluster["B"]
    r = a.register("shared-one", _skill_text("one"))
    assert r.status_code == 201, r.text
    assert r.json()["compiled"] is True
    b_before = b.compiles()

    r = b.compose("shared-one")
    assert r.status_code == 200, r.text + b.log_tail()
    assert r.json()["skills"][0]["source"] == "redis"
    assert b.compiles() == b_before, "B compiled a block that A had already stored in Redis"
    # B's second request is served from its own memory tier
    r = b.compose("shared-one")
    assert r.status_code == 200 and r.json()["skills"][0]["source"] == "memory", r.text
    assert httpx.get(f"{b.url}/v1/skills/shared-one", timeout=10).json()["compiled"] is True


def test_replica_started_later_serves_earlier_skills_from_redis(cluster):
    a = cluster["A"]
    r = a.register("before-c", _skill_text("before-c"))
    assert r.status_code == 201, r.text
    c = cluster["spawn"]("C")
    try:
        c.wait_ready()
        print(f"C ready in {c.ready_s:.1f} s")
        assert c.compiles() == 0
        names = {s["name"] for s in httpx.get(f"{c.url}/v1/skills", timeout=10).json()["skills"]}
        assert {"shared-one", "before-c"} <= names
        r = c.compose("before-c")
        assert r.status_code == 200, r.text + c.log_tail()
        assert r.json()["skills"][0]["source"] == "redis"
        assert c.compiles() == 0, "the late replica compiled instead of reading Redis"
    finally:
        c.stop()  # give the CPU back to A and B


def test_two_replicas_compile_a_new_skill_once(cluster):
    a, b = cluster["A"], cluster["B"]
    r = a.register("race", _skill_text("race"), compile=False)
    assert r.status_code == 201 and r.json()["compiled"] is False, r.text
    before = a.compiles() + b.compiles()
    locks_before = {rep.name: rep.lock_ops() for rep in (a, b)}

    barrier = threading.Barrier(2)

    def go(rep: Replica) -> httpx.Response:
        barrier.wait()
        return rep.compose("race")

    with ThreadPoolExecutor(2) as pool:
        ra, rb = pool.map(go, [a, b])
    assert ra.status_code == 200, ra.text + a.log_tail()
    assert rb.status_code == 200, rb.text + b.log_tail()
    sources = sorted([ra.json()["skills"][0]["source"], rb.json()["skills"][0]["source"]])
    locks = {rep.name: rep.lock_ops() - locks_before[rep.name] for rep in (a, b)}
    print(f"race: A={ra.json()['skills'][0]['source']} B={rb.json()['skills'][0]['source']}, lock calls {locks}, "
          f"store_ms A={ra.json()['timings']['store_ms']:.0f} B={rb.json()['timings']['store_ms']:.0f}")
    assert a.compiles() + b.compiles() - before == 1, "the same block was compiled on both replicas"
    assert sources == ["compiled", "redis"]


def test_delete_on_b_removes_the_skill_for_a(cluster):
    a, b = cluster["A"], cluster["B"]
    r = a.register("doomed", _skill_text("doomed"))
    assert r.status_code == 201, r.text
    assert a.compose("doomed").status_code == 200  # A holds the block in memory and has read the definition
    assert b.compose("doomed").json()["skills"][0]["source"] == "redis"

    r = httpx.delete(f"{b.url}/v1/skills/doomed", timeout=30)
    assert r.status_code == 200, r.text
    assert r.json() == {"deleted": "doomed", "versions": [1]}

    r = httpx.get(f"{a.url}/v1/skills/doomed", timeout=10)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["type"] == "skill_not_found"
    r = a.compose("doomed")
    assert r.status_code == 404, r.text
    assert r.json()["error"]["type"] == "skill_not_found"
    assert "doomed" not in {s["name"] for s in httpx.get(f"{a.url}/v1/skills", timeout=10).json()["skills"]}
    # the name is free again: registering it anew starts over at version 1
    r = b.register("doomed", _skill_text("doomed-again"), compile=False)
    assert r.status_code == 201 and r.json()["version"] == 1, r.text


def test_a_prefix_refined_on_a_is_served_by_b_without_a_prefill(cluster):
    """Refined prefixes are stored like blocks: B copies the exact prefix A refined from Redis."""
    a, b = cluster["A"], cluster["B"]
    for tag in ("p", "q"):
        assert a.register(f"pre-{tag}", _skill_text(tag)).status_code == 201
    body = {"skills": ["pre-p", "pre-q"], "user": "Say OK.", "max_tokens": MAX_TOKENS, "seam_tokens": 2}
    refined = "skillcache_refined_prefixes_total"
    before = a.metric(refined)
    for _ in range(2):  # composed on A (SKILLCACHE_REFINE_AFTER=1): A refines it in the background
        assert httpx.post(f"{a.url}/v1/compose", json=body, timeout=120).status_code == 200
    deadline = time.monotonic() + 180
    while a.metric(refined) == before:
        assert time.monotonic() < deadline, "A did not refine the pair" + a.log_tail()
        time.sleep(0.5)
    b_prefilled = b.metric("skillcache_refine_tokens_total", '{kind="prefilled"}')
    r = httpx.post(f"{b.url}/v1/compose", json=body, timeout=120)
    assert r.status_code == 200, r.text + b.log_tail()
    assert [s["path"] for s in r.json()["skills"]] == ["prefix", "prefix"] and r.json()["usage"]["prefix_tokens"] > 0
    assert b.metric(refined) == 0 and b.metric("skillcache_refine_tokens_total", '{kind="prefilled"}') == b_prefilled


def test_sigkill_of_a_under_load_leaves_b_serving(cluster):
    a, b = cluster["A"], cluster["B"]
    for rep in (a, b):  # warm: the block in both memory tiers
        assert rep.compose("shared-one").status_code == 200

    stop = threading.Event()
    killed_at: list[float] = []
    results: dict[str, list[tuple[float, int | str]]] = {"A": [], "B": []}

    def load(rep: Replica) -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                try:
                    r = client.post(f"{rep.url}/v1/compose",
                                    json={"skills": ["shared-one"], "user": "Say OK.", "max_tokens": MAX_TOKENS})
                    results[rep.name].append((time.monotonic(), r.status_code))
                except httpx.TransportError as e:
                    results[rep.name].append((time.monotonic(), type(e).__name__))
                    if rep is a:
                        time.sleep(0.05)

    threads = [threading.Thread(target=load, args=(rep,)) for rep in (a, a, b, b)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (len(results["A"]) < 2 or len(results["B"]) < 2):
            time.sleep(0.05)
        assert len(results["A"]) >= 2 and len(results["B"]) >= 2, results
        os.kill(a.proc.pid, signal.SIGKILL)  # two A requests are in flight: each thread loops without a pause
        killed_at.append(time.monotonic())
        a.proc.wait(timeout=10)
        n_b = len(results["B"])
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(results["B"]) < n_b + 4:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=90)

    t_kill = killed_at[0]
    b_codes = [code for _, code in results["B"]]
    b_after = [code for t, code in results["B"] if t > t_kill]
    a_after = [code for t, code in results["A"] if t > t_kill]
    print(f"B: {len(b_codes)} requests ({len(b_after)} after the kill); A after the kill: {a_after[:4]}")
    assert all(code == 200 for code in b_codes), (b_codes, b.log_tail())
    assert len(b_after) >= 4
    assert a_after and all(code != 200 for code in a_after[2:])  # at most the two in flight may have finished
    # and after: B serves, registers and compiles on its own
    r = b.compose("shared-one")
    assert r.status_code == 200 and r.json()["skills"][0]["source"] == "memory"
    r = b.register("after-a", _skill_text("after-a"))
    assert r.status_code == 201, r.text
    assert httpx.get(f"{b.url}/readyz", timeout=10).status_code == 200
