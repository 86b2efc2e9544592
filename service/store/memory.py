"""In-process LRU of KVBlock objects, bounded by tensor bytes."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from service.kv.block import KVBlock
from service.metrics import MEMORY_BYTES, STORE_EVICTIONS
from service.store.base import BlockStore
from service.store.key import BlockKey

log = logging.getLogger(__name__)


class MemoryBlockStore(BlockStore):
    """LRU keyed by BlockKey; holds the KVBlock objects themselves (callers must not mutate them).

    A block larger than `capacity_bytes` is not cached (put is a no-op for it).
    """

    name = "memory"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._items: OrderedDict[BlockKey, KVBlock] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # asyncio code never awaits inside; this covers to_thread callers

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def _remove(self, key: BlockKey) -> bool:
        block = self._items.pop(key, None)
        if block is None:
            return False
        self._bytes -= block.size_bytes
        MEMORY_BYTES.dec(block.size_bytes)
        return True

    async def get(self, key: BlockKey) -> KVBlock | None:
        with self._lock:
            block = self._items.get(key)
            if block is not None:
                self._items.move_to_end(key)
            return block

    async def put(self, key: BlockKey, block: KVBlock) -> None:
        size = block.size_bytes
        with self._lock:
            self._remove(key)
            if size > self.capacity_bytes:
                log.info("memory store: block %s (%d B) exceeds capacity %d B; not cached",
                         key.to_str(), size, self.capacity_bytes)
                return
            while self._items and self._bytes + size > self.capacity_bytes:
                old_key = next(iter(self._items))
                self._remove(old_key)
                STORE_EVICTIONS.labels(tier=self.name).inc()
                log.debug("memory store: evicted %s", old_key.to_str())
            self._items[key] = block
            self._bytes += size
            MEMORY_BYTES.inc(size)

    async def read_meta(self, key: BlockKey) -> dict[str, str] | None:
        with self._lock:
            block = self._items.get(key)  # a peek: the LRU order stays as it is
        return None if block is None else dict(block.meta)

    async def delete(self, key: BlockKey) -> bool:
        with self._lock:
            return self._remove(key)

    async def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._items

    async def delete_namespace_hash(self, namespace: str, content_hash: str) -> int:
        with self._lock:
            doomed = [k for k in self._items if k.namespace == namespace and k.content_hash == content_hash]
            for k in doomed:
                self._remove(k)
            return len(doomed)

    async def close(self) -> None:
        with self._lock:
            for k in list(self._items):
                self._remove(k)
