"""Compile once: concurrent callers in this process share one compile of a key (callers that joined it also get
"compiled"); with a Redis tier, replicas share one compile through a Redis lock. Cancelling a caller does not cancel
the shared compile. An ephemeral block (a recompile edit's variant, a request's tools block) is compiled for the
memory tier only, where LRU eviction bounds it: nothing would ever clean it up on disk or in Redis."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from service.metrics import COMPILES
from service.store.base import BlockStore
from service.store.errors import StoreError
from service.store.key import BlockKey

if TYPE_CHECKING:
    from service.kv.block import KVBlock

log = logging.getLogger(__name__)

CompileFn = Callable[[], Awaitable["KVBlock"]]


class Tiers(Protocol):
    """What single flight needs of the store (service/store/tiered.py, TieredStore): its tiers, reads and writes
    across them, and calls to one tier with its health tracked."""

    tiers: list[BlockStore]
    canonicalize: Callable[["KVBlock"], "KVBlock"] | None

    def available(self, tier: BlockStore) -> bool: ...

    async def call(self, tier: BlockStore, op: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any: ...

    async def fill(self, tiers: list[BlockStore], key: BlockKey, block: "KVBlock") -> None: ...

    async def get(self, key: BlockKey, ephemeral: bool = False) -> tuple["KVBlock | None", str | None]: ...

    async def put(self, key: BlockKey, block: "KVBlock", ephemeral: bool = False) -> list[str]: ...


class CompileOnce:
    def __init__(self, store: Tiers, lock: BlockStore | None, lock_timeout_s: float,
                 lock_poll_s: float) -> None:
        self.store = store  # its tiers: read before compiling, written after
        self.lock = lock  # the tier that holds compile locks (Redis), or None
        self.lock_timeout_s, self.lock_poll_s = lock_timeout_s, lock_poll_s
        self.inflight: dict[BlockKey, asyncio.Task[tuple[KVBlock, str]]] = {}

    async def get(self, key: BlockKey, compile_fn: CompileFn, ephemeral: bool = False) -> tuple["KVBlock", str]:
        """The block and where it came from (a tier name or "compiled"), compiling at most once per key."""
        block, source = await self.store.get(key, ephemeral)
        if block is None:
            task = self.inflight.get(key)
            if task is None:
                task = asyncio.create_task(self._produce(key, compile_fn, ephemeral))
                self.inflight[key] = task
                task.add_done_callback(lambda t: self._task_done(key, t))
            block, source = await asyncio.shield(task)
        return block, source  # type: ignore[return-value]

    def _task_done(self, key: BlockKey, task: asyncio.Task[Any]) -> None:
        if self.inflight.get(key) is task:
            del self.inflight[key]
        if not task.cancelled():
            task.exception()  # mark retrieved: callers that went away must not cause a warning

    async def _produce(self, key: BlockKey, compile_fn: CompileFn, ephemeral: bool) -> tuple["KVBlock", str]:
        block, source = await self.store.get(key, ephemeral)  # a compile for this key may have finished since our miss
        if block is not None:
            return block, source  # type: ignore[return-value]
        if ephemeral:
            return await self._compile(key, compile_fn, ephemeral=True)
        lock, store = self.lock, self.store
        if lock is None or not store.available(lock):
            return await self._compile(key, compile_fn)
        token = secrets.token_hex(16)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lock_timeout_s
        while True:
            try:
                acquired = await store.call(lock, "lock", lock.try_lock, key, token, self.lock_timeout_s)
            except StoreError:
                return await self._compile(key, compile_fn)
            if acquired:
                try:
                    try:
                        block = await self._lock_tier_get(key)  # the previous holder may have just finished
                    except StoreError:
                        block = None
                    if block is not None:
                        return await self._from_lock_tier(key, block)
                    return await self._compile(key, compile_fn)
                finally:
                    try:
                        await store.call(lock, "unlock", lock.unlock, key, token)
                    except StoreError as e:
                        log.warning("could not release compile lock for %s (expires by itself): %s", key, e)
            delay = self.lock_poll_s
            while loop.time() < deadline:
                await asyncio.sleep(delay)
                delay = min(delay * 1.5, 0.5)
                try:
                    block = await self._lock_tier_get(key)
                    if block is not None:
                        return await self._from_lock_tier(key, block)
                    if not await store.call(lock, "lock", lock.lock_held, key):
                        break  # the holder gave up without storing a block: try to take the lock
                except StoreError:
                    return await self._compile(key, compile_fn)
            else:
                log.warning("compile lock for %s still held after %.1fs; compiling locally", key, self.lock_timeout_s)
                return await self._compile(key, compile_fn)

    async def _lock_tier_get(self, key: BlockKey) -> "KVBlock | None":
        return await self.store.call(self.lock, "get", self.lock.get, key)

    async def _from_lock_tier(self, key: BlockKey, block: "KVBlock") -> tuple["KVBlock", str]:
        """Another replica compiled it: fill the other tiers, report where it came from."""
        await self.store.fill([t for t in self.store.tiers if t is not self.lock], key, block)
        return block, self.lock.name

    async def _compile(self, key: BlockKey, compile_fn: CompileFn, ephemeral: bool = False) -> tuple["KVBlock", str]:
        block = await compile_fn()
        COMPILES.inc()
        if self.store.canonicalize is not None:
            block = await asyncio.to_thread(self.store.canonicalize, block)
        try:
            failed = await self.store.put(key, block, ephemeral)
            if failed:
                log.warning("compiled block %s not stored in %s", key, failed)
        except StoreError as e:
            log.error("compiled block %s could not be stored anywhere: %s", key, e)
        return block, "compiled"
