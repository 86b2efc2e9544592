"""BlockStore: the async interface every block tier implements."""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence

from service.kv.block import KVBlock
from service.metrics import STORE_CORRUPT
from service.store.errors import CorruptBlock, StaleBlock
from service.store.key import BlockKey

log = logging.getLogger(__name__)


class BlockStore(abc.ABC):
    """One tier. A miss returns None; a corrupt entry is logged, counted, deleted and reported as a miss.

    Backend failures raise StoreUnavailable (cannot reach) or StoreWriteError (write refused).
    """

    name: str = "abstract"  # "memory" | "disk" | "redis"

    @abc.abstractmethod
    async def get(self, key: BlockKey) -> KVBlock | None:
        """The block stored under `key`, or None."""

    @abc.abstractmethod
    async def put(self, key: BlockKey, block: KVBlock) -> None:
        """Store `block` under `key` (replacing any previous one)."""

    @abc.abstractmethod
    async def delete(self, key: BlockKey) -> bool:
        """Remove `key`; True if something was removed."""

    @abc.abstractmethod
    async def contains(self, key: BlockKey) -> bool:
        """True if an entry exists (cheap; does not verify it)."""

    @abc.abstractmethod
    async def delete_namespace_hash(self, namespace: str, content_hash: str) -> int:
        """Delete the blocks of this content in this namespace for every model fingerprint and layout."""

    async def read_meta(self, key: BlockKey) -> dict[str, str] | None:
        """The stored block's `meta` (its calibration, ...) or None when absent. Tiers that can, read only the
        payload's header (not verified); this default reads the whole block."""
        block = await self.get(key)
        return None if block is None else dict(block.meta)

    async def get_many(self, keys: Sequence[BlockKey]) -> list[KVBlock | None]:
        """get() for each key, in order."""
        return [await self.get(k) for k in keys]

    async def ping(self) -> bool:
        """True if the backend is usable."""
        return True

    async def close(self) -> None:
        """Release connections / handles."""

    def _corrupt(self, key: BlockKey, err: CorruptBlock) -> None:
        """Log and count a corrupt entry (the caller deletes it). A stale one is only logged."""
        if isinstance(err, StaleBlock):
            log.info("store %s: dropping block %s of an older format: %s", self.name, key.to_str(), err)
            return
        STORE_CORRUPT.labels(tier=self.name, reason=err.reason).inc()
        log.warning("store %s: dropping corrupt block %s: %s", self.name, key.to_str(), err)
