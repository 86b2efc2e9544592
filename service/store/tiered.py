"""TieredStore: memory -> disk/redis with read-through and write-through; each tier's up/down state in health.py,
compile-once (one compile per key across callers and replicas) in compile_once.py."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from service.metrics import STORE_ERRORS, STORE_OPS
from service.store.base import BlockStore
from service.store.compile_once import CompileFn, CompileOnce
from service.store.disk import DiskBlockStore
from service.store.errors import StoreError, StoreUnavailable, StoreWriteError
from service.store.health import BackendHealth
from service.store.hits import HitCounts
from service.store.key import BlockKey

if TYPE_CHECKING:
    from service.kv.block import KVBlock

log = logging.getLogger(__name__)

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
        self.retry_interval_s = retry_interval_s
        self.background_fill = background_fill
        self.canonicalize = canonicalize  # applied to compiled blocks (int8 storage: the read-back form)
        self._state = {t.name: BackendHealth(f"store tier {t.name}", retry_interval_s, gauge=True) for t in tiers}
        self._fills: set[asyncio.Task[None]] = set()
        lock_tier = next((t for t in tiers if hasattr(t, "try_lock")), None)  # the Redis tier
        self.compiles = CompileOnce(self, lock_tier, lock_timeout_s, lock_poll_s)
        self.hits = HitCounts()  # blocks get_or_compile served, per key and tier (ephemeral ones not counted)

    # -- tier bookkeeping --

    def available(self, tier: BlockStore) -> bool:
        """The tier is not marked down (or its retry interval has passed)."""
        return self._state[tier.name].available()

    async def call(self, tier: BlockStore, op: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Call one tier: time it, count errors, track up/down."""
        t0 = time.perf_counter()
        try:
            result = await fn(*args)
        except StoreUnavailable as e:
            STORE_ERRORS.labels(tier=tier.name).inc()
            self._state[tier.name].mark_down(e)
            raise
        except StoreWriteError as e:
            STORE_ERRORS.labels(tier=tier.name).inc()
            self._state[tier.name].write_error = str(e)
            self._state[tier.name].mark_up()  # it answered: reachable, only the write was refused
            raise
        finally:
            STORE_OPS.labels(tier=tier.name, op=op).observe(time.perf_counter() - t0)
        self._state[tier.name].mark_up()
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
            if not self.available(tier):
                continue
            try:
                block = await self.call(tier, "get", tier.get, key)
            except StoreError:
                continue
            if block is not None and (accept is None or accept(block)):
                await self.fill(tiers[:i], key, block)
                return block, tier.name
        return None, None

    async def fill(self, tiers: list[BlockStore], key: BlockKey, block: KVBlock) -> None:
        """Read-through: memory synchronously, slower tiers in the background (unless background_fill=False)."""
        for tier in tiers:
            if tier.name != "memory" and self.background_fill:
                task = asyncio.create_task(self._put_quiet(tier, key, block))
                self._fills.add(task)
                task.add_done_callback(self._fills.discard)
            else:
                await self._put_quiet(tier, key, block)

    async def _put_quiet(self, tier: BlockStore, key: BlockKey, block: KVBlock) -> StoreError | None:
        if not self.available(tier):
            return StoreUnavailable(self._state[tier.name].down or "down")
        try:
            await self.call(tier, "put", tier.put, key, block)
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
            if self.available(tier):
                try:
                    if await self.call(tier, "contains", tier.contains, key):
                        return True
                except StoreError:
                    pass
        return False

    async def read_meta(self, key: BlockKey) -> dict[str, str] | None:
        """The block's meta (its calibration, ...) from the first tier holding it, without loading its tensors,
        filling other tiers or touching the memory tier's LRU order; None when no reachable tier holds it."""
        for tier in self.tiers:
            if self.available(tier):
                try:
                    meta = await self.call(tier, "meta", tier.read_meta, key)
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
                found |= bool(await self.call(tier, "delete", tier.delete, key))
            except StoreError as e:
                log.warning("store tier %s: delete %s failed: %s", tier.name, key.to_str(), e)
        return found

    async def delete_namespace_hash(self, namespace: str, content_hash: str) -> int:
        """Delete that content's blocks (any model) everywhere; returns entries removed, summed over tiers."""
        self.hits.forget(namespace, content_hash)
        total = 0
        for tier in self.tiers:
            try:
                total += await self.call(tier, "delete", tier.delete_namespace_hash, namespace, content_hash)
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

    # -- compile once (compile_once.py) --

    async def get_or_compile(self, key: BlockKey, compile_fn: CompileFn,
                             ephemeral: bool = False) -> tuple[KVBlock, str]:
        """The block and where it came from (a tier name or "compiled"), compiling at most once per key
        (CompileOnce.get)."""
        block, source = await self.compiles.get(key, compile_fn, ephemeral)
        if not ephemeral:
            self.hits.add(key, source)
        return block, source

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
                st.mark_up()
                problem = st.write_error or getattr(tier, "last_error", None)
                out[tier.name] = f"degraded: {problem}" if problem else "ok"
            else:
                st.mark_down(StoreUnavailable(st.down or err))
                out[tier.name] = f"down: {st.down}"
        return out

    def status(self) -> dict[str, str]:
        """Last known per-tier state, without touching the backends."""
        return {n: s.status() for n, s in self._state.items()}

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
