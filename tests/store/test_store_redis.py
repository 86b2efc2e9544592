"""Redis tier against a real redis-server: chunks, manifest last, corruption, TTL, outages."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from service.kv.block import LAYOUT_VERSION
from service.store.errors import StoreUnavailable
from service.store.redis import RedisBlockStore
from tests.store.store_helpers import assert_same_block, metric, synthetic_block

K0 = f"v{LAYOUT_VERSION}/ns/fp-test/h0"  # make_key()'s default key, as a string

pytestmark = pytest.mark.redis

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def keys_of(sync_redis, pattern: str = "*") -> list[str]:
    return sorted(k.decode() for k in sync_redis.scan_iter(match=pattern))


@pytest.mark.parametrize("dtype", DTYPES)
async def test_round_trip(dtype, redis_url, make_key) -> None:
    store = RedisBlockStore(redis_url)
    block = synthetic_block(dtype=dtype)
    try:
        assert await store.get(make_key()) is None and not await store.contains(make_key())
        await store.put(make_key(), block)
        assert await store.contains(make_key())
        assert_same_block(await store.get(make_key()), block)
        assert metric("skillcache_store_up", tier="redis") == 1
    finally:
        await store.close()


async def test_chunked_when_larger_than_one_chunk(redis_url, sync_redis, make_key) -> None:
    store = RedisBlockStore(redis_url, chunk_bytes=1000)
    block = synthetic_block()  # ~8 KiB of tensors -> 9+ chunks
    try:
        await store.put(make_key(), block)
        chunks = keys_of(sync_redis, "*:chunk:*")
        assert len(chunks) >= 9
        assert all(k.startswith(f"skillcache:{{{K0}}}:chunk:") for k in chunks)  # one hash tag
        assert keys_of(sync_redis, "*:manifest") == [f"skillcache:{{{K0}}}:manifest"]
        assert all(len(sync_redis.get(k)) <= 1000 for k in chunks)
        assert sync_redis.ttl(chunks[0]) == -1  # no TTL configured: pending TTL removed after commit
        assert_same_block(await store.get(make_key()), block)
        other = RedisBlockStore(redis_url, chunk_bytes=333)  # a reader configured differently still reads it
        assert_same_block(await other.get(make_key()), block)
        await other.close()
    finally:
        await store.close()


async def test_missing_chunk_is_a_counted_miss_and_cleaned(redis_url, sync_redis, make_key) -> None:
    store = RedisBlockStore(redis_url, chunk_bytes=1000)
    try:
        await store.put(make_key(), synthetic_block())
        sync_redis.delete(keys_of(sync_redis, "*:chunk:*")[3])  # as if evicted under maxmemory
        before = metric("skillcache_store_corrupt_total", tier="redis", reason="chunks")
        assert await store.get(make_key()) is None
        assert metric("skillcache_store_corrupt_total", tier="redis", reason="chunks") == before + 1
        assert keys_of(sync_redis) == []  # manifest and remaining chunks deleted
    finally:
        await store.close()


async def test_chunks_without_manifest_are_a_miss(redis_url, sync_redis, make_key) -> None:
    """A writer that died before its manifest (the commit point) leaves nothing readable."""
    store = RedisBlockStore(redis_url, chunk_bytes=1000)
    try:
        await store.put(make_key(), synthetic_block())
        sync_redis.delete(keys_of(sync_redis, "*:manifest")[0])
        assert await store.get(make_key()) is None and not await store.contains(make_key())
    finally:
        await store.close()


@pytest.mark.parametrize("tamper", ["flip", "truncate", "manifest"])
async def test_corrupt_bytes_detected(tamper, redis_url, sync_redis, make_key) -> None:
    store = RedisBlockStore(redis_url, chunk_bytes=1000)
    try:
        await store.put(make_key(), synthetic_block())
        chunk = keys_of(sync_redis, "*:chunk:*")[2]
        if tamper == "flip":
            data = bytearray(sync_redis.get(chunk))
            data[10] ^= 0x40
            sync_redis.set(chunk, bytes(data))
        elif tamper == "truncate":
            sync_redis.set(chunk, sync_redis.get(chunk)[:-1])
        else:
            sync_redis.set(keys_of(sync_redis, "*:manifest")[0], b"{not json")
        reason = "format" if tamper == "manifest" else "chunks"
        before = metric("skillcache_store_corrupt_total", tier="redis", reason=reason)
        assert await store.get(make_key()) is None
        assert metric("skillcache_store_corrupt_total", tier="redis", reason=reason) == before + 1
        assert keys_of(sync_redis, "*:manifest") == []
    finally:
        await store.close()


async def test_two_clients_share_blocks(redis_url, make_key) -> None:
    a, b = RedisBlockStore(redis_url), RedisBlockStore(redis_url)
    try:
        block = synthetic_block(dtype=torch.bfloat16)
        await a.put(make_key(), block)
        assert_same_block(await b.get(make_key()), block)
        assert await b.delete(make_key()) and await a.get(make_key()) is None
    finally:
        await a.close()
        await b.close()


async def test_ttl_on_every_key(redis_url, sync_redis, make_key) -> None:
    """Every key (manifest and chunks) carries the configured TTL, not the pending one (1 h) nor none: what is left
    of 100 s is at most the time this test has taken since the put began, whatever that was."""
    store = RedisBlockStore(redis_url, chunk_bytes=2000, ttl_s=100)
    try:
        t0 = time.monotonic()
        await store.put(make_key(), synthetic_block())
        ttls = [sync_redis.pttl(k) for k in keys_of(sync_redis)]
        elapsed_ms = (time.monotonic() - t0) * 1000
        assert len(ttls) > 2 and all(100_000 - elapsed_ms - 1000 < t <= 100_000 for t in ttls), (ttls, elapsed_ms)
    finally:
        await store.close()


async def test_rewrite_replaces_chunks(redis_url, sync_redis, make_key) -> None:
    store = RedisBlockStore(redis_url, chunk_bytes=1000)
    try:
        await store.put(make_key(), synthetic_block(seed=1))
        n = len(keys_of(sync_redis))
        await store.put(make_key(), synthetic_block(seed=2))  # different bytes, same key
        assert len(keys_of(sync_redis)) == n  # the old chunk set was removed
        assert_same_block(await store.get(make_key()), synthetic_block(seed=2))
    finally:
        await store.close()


async def test_delete_namespace_hash(redis_url, sync_redis, make_key) -> None:
    store = RedisBlockStore(redis_url, chunk_bytes=1000)
    try:
        for fp in ("fp-a", "fp-b"):
            await store.put(make_key("h0", fingerprint=fp), synthetic_block(fingerprint=fp))
        await store.put(make_key("h1"), synthetic_block())
        await store.put(make_key("h0", namespace="other"), synthetic_block())
        assert await store.delete_namespace_hash("ns", "h0") == 2
        assert await store.contains(make_key("h1")) and await store.contains(make_key("h0", namespace="other"))
        assert not any("/ns/fp-a/h0}" in k or "/ns/fp-b/h0}" in k for k in keys_of(sync_redis))
    finally:
        await store.close()


async def test_lock_compare_and_delete(redis_url, make_key) -> None:
    store = RedisBlockStore(redis_url)
    try:
        assert await store.try_lock(make_key(), "me", 5)
        assert not await store.try_lock(make_key(), "you", 5)
        assert not await store.unlock(make_key(), "you") and await store.lock_held(make_key())
        assert await store.unlock(make_key(), "me") and not await store.lock_held(make_key())
    finally:
        await store.close()


async def test_dead_redis_fails_fast_then_reconnects(own_redis, make_key) -> None:
    store = RedisBlockStore(own_redis.url, connect_timeout_s=0.5, op_timeout_s=1.0)
    block = synthetic_block()
    try:
        await store.put(make_key(), block)
        own_redis.stop()
        with pytest.raises(StoreUnavailable) as ei:
            # an error, not a hang: bounded by the client's timeouts (0.5 s to connect, 1 s an operation, one retry),
            # and this only guards against a hang, 10x that
            await asyncio.wait_for(store.get(make_key()), timeout=10 * 2 * (0.5 + 1.0))
        assert ei.value.error_type == "store_unavailable" and "unreachable" in str(ei.value)
        assert metric("skillcache_store_up", tier="redis") == 0
        assert not await store.ping() and "unreachable" in (store.last_error or "")
        own_redis.start()  # same port, empty (no persistence)
        assert await store.get(make_key()) is None and await store.ping()
        await store.put(make_key(), block)
        assert_same_block(await store.get(make_key()), block)
    finally:
        await store.close()
