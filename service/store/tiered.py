"""TieredStore: memory -> disk/redis with read-through, write-through, and compile-once semantics."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from service.kv.block import KVBlock
from service.metrics import COMPILES, STORE_ERRORS, STORE_OPS, STORE_UP
from service.store.base import BlockStore
from service.store.disk import DiskBlockStore
from service.store.errors import StoreError, StoreUnavailable, StoreWriteError
from service.store.hits import HitCounts
from service.store.key import BlockKey

log = logging.getLogger(__name__)

CompileFn = Callable[[], Awaitable[KVBlock]]


@dataclass
class _TierState:
    down: str | None = None  # last StoreUnavailable message while down
    retry_at: float = 0.0  # monotonic time before which a down tier is skipped
    write_error: str | None = None  # last StoreWriteError, cleared by the next successful write


class TieredStore:
    """Tiers in order, fastest first. A tier raising StoreUnavailable is skipped for `retry_interval_s`,
    then tried again (redis-py reconnects by itself), so a Redis outage only costs hit rate.
    """

    def __init__(self, tiers: list[BlockStore], *, lock_timeout_s: float = 60.0, lock_poll_s: float = 0.05,
                 retry_interval_s: float = 2.0, background_fill: bool = True,
                 canonicalize: Callable[[KVBlock], KVBlock] | None = None) -> None:
        if not tiers:
            raise ValueError("need at least one tier")
        self.tiers = tiers
        self.lock_timeout_s, self.lock_poll_s = lock_timeout_s, lock_poll_s
        self.retry_interval_s = retry_interval_s
        self.background_fill = background_fill
        self.canonicalize = canonicalize  # applied to compiled blocks (int8 storage: the read-back form)
        self._state = {t.name: _TierState() for t in tiers}
        self._inflight: dict[BlockKey, asyncio.Task[tuple[KVBlock, str]]] = {}
        self._fills: set[asyncio.Task[None]] = set()
        self._lock_tier = next((t for t in tiers if hasattr(t, "try_lock")), None)  # the Redis tier
        self.hits = HitCounts()  # blocks get_or_compile served, per key and tier (ephemeral ones not counted)

    # -- tier bookkeeping --

    def _available(self, tier: BlockStore) -> bool:
        """Up, or down but due for a retry. One caller per interval gets the retry (a probe); the
        others keep skipping the tier, so a black-holed Redis stalls one request, not all of them."""
        st = self._state[tier.name]
        if st.down is None:
            return True
        now = time.monotonic()
        if now < st.retry_at:
            return False
        st.retry_at = now + self.retry_interval_s
        return True

    def _mark_down(self, tier: BlockStore, err: StoreUnavailable) -> None:
        st = self._state[tier.name]
        if st.down is None:
            log.warning("store tier %s is down, serving without it: %s", tier.name, err)
        st.down, st.retry_at = str(err), time.monotonic() + self.retry_interval_s
        STORE_UP.labels(tier=tier.name).set(0)

    def _mark_up(self, tier: BlockStore) -> None:
        st = self._state[tier.name]
        STORE_UP.labels(tier=tier.name).set(1)
        if st.down is not None:
            log.warning("store tier %s is back", tier.name)
            st.down = None

    async def _run(self, tier: BlockStore, op: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Call one tier: time it, count errors, track up/down."""
        t0 = time.perf_counter()
        try:
            result = await fn(*args)
        except StoreUnavailable as e:
            STORE_ERRORS.labels(tier=tier.name).inc()
            self._mark_down(tier, e)
            raise
        except StoreWriteError as e:
            STORE_ERRORS.labels(tier=tier.name).inc()
            self._state[tier.name].write_error = str(e)
            self._mark_up(tier)  # it answered: reachable, only the write was refused
            raise
        finally:
            STORE_OPS.labels(tier=tier.name, op=op).observe(time.perf_counter() - t0)
        self._mark_up(tier)
        if op == "put":
            self._state[tier.name].write_error = None
        return result

    # -- reads and writes --

    def _tiers(self, ephemeral: bool) -> list[BlockStore]:
        """Every tier, or for ephemeral blocks only the in-process memory tier(s)."""
        return [t for t in self.tiers if t.name == "memory"] if ephemeral else self.tiers

    async def get(self, key: BlockKey, ephemeral: bool = False, accept: Callable[[KVBlock], bool] | None = None
                  ) -> tuple[KVBlock | None, str | None]:
        """(block, tier name) from the first tier that has it, filling the tiers above; (None, None) on a miss.

        `accept`: for a key whose block changes (a session's KV, rewritten every turn), a block it refuses is an
        older copy in a faster tier (another replica wrote the newer one to Redis): it is skipped, and the fill
        overwrites it."""
        tiers = self._tiers(ephemeral)
        for i, tier in enumerate(tiers):
            if not self._available(tier):
                continue
            try:
                block = await self._run(tier, "get", tier.get, key)
            except StoreError:
                continue
            if block is not None and (accept is None or accept(block)):
                await self._fill(tiers[:i], key, block)
                return block, tier.name
        return None, None

    async def _fill(self, tiers: list[BlockStore], key: BlockKey, block: KVBlock) -> None:
        """Read-through: memory synchronously, slower tiers in the background (unless background_fill=False)."""
        for tier in tiers:
            if tier.name != "memory" and self.background_fill:
                task = asyncio.create_task(self._put_quiet(tier, key, block))
                self._fills.add(task)
                task.add_done_callback(self._fills.discard)
            else:
                await self._put_quiet(tier, key, block)

    async def _put_quiet(self, tier: BlockStore, key: BlockKey, block: KVBlock) -> StoreError | None:
        if not self._available(tier):
            return StoreUnavailable(self._state[tier.name].down or "down")
        try:
            await self._run(tier, "put", tier.put, key, block)
            return None
        except StoreError as e:
            log.warning("store tier %s: put %s failed: %s", tier.name, key.to_str(), e)
            return e

    async def put(self, key: BlockKey, block: KVBlock, ephemeral: bool = False) -> list[str]:
        """Write to every tier (ephemeral: memory only); returns the names of tiers that failed. Raises only
        if every tier failed."""
        tiers = self._tiers(ephemeral)
        if not tiers:  # ephemeral, and no memory tier to hold it: nothing to write
            return []
        errors = await asyncio.gather(*(self._put_quiet(t, key, block) for t in tiers))
        failed = [t.name for t, e in zip(tiers, errors) if e is not None]
        if len(failed) == len(tiers):
            raise next(e for e in errors if e is not None)
        return failed

    async def contains(self, key: BlockKey) -> bool:
        for tier in self.tiers:
            if self._available(tier):
                try:
                    if await self._run(tier, "contains", tier.contains, key):
                        return True
                except StoreError:
                    pass
        return False

    async def read_meta(self, key: BlockKey) -> dict[str, str] | None:
        """The block's meta (its calibration, ...) from the first tier holding it, without loading its tensors,
        filling other tiers or touching the memory tier's LRU order; None when no reachable tier holds it."""
        for tier in self.tiers:
            if self._available(tier):
                try:
                    meta = await self._run(tier, "meta", tier.read_meta, key)
                except StoreError:
                    continue
                if meta is not None:
                    return meta
        return None

    async def delete(self, key: BlockKey) -> bool:
        """Delete from every reachable tier; True if any tier held it."""
        found = False
        for tier in self.tiers:
            try:
                found |= bool(await self._run(tier, "delete", tier.delete, key))
            except StoreError as e:
                log.warning("store tier %s: delete %s failed: %s", tier.name, key.to_str(), e)
        return found

    async def delete_namespace_hash(self, namespace: str, content_hash: str) -> int:
        """Delete that content's blocks (any model) everywhere; returns entries removed, summed over tiers."""
        self.hits.forget(namespace, content_hash)
        total = 0
        for tier in self.tiers:
            try:
                total += await self._run(tier, "delete", tier.delete_namespace_hash, namespace, content_hash)
            except StoreError as e:
                log.warning("store tier %s: delete %s/%s failed (stale blocks stay until TTL / next delete): %s",
                            tier.name, namespace, content_hash, e)
        return total

    async def disk_keys(self, prefix: str) -> list[tuple[BlockKey, float]]:
        """(key, file mtime) of this replica's disk-tier blocks whose content hash starts with `prefix` (Redis is
        not listed)."""
        keys: list[tuple[BlockKey, float]] = []
        for tier in self.tiers:
            if isinstance(tier, DiskBlockStore):
                keys += await asyncio.to_thread(tier.list_keys, prefix)
        return keys

    # -- compile once --

    async def get_or_compile(self, key: BlockKey, compile_fn: CompileFn,
                             ephemeral: bool = False) -> tuple[KVBlock, str]:
        """The block and where it came from (a tier name or "compiled"), compiling at most once per key.

        Concurrent callers in this process share one compile (callers that joined it also get
        "compiled"); with a Redis tier, replicas share one compile through a Redis lock.
        Cancelling a caller does not cancel the shared compile. `ephemeral`: a one-off block (a
        recompile edit's variant) kept in the memory tier only, where LRU eviction bounds it; it is
        never written to disk or Redis, which nothing would ever clean up.
        """
        block, source = await self.get(key, ephemeral)
        if block is None:
            task = self._inflight.get(key)
            if task is None:
                task = asyncio.create_task(self._produce(key, compile_fn, ephemeral))
                self._inflight[key] = task
                task.add_done_callback(lambda t: self._task_done(key, t))
            block, source = await asyncio.shield(task)
        if not ephemeral:
            self.hits.add(key, source)
        return block, source  # type: ignore[return-value]

    def _task_done(self, key: BlockKey, task: asyncio.Task[Any]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # mark retrieved: callers that went away must not cause a warning

    async def _produce(self, key: BlockKey, compile_fn: CompileFn, ephemeral: bool = False) -> tuple[KVBlock, str]:
        block, source = await self.get(key, ephemeral)  # a compile for this key may have finished since our miss
        if block is not None:
            return block, source  # type: ignore[return-value]
        if ephemeral:
            return await self._compile(key, compile_fn, ephemeral=True)
        lock = self._lock_tier
        if lock is None or not self._available(lock):
            return await self._compile(key, compile_fn)
        token = secrets.token_hex(16)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lock_timeout_s
        while True:
            try:
                acquired = await self._run(lock, "lock", lock.try_lock, key, token, self.lock_timeout_s)
            except StoreError:
                return await self._compile(key, compile_fn)
            if acquired:
                try:
                    try:
                        block = await self._lock_tier_get(lock, key)  # the previous holder may have just finished
                    except StoreError:
                        block = None
                    if block is not None:
                        await self._fill([t for t in self.tiers if t is not lock], key, block)
                        return block, lock.name
                    return await self._compile(key, compile_fn)
                finally:
                    try:
                        await self._run(lock, "unlock", lock.unlock, key, token)
                    except StoreError as e:
                        log.warning("could not release compile lock for %s (expires by itself): %s", key, e)
            delay = self.lock_poll_s
            while loop.time() < deadline:
                await asyncio.sleep(delay)
                delay = min(delay * 1.5, 0.5)
                try:
                    block = await self._lock_tier_get(lock, key)
                    if block is not None:
                        await self._fill([t for t in self.tiers if t is not lock], key, block)
                        return block, lock.name
                    if not await self._run(lock, "lock", lock.lock_held, key):
                        break  # the holder gave up without storing a block: try to take the lock
                except StoreError:
                    return await self._compile(key, compile_fn)
            else:
                log.warning("compile lock for %s still held after %.1fs; compiling locally", key, self.lock_timeout_s)
                return await self._compile(key, compile_fn)

    async def _lock_tier_get(self, lock: BlockStore, key: BlockKey) -> KVBlock | None:
        return await self._run(lock, "get", lock.get, key)

    async def _compile(self, key: BlockKey, compile_fn: CompileFn, ephemeral: bool = False) -> tuple[KVBlock, str]:
        block = await compile_fn()
        COMPILES.inc()
        if self.canonicalize is not None:
            block = await asyncio.to_thread(self.canonicalize, block)
        try:
            failed = await self.put(key, block, ephemeral)
            if failed:
                log.warning("compiled block %s not stored in %s", key, failed)
        except StoreError as e:
            log.error("compiled block %s could not be stored anywhere: %s", key, e)
        return block, "compiled"

    # -- health and lifecycle --

    async def health(self) -> dict[str, str]:
        """Per tier: "ok", "down: <error>" or "degraded: <why>" (reads work, writes fail). Pings every tier."""
        out: dict[str, str] = {}
        for tier in self.tiers:
            st = self._state[tier.name]
            err = "ping failed"
            try:
                ok = await asyncio.wait_for(tier.ping(), timeout=5.0)
                err = getattr(tier, "last_error", None) or err  # ping's reason, when the tier keeps one
            except (asyncio.TimeoutError, StoreError) as e:
                ok, err = False, str(e) or "ping timed out"
            if ok:
                self._mark_up(tier)
                problem = st.write_error or getattr(tier, "last_error", None)
                out[tier.name] = f"degraded: {problem}" if problem else "ok"
            else:
                self._mark_down(tier, StoreUnavailable(st.down or err))
                out[tier.name] = f"down: {st.down}"
        return out

    def status(self) -> dict[str, str]:
        """Last known per-tier state, without touching the backends."""
        return {n: f"down: {s.down}" if s.down else (f"degraded: {s.write_error}" if s.write_error else "ok")
                for n, s in self._state.items()}

    async def drain(self) -> None:
        """Wait for background read-through fills (tests, shutdown)."""
        while self._fills:
            await asyncio.gather(*list(self._fills), return_exceptions=True)

    async def close(self) -> None:
        await self.drain()
        for tier in self.tiers:
            try:
                await tier.close()
            except Exception as e:  # noqa: BLE001 - closing must not fail shutdown
                log.warning("closing store tier %s: %s", tier.name, e)
