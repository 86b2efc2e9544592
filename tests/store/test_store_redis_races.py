"""Redis tier under concurrent writers: no chunk set outlives its manifest, races are not corruption."""

from __future__ import annotations

import asyncio

import pytest

from service.store.redis import RedisBlockStore
from tests.store.store_helpers import assert_same_block, metric, synthetic_block

pytestmark = pytest.mark.redis


def keys_of(sync_redis, pattern: str = "*") -> list[str]:
    return sorted(k.decode() for k in sync_redis.scan_iter(match=pattern))


def chunk_sets(sync_redis) -> set[str]:
    """The sha prefixes of the chunk sets present."""
    return {k.split(":chunk:")[1].split(":")[0] for k in keys_of(sync_redis, "*:chunk:*")}


def manifest_prefix(sync_redis) -> str:
    import json

    (mkey,) = keys_of(sync_redis, "*:manifest")
    return json.loads(sync_redis.get(mkey))["sha256"][:16]


async def test_concurrent_puts_of_different_payloads_leave_one_chunk_set(redis_url, sync_redis, make_key) -> None:
    stores = [RedisBlockStore(redis_url, chunk_bytes=1024) for _ in range(4)]
    try:
        await asyncio.gather(*(s.put(make_key(), synthetic_block(seed=i)) for i, s in enumerate(stores)))
        assert chunk_sets(sync_redis) == {manifest_prefix(sync_redis)}  # the losers' chunks are gone
        assert all(sync_redis.ttl(k) == -1 for k in keys_of(sync_redis, "*:chunk:*"))
        assert await stores[0].get(make_key()) is not None
        await stores[0].delete(make_key())
        assert keys_of(sync_redis) == []
    finally:
        for s in stores:
            await s.close()


async def test_delete_racing_a_put_leaves_no_orphan_chunks(redis_url, sync_redis, make_key) -> None:
    a, b = RedisBlockStore(redis_url, chunk_bytes=1024), RedisBlockStore(redis_url, chunk_bytes=1024)
    try:
        await a.put(make_key(), synthetic_block(seed=1))
        real, fired = a._r.execute_command, []

        async def put_after_first_read(*args, **kw):
            res = await real(*args, **kw)
            if not fired and args[0] in ("GET", "EVALSHA"):  # delete has read the manifest
                fired.append(1)
                await b.put(make_key(), synthetic_block(seed=2))
            return res

        a._r.execute_command = put_after_first_read
        await a.delete(make_key())
        a._r.execute_command = real
        assert fired
        prefixes = chunk_sets(sync_redis)
        if keys_of(sync_redis, "*:manifest"):  # the put won: its block is whole
            assert prefixes == {manifest_prefix(sync_redis)}
            assert_same_block(await a.get(make_key()), synthetic_block(seed=2))
        else:
            assert prefixes == set()
    finally:
        await a.close()
        await b.close()


async def test_get_racing_a_re_put_reads_the_new_block_not_corruption(redis_url, make_key) -> None:
    a, b = RedisBlockStore(redis_url, chunk_bytes=1024), RedisBlockStore(redis_url, chunk_bytes=1024)
    try:
        await a.put(make_key(), synthetic_block(seed=1))
        real, fired = a._r.mget, []

        async def re_put_then_mget(*args, **kw):
            if not fired:  # another replica commits a new payload between our manifest read and MGET
                fired.append(1)
                await b.put(make_key(), synthetic_block(seed=3))
            return await real(*args, **kw)

        a._r.mget = re_put_then_mget
        before = metric("skillcache_store_corrupt_total", tier="redis", reason="chunks")
        got = await a.get(make_key())
        assert metric("skillcache_store_corrupt_total", tier="redis", reason="chunks") == before
        assert_same_block(got, synthetic_block(seed=3))
    finally:
        await a.close()
        await b.close()


async def test_get_racing_repeated_re_puts_is_a_plain_miss(redis_url, make_key) -> None:
    a, b = RedisBlockStore(redis_url, chunk_bytes=1024), RedisBlockStore(redis_url, chunk_bytes=1024)
    try:
        await a.put(make_key(), synthetic_block(seed=1))
        real, n = a._r.mget, iter(range(2, 100))

        async def re_put_every_time(*args, **kw):
            await b.put(make_key(), synthetic_block(seed=next(n)))
            return await real(*args, **kw)

        a._r.mget = re_put_every_time
        before = metric("skillcache_store_corrupt_total", tier="redis", reason="chunks")
        assert await a.get(make_key()) is None
        assert metric("skillcache_store_corrupt_total", tier="redis", reason="chunks") == before
        a._r.mget = real
        assert await a.get(make_key()) is not None  # the last put's block is intact
    finally:
        await a.close()
        await b.close()
