"""read_meta: a block's meta (its calibration) from each tier without loading its tensors, and the per-key hits
TieredStore.get_or_compile counts. What GET /v1/skills reports for every skill rests on these."""

from __future__ import annotations

import json

import pytest

from service.store.disk import DiskBlockStore
from service.store.memory import MemoryBlockStore
from service.store.redis import RedisBlockStore
from service.store.tiered import TieredStore
from tests.store.store_helpers import synthetic_block

CAL = json.dumps({"seam": 2, "passed": True})
META = {"skill": "demo", "calibration": CAL}


async def test_memory_peeks_without_moving_the_block_in_the_lru(make_key) -> None:
    store = MemoryBlockStore(capacity_bytes=10**9)
    a, b = make_key("a"), make_key("b")
    await store.put(a, synthetic_block(meta=META))
    await store.put(b, synthetic_block(seed=1))
    assert await store.read_meta(a) == META and await store.read_meta(make_key("none")) is None
    store.capacity_bytes = 2 * synthetic_block().size_bytes + 1  # room for two: the next put evicts the oldest
    await store.put(make_key("c"), synthetic_block(seed=2))
    assert not await store.contains(a), "read_meta made `a` recently used"
    assert await store.contains(b)


async def test_disk_reads_the_header_only(tmp_path, make_key) -> None:
    store = DiskBlockStore(tmp_path)
    key = make_key()
    assert await store.read_meta(key) is None
    await store.put(key, synthetic_block(meta=META))
    assert await store.read_meta(key) == META
    path = store.path_for(key)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # torn tensors: the header still reads, the block would not
    assert await store.read_meta(key) == META
    assert await store.get(key) is None  # a full read verifies and drops it
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\xff" * 8 + b"{}")  # a damaged header: as good as absent
    assert await store.read_meta(key) is None


@pytest.mark.redis
@pytest.mark.parametrize("chunk_bytes", [32 * 1024 * 1024, 5, 700])
async def test_redis_reads_the_head_across_chunks(chunk_bytes, redis_url, sync_redis, make_key) -> None:
    store = RedisBlockStore(redis_url, chunk_bytes=chunk_bytes)  # 5 bytes: the length spans two chunks
    key = make_key()
    try:
        assert await store.read_meta(key) is None
        await store.put(key, synthetic_block(meta=META))
        assert await store.read_meta(key) == META
        chunk0 = sorted(k for k in sync_redis.scan_iter(match="*:chunk:*") if k.endswith(b":0"))[0]
        sync_redis.delete(chunk0)
        assert await store.read_meta(key) is None  # a missing chunk: damaged, as get() would find
    finally:
        await store.close()


async def test_tiered_takes_the_first_tier_and_fills_nothing(tmp_path, make_key) -> None:
    memory, disk = MemoryBlockStore(10**9), DiskBlockStore(tmp_path)
    store = TieredStore([memory, disk])
    key = make_key()
    await disk.put(key, synthetic_block(meta=META))
    assert await store.read_meta(key) == META
    assert not await memory.contains(key), "a metadata read must not load the block into memory"
    newer = {"calibration": json.dumps({"seam": 0, "passed": True})}
    await memory.put(key, synthetic_block(meta=newer))
    assert await store.read_meta(key) == newer  # the copy this process would serve
    assert await store.read_meta(make_key("none")) is None


async def test_hits_count_each_served_block_by_source(tmp_path, make_key) -> None:
    store = TieredStore([MemoryBlockStore(10**9), DiskBlockStore(tmp_path)])
    key, other = make_key("a"), make_key("b")

    async def compile_fn():
        return synthetic_block()

    for _ in range(3):
        await store.get_or_compile(key, compile_fn)
    await store.get_or_compile(make_key("variant"), compile_fn, ephemeral=True)
    assert store.hits.of(key) == {"compiled": 1, "memory": 2}
    assert store.hits.of(other) == {} and store.hits.of(make_key("variant")) == {}
    await store.delete_namespace_hash(key.namespace, key.content_hash)
    assert store.hits.of(key) == {}
    await store.close()
