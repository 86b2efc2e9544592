"""Deleting a session: no save queued or running when DELETE arrives brings it back, and replicas that held a
local copy of its KV drop that copy in their own sweep."""

import asyncio
import os
import threading
import time
from collections import OrderedDict
from types import SimpleNamespace as NS

import pytest
import torch

from appclient import make_client
from redis_server import RedisServer, redis_or_skip
from service.errors import SessionNotFound
from service.runtime.params import GenParams
from service.sessions.saved import SavedSessions, Session
from service.store.definitions import DiskDefinitionStore
from service.store.definitions_redis import RedisDefinitionStore
from service.store.disk import DiskBlockStore
from service.store.memory import MemoryBlockStore
from service.store.redis import RedisBlockStore
from service.store.tiered import TieredStore

POLICY = "Refunds are allowed within 30 days. The order status is {{status}}. Deny refunds for shipped orders."


def _pipeline(store, defs, ttl_s=3600.0):
    settings = NS(session_persist=True, session_store_ttl_s=ttl_s, engine="embedded")
    return NS(settings=settings, store=store, registry=NS(definitions=defs), rt=NS(fingerprint="fp-test"))


def _session(sid: str, n: int = 5) -> Session:
    s = Session(id=sid, namespace="ns", skills=[], system="x", fields={})
    layer = NS(keys=torch.randn(1, 2, n, 8), values=torch.randn(1, 2, n, 8))
    s.ids, s.cache = list(range(n)), NS(layers=[layer, layer])
    return s


def _disk_only(tmp_path):
    store = TieredStore([MemoryBlockStore(1 << 30), DiskBlockStore(tmp_path / "blocks")])
    return store, DiskDefinitionStore(tmp_path / "skills")


async def _saved_copies(saved: SavedSessions, s: Session) -> tuple[bool, bool]:
    doc = await saved._defs.get(s.namespace + ".sessions", s.id)
    block, _ = await saved.p.store.get(saved._key(s))
    return doc is not None, block is not None


def _replica(tmp_path, redis_url, tag):
    """One replica of store=redis: its own memory and disk tiers, the shared Redis."""
    store = TieredStore([MemoryBlockStore(1 << 30), DiskBlockStore(tmp_path / tag / "blocks"),
                         RedisBlockStore(redis_url)], background_fill=False)
    return SavedSessions(_pipeline(store, RedisDefinitionStore(redis_url)), OrderedDict()), store


def test_delete_skips_a_save_still_queued(tmp_path):
    """DELETE right after create (or a turn): the save it scheduled has not started yet."""
    async def main():
        store, defs = _disk_only(tmp_path)
        saved = SavedSessions(_pipeline(store, defs), OrderedDict())
        s = _session("s-" + "a" * 24)
        saved.save_later(s)
        await saved.delete(s)
        await saved.drain()
        assert await _saved_copies(saved, s) == (False, False)
        saved.save_later(s)  # a turn that finishes after the delete saves nothing either
        await saved.drain()
        assert await _saved_copies(saved, s) == (False, False)
    asyncio.run(main())


def test_delete_waits_for_a_save_in_flight(tmp_path):
    """DELETE while a save is writing: it waits for that save, then deletes both copies; a save queued behind is
    skipped; a resume (here or on a replica that only has the store) is `not found`, not `lost its cache`."""
    async def main():
        store, defs = _disk_only(tmp_path)
        saved = SavedSessions(_pipeline(store, defs), OrderedDict())
        s = _session("s-" + "b" * 24)
        saved.save_later(s)
        await saved.drain()  # the creation is saved

        entered, gate = asyncio.Event(), asyncio.Event()
        real_put = store.put

        async def slow_put(key, block, ephemeral=False):
            entered.set()
            await gate.wait()
            return await real_put(key, block, ephemeral)

        store.put = slow_put
        saved.save_later(s)  # a turn's save, now in flight
        await entered.wait()
        saved.save_later(s)  # and another one queued behind it
        deleting = asyncio.create_task(saved.delete(s))
        await asyncio.sleep(0.05)
        assert not deleting.done()  # waits for the save in flight
        gate.set()
        await deleting
        await saved.drain()
        assert await _saved_copies(saved, s) == (False, False)
        for replica in (saved, SavedSessions(_pipeline(store, defs), OrderedDict())):
            with pytest.raises(SessionNotFound, match="not found"):
                await replica.load("ns", s.id)
    asyncio.run(main())


def test_deleted_session_stays_deleted_through_the_api(tmp_path):
    """DELETE while a save is running and another is queued, then a turn that was running during a DELETE: the
    session is a 404 afterwards on this replica and on a new one over the same store."""
    with make_client(tmp_path) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        c.post("/v1/skills", json={"name": "policy", "text": POLICY, "fields": {"status": "delivered"}})
        mgr = state.sessions
        sid = c.post("/v1/sessions", json={"skills": ["policy"]}).json()["id"]
        s = mgr.live[sid]
        c.portal.call(s.save_lock.acquire)  # as if the creation's save were still writing
        out = []
        t = threading.Thread(target=lambda: out.append(c.delete(f"/v1/sessions/{sid}")))
        try:
            assert c.post(f"/v1/sessions/{sid}/turns", json={"user": "hi", "max_tokens": 2}).status_code == 200
            t.start()
            time.sleep(0.2)
            waited = t.is_alive()  # DELETE waits for the save in progress
        finally:
            c.portal.call(s.save_lock.release)
        t.join(10)
        assert waited and out and out[0].json() == {"deleted": sid}
        c.portal.call(mgr.drain)
        assert c.get(f"/v1/sessions/{sid}").status_code == 404
        r = c.post(f"/v1/sessions/{sid}/turns", json={"user": "again", "max_tokens": 1})
        assert r.status_code == 404 and r.json()["error"]["type"] == "session_not_found"

        # a turn running while DELETE arrives finishes, but the session is neither kept nor saved
        sid2 = c.post("/v1/sessions", json={"skills": ["policy"]}).json()["id"]
        c.portal.call(mgr.drain)
        events = c.portal.call(mgr.turn, "default", sid2, "hi", {}, GenParams(max_tokens=2))
        assert c.delete(f"/v1/sessions/{sid2}").json() == {"deleted": sid2}

        async def consume():
            return [ev async for ev in events]

        assert c.portal.call(consume)  # the turn's reply still arrives
        c.portal.call(mgr.drain)
        assert sid2 not in mgr.live and c.get(f"/v1/sessions/{sid2}").status_code == 404
        for gone in (sid, sid2):
            assert c.portal.call(state.definitions.get, "default.sessions", gone) is None
    with make_client(tmp_path) as c2:  # another replica over the same store
        c2.portal.call(c2.app.state.skillcache.wait_ready)
        for gone in (sid, sid2):
            r = c2.get(f"/v1/sessions/{gone}")
            assert r.status_code == 404 and "lost its cache" not in r.text


@pytest.fixture(scope="module")
def redis_url():
    redis_or_skip()
    with RedisServer() as srv:
        yield srv.url


def test_sweep_drops_local_copies_of_sessions_gone_elsewhere(tmp_path, redis_url):
    """store=redis, two replicas: B deletes one session and expires another; A's own sweep then drops its
    disk-tier copies of their KV, but not of a session that still exists nor of one being created right now."""
    import redis

    redis.Redis.from_url(redis_url).flushall()

    async def main():
        (a, sa), (b, sb) = _replica(tmp_path, redis_url, "A"), _replica(tmp_path, redis_url, "B")
        deleted, expired, kept = (_session("s-" + c * 24) for c in "cde")
        for s in (deleted, expired, kept):
            a.save_later(s)
        await a.drain()
        disk_a = sa.tiers[1]
        paths = {s.id: disk_a.path_for(a._key(s)) for s in (deleted, expired, kept)}
        assert all(p.is_file() for p in paths.values())
        old = time.time() - 3600  # A wrote its copies an hour ago
        for p in paths.values():
            os.utime(p, (old, old))

        await b.delete(Session(**deleted.doc()))  # DELETE on replica B
        doc = expired.doc()
        doc["saved_at"] = time.time() - 7200
        await b._defs.put("ns.sessions", expired.id, 1, doc)
        assert await b.sweep() == 1  # B's sweep expires it
        assert paths[deleted.id].is_file() and paths[expired.id].is_file()  # B cannot reach A's disk

        fresh = _session("s-" + "f" * 24)  # being created on A: its KV is on disk, its document not yet
        await sa.put(a._key(fresh), (await sa.get(a._key(kept)))[0])
        assert await a.sweep() == 0  # nothing of A's expired; its orphaned copies go
        assert not paths[deleted.id].exists() and not paths[expired.id].exists()
        assert paths[kept.id].is_file() and disk_a.path_for(a._key(fresh)).is_file()
        for st in (sa, sb):
            await st.close()
    asyncio.run(main())


def test_resume_after_turns_on_another_replica_reads_the_newest_kv(tmp_path, redis_url):
    """store=redis: replica A saved turn 1 (its memory and disk tiers keep that copy), B served turn 2 and saved
    it; resuming on A must read B's KV from Redis, not A's older copy (it said "lost its cache")."""
    import redis

    redis.Redis.from_url(redis_url).flushall()

    async def main():
        (a, sa), (b, sb) = _replica(tmp_path, redis_url, "A"), _replica(tmp_path, redis_url, "B")
        a.p.rt.model = b.p.rt.model = NS(config=None)
        sid = "s-" + "9" * 24
        a.save_later(_session(sid, n=5))
        await a.drain()
        b.save_later(_session(sid, n=7))  # turn 2 on B: more tokens, same session
        await b.drain()
        import service.kv.cache as kv_cache
        real = kv_cache.cache_from_block
        kv_cache.cache_from_block = lambda config, block: block  # no model config here: keep the block
        try:
            s = await a.load("ns", sid)
        finally:
            kv_cache.cache_from_block = real
        assert s.ids == list(range(7)) and s.cache.token_ids == s.ids
        assert (await sa.get(a._key(s)))[0].token_ids == s.ids  # A's faster tiers now hold the newest copy
        for st in (sa, sb):
            await st.close()
    asyncio.run(main())


def test_a_document_from_a_newer_version_still_loads(tmp_path):
    """Rolling deploys: a field a newer replica adds to the saved document must not break an older one's resume."""
    doc = {**_session("s-" + "7" * 24).doc(), "added_by_a_newer_version": [1, 2]}
    s = Session.from_doc(doc)
    assert s.id == "s-" + "7" * 24 and not hasattr(s, "added_by_a_newer_version")
