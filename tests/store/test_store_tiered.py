"""TieredStore: read-through, write-through, outages, and compile-once (in process and across replicas)."""

from __future__ import annotations

import asyncio
import errno
import time
from collections import Counter
from collections.abc import Callable
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
    """A compile_fn that counts calls. gated: each compile waits for `release()`, so callers that arrive meanwhile
    find it in flight however slow the machine is; clock: a callable whose value is recorded at each call."""

    def __init__(self, fail: bool = False, seed: int = 0, gated: bool = False,
                 clock: Callable[[], float] | None = None) -> None:
        self.calls, self.fail, self.seed, self.clock = 0, fail, seed, clock
        self.gate = asyncio.Event()
        if not gated:
            self.gate.set()
        self.at: list[float] = []

    async def __call__(self) -> KVBlock:
        self.calls += 1
        if self.clock is not None:
            self.at.append(self.clock())
        await self.gate.wait()
        await asyncio.sleep(0)  # a compile always yields to the event loop
        if self.fail:
            raise RuntimeError("compile failed")
        return synthetic_block(seed=self.seed)

    def release(self) -> None:
        self.gate.set()


def local_tiers(root: Path) -> list:
    return [MemoryBlockStore(1 << 22), DiskBlockStore(root)]


def reads_done(tier: BlockStore) -> set:
    """The tasks whose read of `tier` has returned (its `get` wrapped on the instance). A caller of get_or_compile
    reads every tier in turn; once its read of the last one has returned it has missed everywhere and waits on the
    compile in flight (nothing between them waits)."""
    done: set = set()
    get = tier.get

    async def recorded(key):
        try:
            return await get(key)
        finally:
            done.add(asyncio.current_task())

    tier.get = recorded  # type: ignore[method-assign]
    return done


async def until(cond: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
    """Poll for a condition other tasks or threads make true; the timeout only guards against a hang."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        await asyncio.sleep(0.005)
    for _ in range(3):
        await asyncio.sleep(0)


class Clock:
    """A module's `time` in a test: monotonic() reads `now`, which only the test moves."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


@pytest.fixture
def health_clock(monkeypatch) -> Clock:
    """The clock of the tiers' up/down state (service/store/health.py): retry intervals pass when the test says."""
    from service.store import health

    clock = Clock()
    monkeypatch.setattr(health, "time", clock)
    return clock


class LoopClock:
    """compile_once's `asyncio` in a test: the running loop's time() reads `now`, and asyncio.sleep moves `now` at
    once (recording the wait) and only yields to the event loop; everything else is the real module."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)

    def get_running_loop(self):
        clock, loop = self, asyncio.get_running_loop()

        class OnClock:
            def time(self) -> float:
                return clock.now

            def __getattr__(self, name: str):
                return getattr(loop, name)

        return OnClock()

    def __getattr__(self, name: str):
        return getattr(asyncio, name)


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
    compile_fn = Compiler()
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
    """Ten callers that all miss while one compile is in flight (it waits until they have) share it."""
    store = TieredStore(local_tiers(tmp_path))
    compile_fn = Compiler(gated=True)
    read = reads_done(store.tiers[-1])
    compiles = metric("skillcache_compiles_total")
    callers = [asyncio.create_task(store.get_or_compile(make_key(), compile_fn)) for _ in range(10)]
    await until(lambda: compile_fn.calls and read >= set(callers), "ten callers waiting on one compile")
    compile_fn.release()
    results = await asyncio.gather(*callers)
    assert compile_fn.calls == 1 and metric("skillcache_compiles_total") == compiles + 1
    assert {src for _, src in results} == {"compiled"} and all(b is results[0][0] for b, _ in results)
    assert (await store.get_or_compile(make_key(), compile_fn))[1] == "memory" and compile_fn.calls == 1
    assert store.compiles.inflight == {}


async def test_cancelled_caller_does_not_cancel_shared_compile(tmp_path: Path, make_key) -> None:
    """The caller that started the compile is cancelled while it runs and the other waits on it."""
    store = TieredStore(local_tiers(tmp_path))
    compile_fn = Compiler(gated=True)
    read = reads_done(store.tiers[-1])
    first = asyncio.create_task(store.get_or_compile(make_key(), compile_fn))
    second = asyncio.create_task(store.get_or_compile(make_key(), compile_fn))
    await until(lambda: compile_fn.calls and read >= {first, second}, "both callers waiting on the compile")
    first.cancel()
    await asyncio.wait([first])
    assert first.cancelled() and not second.done()
    compile_fn.release()
    block, src = await second
    assert src == "compiled" and compile_fn.calls == 1


async def test_compile_error_reaches_every_caller_and_is_retried(tmp_path: Path, make_key) -> None:
    store = TieredStore(local_tiers(tmp_path))
    failing = Compiler(fail=True, gated=True)
    read = reads_done(store.tiers[-1])
    callers = [asyncio.create_task(store.get_or_compile(make_key(), failing)) for _ in range(3)]
    await until(lambda: failing.calls and read >= set(callers), "three callers waiting on one compile")
    failing.release()
    results = await asyncio.gather(*callers, return_exceptions=True)
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


async def test_down_tier_is_probed_by_one_caller_per_interval(make_key, health_clock) -> None:
    dead = DeadTier()
    store = TieredStore([MemoryBlockStore(1 << 22), dead], retry_interval_s=0.3)
    assert await store.get(make_key()) == (None, None) and dead.calls == 1
    assert store.status()["redis"].startswith("down: redis at")
    await asyncio.gather(*(store.get(make_key(f"k{i}")) for i in range(10)))
    assert dead.calls == 1  # inside the retry interval: skipped
    health_clock.now += 0.29
    await asyncio.gather(*(store.get(make_key(f"k{i}")) for i in range(10)))
    assert dead.calls == 1  # still inside it
    health_clock.now += 0.02
    await asyncio.gather(*(store.get(make_key(f"k{i}")) for i in range(10)))
    assert dead.calls == 2  # past it: one probe (slow, all ten in flight together), not ten
    assert await store.put(make_key(), synthetic_block()) == ["redis"]  # the probe failed: skipped again
    assert dead.calls == 2


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


def calls_to(tier: BlockStore) -> list[str]:
    """The operations requests send to `tier` (each wrapped on the instance), in order."""
    seen: list[str] = []
    for op in ("get", "put", "contains", "delete", "read_meta", "try_lock", "lock_held", "unlock"):
        fn = getattr(tier, op, None)
        if fn is not None:
            async def counted(*args, _op=op, _fn=fn):
                seen.append(_op)
                return await _fn(*args)

            setattr(tier, op, counted)
    return seen


@pytest.mark.redis
async def test_redis_outage_and_recovery(tmp_path: Path, own_redis, make_key, health_clock) -> None:
    """A dead Redis does not stall requests: the one that finds it down pays one failed call, the rest skip it
    until the retry interval has passed (on the test's clock); then it is tried again and reconnects."""
    store = TieredStore(redis_tiers(tmp_path, own_redis.url), retry_interval_s=0.2, background_fill=False)
    mem, disk, red = store.tiers
    tried = calls_to(red)
    try:
        assert await store.put(make_key("a"), synthetic_block()) == []
        own_redis.stop()
        n = len(tried)
        assert (await store.get(make_key("a")))[1] == "memory"
        await mem.delete(make_key("a"))
        assert (await store.get(make_key("a")))[1] == "disk"
        assert await store.put(make_key("b"), synthetic_block(seed=1)) == ["redis"]
        block, src = await store.get_or_compile(make_key("c"), Compiler())
        assert src == "compiled"
        assert tried[n:] == ["put"]  # one call found it down; the compile's reads, lock and write skipped it
        health = await store.health()
        assert health["memory"] == "ok" and health["disk"] == "ok" and health["redis"].startswith("down: ")
        assert metric("skillcache_store_up", tier="redis") == 0
        own_redis.start()  # same port, empty
        health_clock.now += 0.25  # past retry_interval_s: the tier is tried again and reconnects
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
    """Four callers on each of three replicas, all missing while the one compile (it waits until they have) is in
    flight: that replica's callers get "compiled", the others' get the block from Redis."""
    replicas = [TieredStore(redis_tiers(tmp_path / str(i), redis_url), lock_poll_s=0.02) for i in range(3)]
    compilers = [Compiler(gated=True) for _ in replicas]
    read = [reads_done(r.tiers[-1]) for r in replicas]
    try:
        callers = [[asyncio.create_task(r.get_or_compile(make_key(), c)) for _ in range(4)]
                   for r, c in zip(replicas, compilers)]
        await until(lambda: sum(c.calls for c in compilers) and all(done >= set(tasks) for done, tasks in
                                                                   zip(read, callers)), "every caller to miss")
        for c in compilers:
            c.release()
        results = await asyncio.gather(*(t for tasks in callers for t in tasks))
        assert sum(c.calls for c in compilers) == 1
        assert Counter(src for _, src in results) == {"compiled": 4, "redis": 8}
        (compiled,) = [i for i, c in enumerate(compilers) if c.calls]
        assert {src for _, src in results[4 * compiled:4 * compiled + 4]} == {"compiled"}
        for block, _ in results:
            assert_same_block(block, synthetic_block())
        assert not await replicas[0].tiers[2].lock_held(make_key())  # released
    finally:
        for r in replicas:
            await r.close()


@pytest.mark.redis
async def test_lock_timeout_falls_back_to_local_compile(tmp_path: Path, redis_url, sync_redis, make_key,
                                                        monkeypatch) -> None:
    """A lock held by a replica that died: the caller keeps looking (Redis, then the lock) in waits that grow to at
    most 0.5 s, and compiles locally at its first look past lock_timeout_s, on compile_once's clock (the test's)."""
    from service.store import compile_once

    clock = LoopClock()
    monkeypatch.setattr(compile_once, "asyncio", clock)
    store = TieredStore(redis_tiers(tmp_path, redis_url), lock_timeout_s=0.4, lock_poll_s=0.02)
    sync_redis.set(f"skillcache:{{{K0}}}:lock", "a-replica-that-died", px=60_000)
    compile_fn = Compiler(clock=lambda: clock.now)
    try:
        block, src = await asyncio.wait_for(store.get_or_compile(make_key(), compile_fn), 60)
        assert src == "compiled" and compile_fn.calls == 1
        assert 0.4 <= compile_fn.at[0] < 0.4 + 0.5  # not before the timeout, and at the first look after it
        assert len(clock.sleeps) >= 3 and clock.sleeps[0] == 0.02 and max(clock.sleeps) <= 0.5
        assert sync_redis.get(f"skillcache:{{{K0}}}:lock") == b"a-replica-that-died"  # not ours to drop
    finally:
        await store.close()


@pytest.mark.redis
async def test_failed_holder_hands_over(tmp_path: Path, redis_url, make_key) -> None:
    """a holds the lock and compiles; b finds it held and waits; a's compile fails: b takes the lock and compiles."""
    a = TieredStore(redis_tiers(tmp_path / "a", redis_url), lock_poll_s=0.02)
    b = TieredStore(redis_tiers(tmp_path / "b", redis_url), lock_poll_s=0.02)
    failing, good = Compiler(fail=True, gated=True), Compiler()
    b_calls = calls_to(b.tiers[2])
    try:
        task_a = asyncio.create_task(a.get_or_compile(make_key(), failing))
        await until(lambda: failing.calls, "a to hold the lock and compile")
        task_b = asyncio.create_task(b.get_or_compile(make_key(), good))
        await until(lambda: "lock_held" in b_calls, "b to wait on the held lock")
        assert not task_b.done() and good.calls == 0
        failing.release()
        with pytest.raises(RuntimeError):
            await task_a
        block, src = await asyncio.wait_for(task_b, 60)
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
    compile_fn = Compiler()
    assert (await store.get_or_compile(make_key("v"), compile_fn, ephemeral=True))[1] == "compiled"
    assert (await store.get_or_compile(make_key("v"), compile_fn, ephemeral=True))[1] == "compiled"
    assert compile_fn.calls == 2 and not list(tmp_path.rglob("*.safetensors"))
