"""TieredStore: read-through, write-through, outages, and compile-once (in process and across replicas)."""

from __future__ import annotations

import asyncio
import errno
import time
from pathlib import Path

import pytest

from service.kv.block import LAYOUT_VERSION, KVBlock
from service.store.disk import DiskBlockStore
from service.store.base import BlockStore
from service.store.errors import StoreUnavailable, StoreWriteError
from service.store.memory import MemoryBlockStore
from service.store.redis import RedisBlockStore
from service.store.tiered import TieredStore
from tests.store.store_helpers import assert_same_block, metric, synthetic_block

K0 = f"v{LAYOUT_VERSION}/ns/fp-test/h0"  # make_key()'s default key, as a string


class Compiler:
    """A compile_fn that counts calls and takes `delay` seconds."""

    def __init__(self, delay: float = 0.05, fail: bool = False, seed: int = 0) -> None:
        self.calls, self.delay, self.fail, self.seed = 0, delay, fail, seed

    async def __call__(self) -> KVBlock:
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.fail:
            raise RuntimeError("compile failed")
        return synthetic_block(seed=self.seed)


def local_tiers(root: Path) -> list:
    return [MemoryBlockStore(1 << 22), DiskBlockStore(root)]


async def test_read_through_and_sources(tmp_path: Path, make_key) -> None:
    mem, disk = local_tiers(tmp_path)
    store = TieredStore([mem, disk], background_fill=False)
    block = synthetic_block()
    await disk.put(make_key(), block)
    got, src = await store.get(make_key())
    assert src == "disk" and await mem.contains(make_key())
    assert_same_block(got, block)
    assert (await store.get(make_key()))[1] == "memory"
    assert await store.get(make_key("nope")) == (None, None)
    assert await store.health() == {"memory": "ok", "disk": "ok"}


async def test_ephemeral_blocks_stay_in_memory(tmp_path: Path, make_key) -> None:
    """One-off variants (recompile edits) are cached in memory only: nothing on disk to clean up later."""
    mem, disk = local_tiers(tmp_path)
    store = TieredStore([mem, disk], background_fill=False)
    compile_fn = Compiler(delay=0.0)
    _, src = await store.get_or_compile(make_key("variant"), compile_fn, ephemeral=True)
    assert src == "compiled" and await mem.contains(make_key("variant"))
    assert not await disk.contains(make_key("variant")) and not list(tmp_path.rglob("*.safetensors"))
    assert (await store.get_or_compile(make_key("variant"), compile_fn, ephemeral=True))[1] == "memory"
    assert compile_fn.calls == 1
    # a registered block goes everywhere, and an ephemeral lookup does not read it from disk
    await store.get_or_compile(make_key("skill"), compile_fn)
    assert await disk.contains(make_key("skill"))
    await mem.delete(make_key("skill"))
    assert (await store.get_or_compile(make_key("skill"), compile_fn, ephemeral=True))[1] == "compiled"


async def test_write_through_reports_failed_tiers(tmp_path: Path, make_key, monkeypatch) -> None:
    store = TieredStore(local_tiers(tmp_path))

    def erofs(*_a, **_k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("service.store.fsutil._replace", erofs)
    errors = metric("skillcache_store_errors_total", tier="disk")
    assert await store.put(make_key(), synthetic_block()) == ["disk"]
    assert metric("skillcache_store_errors_total", tier="disk") == errors + 1
    assert (await store.get(make_key()))[1] == "memory"
    health = await store.health()
    assert health["memory"] == "ok" and health["disk"].startswith("degraded: disk store at")
    assert "EROFS" in health["disk"]
    monkeypatch.undo()
    assert await store.put(make_key(), synthetic_block()) == []  # the next good write clears it
    assert await store.health() == {"memory": "ok", "disk": "ok"}


async def test_unusable_disk_root(tmp_path: Path, make_key) -> None:
    (tmp_path / "file").write_text("x")
    bad_disk = DiskBlockStore(tmp_path / "file" / "blocks")
    store = TieredStore([MemoryBlockStore(1 << 22), bad_disk])
    assert await store.put(make_key(), synthetic_block()) == ["disk"]
    health = await store.health()
    assert (health["memory"] == "ok" and health["disk"].startswith("down: ")
            and "not a readable directory" in health["disk"])
    with pytest.raises(StoreWriteError):
        await TieredStore([bad_disk]).put(make_key(), synthetic_block())  # no tier took it


async def test_single_flight_in_process(tmp_path: Path, make_key) -> None:
    store = TieredStore(local_tiers(tmp_path))
    compile_fn = Compiler(delay=0.1)
    compiles = metric("skillcache_compiles_total")
    results = await asyncio.gather(*(store.get_or_compile(make_key(), compile_fn) for _ in range(10)))
    assert compile_fn.calls == 1 and metric("skillcache_compiles_total") == compiles + 1
    assert {src for _, src in results} == {"compiled"} and all(b is results[0][0] for b, _ in results)
    assert (await store.get_or_compile(make_key(), compile_fn))[1] == "memory" and compile_fn.calls == 1
    assert store.compiles.inflight == {}


async def test_cancelled_caller_does_not_cancel_shared_compile(tmp_path: Path, make_key) -> None:
    store = TieredStore(local_tiers(tmp_path))
    compile_fn = Compiler(delay=0.2)
    first = asyncio.create_task(store.get_or_compile(make_key(), compile_fn))
    second = asyncio.create_task(store.get_or_compile(make_key(), compile_fn))
    await asyncio.sleep(0.05)
    first.cancel()
    block, src = await second
    assert src == "compiled" and compile_fn.calls == 1 and first.cancelled()


async def test_compile_error_reaches_every_caller_and_is_retried(tmp_path: Path, make_key) -> None:
    store = TieredStore(local_tiers(tmp_path))
    failing = Compiler(fail=True)
    results = await asyncio.gather(*(store.get_or_compile(make_key(), failing) for _ in range(3)),
                                   return_exceptions=True)
    assert failing.calls == 1 and all(isinstance(r, RuntimeError) for r in results)
    assert (await store.get_or_compile(make_key(), Compiler()))[1] == "compiled"  # not cached as a failure


async def test_corrupt_disk_block_is_recompiled(tmp_path: Path, make_key) -> None:
    store = TieredStore(local_tiers(tmp_path))
    await store.get_or_compile(make_key(), Compiler())
    path = tmp_path / "fp-test" / "ns" / "h0.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    restarted = TieredStore(local_tiers(tmp_path))  # empty memory tier: the disk copy is what it finds
    compile_fn = Compiler()
    block, src = await restarted.get_or_compile(make_key(), compile_fn)
    assert src == "compiled" and compile_fn.calls == 1
    assert_same_block(block, synthetic_block())
    assert_same_block(await DiskBlockStore(tmp_path).get(make_key()), block)  # rewritten, valid


async def test_delete_namespace_hash_everywhere(tmp_path: Path, make_key) -> None:
    store = TieredStore(local_tiers(tmp_path))
    await store.put(make_key(), synthetic_block())
    await store.put(make_key(fingerprint="fp-b"), synthetic_block(fingerprint="fp-b"))
    assert await store.delete_namespace_hash("ns", "h0") == 4  # 2 blocks x 2 tiers
    assert not await store.contains(make_key()) and not await store.contains(make_key(fingerprint="fp-b"))


class DeadTier(BlockStore):
    """A tier whose backend is unreachable; counts how often it is tried."""

    name = "redis"

    def __init__(self) -> None:
        self.calls = 0

    async def _fail(self, *_a: object) -> None:
        self.calls += 1
        await asyncio.sleep(0.05)  # a slow failure, like a connect timeout
        raise StoreUnavailable("redis at redis://10.0.0.1:6379/0 unreachable: TimeoutError")

    get = put = delete = contains = delete_namespace_hash = _fail  # type: ignore[assignment]

    async def ping(self) -> bool:
        return False


async def test_down_tier_is_probed_by_one_caller_per_interval(make_key) -> None:
    dead = DeadTier()
    store = TieredStore([MemoryBlockStore(1 << 22), dead], retry_interval_s=0.3)
    assert await store.get(make_key()) == (None, None) and dead.calls == 1
    assert store.status()["redis"].startswith("down: redis at")
    await asyncio.gather(*(store.get(make_key(f"k{i}")) for i in range(10)))
    assert dead.calls == 1  # inside the retry interval: skipped
    await asyncio.sleep(0.35)
    await asyncio.gather(*(store.get(make_key(f"k{i}")) for i in range(10)))
    assert dead.calls == 2  # one probe, not ten
    assert await store.put(make_key(), synthetic_block()) == ["redis"]


# -- with Redis --

def redis_tiers(root: Path, url: str, **kw) -> list:
    return [*local_tiers(root), RedisBlockStore(url, chunk_bytes=2048, connect_timeout_s=0.5, op_timeout_s=1.0, **kw)]


@pytest.mark.redis
async def test_corrupt_redis_block_is_recompiled(tmp_path: Path, redis_url, sync_redis, make_key) -> None:
    store = TieredStore(redis_tiers(tmp_path / "a", redis_url))
    await store.get_or_compile(make_key(), Compiler())
    chunk = sorted(sync_redis.scan_iter(match="*:chunk:*"))[1]
    sync_redis.setrange(chunk, 5, b"\x00\x01\x02")
    other = TieredStore(redis_tiers(tmp_path / "b", redis_url))  # another replica: only Redis is shared
    compile_fn = Compiler()
    block, src = await other.get_or_compile(make_key(), compile_fn)
    assert (src, compile_fn.calls) == ("compiled", 1)
    assert_same_block(block, synthetic_block())
    await other.close()
    await store.close()


@pytest.mark.redis
async def test_redis_outage_and_recovery(tmp_path: Path, own_redis, make_key) -> None:
    store = TieredStore(redis_tiers(tmp_path, own_redis.url), retry_interval_s=0.2, background_fill=False)
    mem, disk, red = store.tiers
    try:
        assert await store.put(make_key("a"), synthetic_block()) == []
        own_redis.stop()
        t0 = time.monotonic()
        assert (await store.get(make_key("a")))[1] == "memory"
        await mem.delete(make_key("a"))
        assert (await store.get(make_key("a")))[1] == "disk"
        assert await store.put(make_key("b"), synthetic_block(seed=1)) == ["redis"]
        block, src = await store.get_or_compile(make_key("c"), Compiler())
        assert src == "compiled"
        assert time.monotonic() - t0 < 5  # a dead Redis must not stall requests
        health = await store.health()
        assert health["memory"] == "ok" and health["disk"] == "ok" and health["redis"].startswith("down: ")
        assert metric("skillcache_store_up", tier="redis") == 0
        own_redis.start()  # same port, empty
        await asyncio.sleep(0.25)  # past retry_interval_s: the tier is tried again and reconnects
        assert await store.put(make_key("d"), synthetic_block(seed=2)) == []
        assert_same_block(await red.get(make_key("d")), synthetic_block(seed=2))
        assert await store.health() == {"memory": "ok", "disk": "ok", "redis": "ok"}
        assert metric("skillcache_store_up", tier="redis") == 1
    finally:
        await store.close()


@pytest.mark.redis
async def test_redis_hit_fills_local_tiers(tmp_path: Path, redis_url, make_key) -> None:
    a = TieredStore(redis_tiers(tmp_path / "a", redis_url))
    b = TieredStore(redis_tiers(tmp_path / "b", redis_url))
    try:
        await a.get_or_compile(make_key(), Compiler())
        block, src = await b.get(make_key())
        assert src == "redis"
        await b.drain()
        assert await b.tiers[0].contains(make_key()) and await b.tiers[1].contains(make_key())
        assert (await b.get(make_key()))[1] == "memory"
    finally:
        await a.close()
        await b.close()


@pytest.mark.redis
async def test_compile_once_across_replicas(tmp_path: Path, redis_url, make_key) -> None:
    replicas = [TieredStore(redis_tiers(tmp_path / str(i), redis_url), lock_poll_s=0.02) for i in range(3)]
    compilers = [Compiler(delay=0.3) for _ in replicas]
    try:
        results = await asyncio.gather(*(
            r.get_or_compile(make_key(), c) for r, c in zip(replicas, compilers) for _ in range(4)))
        assert sum(c.calls for c in compilers) == 1
        assert sorted({src for _, src in results}) == ["compiled", "redis"]
        for _, src in results:
            assert src in ("compiled", "redis")
        for block, _ in results:
            assert_same_block(block, synthetic_block())
        assert not await replicas[0].tiers[2].lock_held(make_key())  # released
    finally:
        for r in replicas:
            await r.close()


@pytest.mark.redis
async def test_lock_timeout_falls_back_to_local_compile(tmp_path: Path, redis_url, sync_redis, make_key) -> None:
    store = TieredStore(redis_tiers(tmp_path, redis_url), lock_timeout_s=0.4, lock_poll_s=0.02)
    sync_redis.set(f"skillcache:{{{K0}}}:lock", "a-replica-that-died", px=60_000)
    compile_fn = Compiler(delay=0.01)
    try:
        t0 = time.monotonic()
        block, src = await store.get_or_compile(make_key(), compile_fn)
        assert src == "compiled" and compile_fn.calls == 1 and 0.35 < time.monotonic() - t0 < 3
        assert sync_redis.get(f"skillcache:{{{K0}}}:lock") == b"a-replica-that-died"  # not ours to drop
    finally:
        await store.close()


@pytest.mark.redis
async def test_failed_holder_hands_over(tmp_path: Path, redis_url, make_key) -> None:
    a = TieredStore(redis_tiers(tmp_path / "a", redis_url), lock_poll_s=0.02)
    b = TieredStore(redis_tiers(tmp_path / "b", redis_url), lock_poll_s=0.02)
    failing, good = Compiler(delay=0.2, fail=True), Compiler(delay=0.01)
    try:
        task_a = asyncio.create_task(a.get_or_compile(make_key(), failing))
        await asyncio.sleep(0.05)  # a holds the lock
        block, src = await b.get_or_compile(make_key(), good)
        with pytest.raises(RuntimeError):
            await task_a
        assert (src, failing.calls, good.calls) == ("compiled", 1, 1)
    finally:
        await a.close()
        await b.close()


@pytest.mark.redis
async def test_redis_down_compiles_locally(tmp_path: Path, own_redis, make_key) -> None:
    store = TieredStore(redis_tiers(tmp_path, own_redis.url))
    own_redis.stop()
    try:
        block, src = await store.get_or_compile(make_key(), Compiler())
        assert src == "compiled" and (await store.get(make_key()))[1] == "memory"
    finally:
        await store.close()


async def test_ephemeral_without_a_memory_tier_is_just_compiled(tmp_path: Path, make_key) -> None:
    store = TieredStore([DiskBlockStore(tmp_path)], background_fill=False)
    compile_fn = Compiler(delay=0.0)
    assert (await store.get_or_compile(make_key("v"), compile_fn, ephemeral=True))[1] == "compiled"
    assert (await store.get_or_compile(make_key("v"), compile_fn, ephemeral=True))[1] == "compiled"
    assert compile_fn.calls == 2 and not list(tmp_path.rglob("*.safetensors"))
