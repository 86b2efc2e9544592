"""Several vLLM replicas behind skillcache (SKILLCACHE_VLLM_URL lists them): rendezvous routing by composition,
failover around a replica that does not answer, readiness while any answers, and the shared spans tier's index
(SKILLCACHE_VLLM_SHARED_SPANS, a real redis-server) that keeps a block saved through one replica from being compiled
again by another replica, another skillcache or a restart. Stand-in vLLMs (test_vllm_engine.py's FakeVllm); the real
servers are test_vllm_replicas_e2e.py's."""

from __future__ import annotations

import asyncio

import pytest

from appclient import make_client
from service import metrics
from service.config import Settings
from service.compose.pipeline import ComposeParams, SkillRef
from service.errors import EngineUnavailable
from service.vllm.client import VllmPool
from test_vllm_engine import TEXT_A, TEXT_B, FakeVllm, compose, sent_by


class Replica(FakeVllm):
    """A stand-in vLLM at a URL; down: every call fails as a refused connection does. `tier`: a RedisTier that its
    'connector' saves each compiled block's record into (the index entry is what skillcache reads)."""

    def __init__(self, url: str, tier=None) -> None:
        super().__init__()
        self.base_url, self.tier = url, tier

    async def prefill(self, ids, cache_salt, transfer=None, priority=0) -> None:
        if not self.up:
            raise EngineUnavailable(f"vLLM at {self.base_url} failed a prefill (ConnectError)")
        await super().prefill(ids, cache_salt, transfer, priority)
        if self.tier is not None and transfer is not None and transfer.save is not None:
            self.tier.put("modelkey", transfer.save.name, 1, 0, b"record")


URLS = ["http://vllm-a:8000", "http://vllm-b:8000", "http://vllm-c:8000"]


def compiles(url: str) -> float:
    return metrics.VLLM_COMPILES.labels(url)._value.get()


def test_the_rendezvous_order_is_stable_and_a_removed_replica_moves_only_its_own_keys():
    pool = VllmPool([Replica(u) for u in URLS])
    again = VllmPool([Replica(u) for u in reversed(URLS)])  # another skillcache, the URLs in another order
    keys = [f"digest-{i}" for i in range(300)]
    first = {k: pool.order(k)[0].base_url for k in keys}
    assert first == {k: again.order(k)[0].base_url for k in keys}
    assert all(sorted(c.base_url for c in pool.order(k)) == sorted(URLS) for k in keys[:5])
    share = {u: sum(v == u for v in first.values()) for u in URLS}
    assert min(share.values()) > 60, share  # spread over the replicas (300 keys, 3 replicas)
    two = VllmPool([Replica(u) for u in URLS[:2]])  # vllm-c gone
    for k in keys:
        if first[k] != URLS[2]:
            assert two.order(k)[0].base_url == first[k]  # a key that did not rank it first stays where it was
        else:
            assert two.order(k)[0].base_url == pool.order(k)[1].base_url  # the next in its order takes it


async def test_a_failed_replica_goes_last_until_it_answers_health_and_readiness_needs_one():
    a, b = Replica(URLS[0]), Replica(URLS[1])
    pool = VllmPool([a, b])
    key = next(k for k in (f"k{i}" for i in range(100)) if pool.order(k)[0] is a)
    pool.failed(a)
    assert pool.order(key) == [b, a]
    a.up = False
    assert await pool.health() is True and pool.order(key) == [b, a]  # b answers
    a.up = True
    assert await pool.health() is True and pool.order(key) == [a, b]  # a is back
    assert metrics.VLLM_REPLICA_UP.labels(URLS[0])._value.get() == 1
    a.up = b.up = False
    assert await pool.health() is False


def test_the_settings_take_one_url_or_several():
    assert Settings(vllm_url="http://h:1").vllm_urls == ["http://h:1"]
    assert Settings(vllm_url=" http://a:1/, http://b:2 ,,http://a:1").vllm_urls == ["http://a:1", "http://b:2"]
    s = Settings(vllm_shared_spans=True, redis_url="redis://r:6379/2")
    assert s.vllm_spans_redis == "redis://r:6379/2" and Settings().vllm_spans_redis is None


@pytest.fixture
def two(tmp_path):
    a, b = Replica(URLS[0]), Replica(URLS[1])
    with make_client(tmp_path, engine="vllm", vllm_url=",".join(URLS[:2])) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        runner = state.pipeline.runner
        assert [x.base_url for x in runner.pool.clients] == URLS[:2]
        runner.pool = VllmPool([a, b])
        for name, text in (("a", TEXT_A), ("b", TEXT_B)):
            assert c.post("/v1/skills", json={"name": name, "text": text}).status_code in (200, 201)
        yield c, a, b, runner


def test_a_composition_goes_to_its_replica_and_to_the_next_when_that_one_is_down(two):
    c, a, b, runner = two
    pipeline = c.app.state.skillcache.pipeline
    prep = c.portal.call(pipeline.prepare, ComposeParams(skills=[SkillRef("a"), SkillRef("b")],
                                                          messages=[{"role": "user", "content": "What now?"}]))
    chain = runner.plan(prep)[0]
    home, other = runner.pool.order(chain.digest)
    out = compose(c, ["a", "b"], "What now?")
    final = home.sent[-1]
    assert not final.get("prefill") and final["salt"] == f"approx:default:{chain.digest}"
    assert not sent_by(other, "final") and not sent_by(other, "step")  # its steps and its head on one replica
    # each block compiled where its name routes it at registration; the composition's replica compiled the rest
    assert {tuple(x["ids"]) for x in sent_by(home, "compile")} >= {tuple(list(runner.rt.anchor[:b]) + ids)
                                                                    for _, ids, b in runner.plan(prep)[2]}
    assert out["text"] == "Hello"
    n_home, n_other = len(home.sent), len(other.sent)
    compose(c, ["a", "b"], "Again?")
    assert len(home.sent) == n_home + 1 and len(other.sent) == n_other  # a repeat: the final request alone, there
    # the home replica goes down: the next request goes to the other one, which builds the head itself (no shared
    # tier: what the home replica saved is not known to be there)
    home.up = False
    before = metrics.VLLM_FAILOVERS.labels(home.base_url)._value.get()
    out = compose(c, ["a", "b"], "Still there?")
    assert out["text"] == "Hello" and sent_by(other, "final") and len(home.sent) == n_home + 1
    assert metrics.VLLM_FAILOVERS.labels(home.base_url)._value.get() == before + 1
    assert sent_by(other, "step"), "the other replica ran the composition's steps itself"
    assert c.get("/readyz").status_code == 200, c.get("/readyz").json()  # one replica answers
    other.up = False
    r = c.post("/v1/compose", json={"skills": ["a"], "user": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_unavailable"
    assert c.get("/readyz").status_code == 503
    home.up = True
    assert c.get("/readyz").status_code == 200
    n = len(home.sent)
    compose(c, ["a", "b"], "Back?")  # home is back (its health cleared the mark): the composition returns to it
    assert len(home.sent) > n


def test_a_request_with_no_head_is_routed_by_its_tenant_and_first_tokens(two):
    c, a, b, runner = two
    for _ in range(3):
        r = c.post("/v1/compose", json={"skills": [], "user": "same prompt", "max_tokens": 2, "mode": "full"})
        assert r.status_code == 200, r.text
    finals = [len(sent_by(x, "final")) for x in (a, b)]
    assert sorted(finals) == [0, 3]  # every time the same replica: its prefix cache holds the prompt


@pytest.fixture
def redis_url():
    from redis_server import RedisServer, redis_or_skip

    redis_or_skip()
    with RedisServer() as srv:
        yield srv.url


def test_a_block_the_shared_index_holds_is_not_compiled_again_by_another_skillcache(tmp_path, redis_url):
    from service.vllm.spans import RedisTier, SharedIndex

    async def in_index(name: str) -> bool:
        index = SharedIndex(redis_url)
        try:
            return await index.has(name)
        finally:
            await index.close()

    settings = {"engine": "vllm", "vllm_shared_spans": True, "redis_url": redis_url}
    first = Replica(URLS[0], RedisTier(redis_url))
    with make_client(tmp_path / "one", vllm_url=URLS[0], **settings) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        c.app.state.skillcache.pipeline.runner.pool = VllmPool([first])
        before = compiles(URLS[0])
        assert c.post("/v1/skills", json={"name": "a", "text": TEXT_A}).status_code in (200, 201)
        compose(c, ["a"], "hi")
        (compiled,) = sent_by(first, "compile")
        name = compiled["transfer"]["skillcache"]["save"][0]
        assert compiles(URLS[0]) == before + 1 and asyncio.run(in_index(name))
    # another skillcache (or this one restarted), in front of another replica: the block is in the shared tier
    second = Replica(URLS[1])
    shared_before, before = metrics.VLLM_HEADS.labels("shared")._value.get(), compiles(URLS[1])
    with make_client(tmp_path / "two", vllm_url=URLS[1], **settings) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        c.app.state.skillcache.pipeline.runner.pool = VllmPool([second])
        assert c.post("/v1/skills", json={"name": "a", "text": TEXT_A}).status_code in (200, 201)
        out = compose(c, ["a"], "hi")
        assert not sent_by(second, "compile") and compiles(URLS[1]) == before
        assert metrics.VLLM_HEADS.labels("shared")._value.get() == shared_before + 1
        final = second.sent[-1]
        assert final["transfer"]["skillcache"]["load"][0][0] == name  # the head loads the shared record
        assert out["skills"][0]["source"] == "engine"
