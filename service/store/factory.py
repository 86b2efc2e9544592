"""build_store: the block tiers and the definition store that settings.store asks for."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from service.config import Settings
from service.store.definitions import DefinitionStore, DiskDefinitionStore, MemoryDefinitionStore
from service.store.definitions_cache import CachedDefinitionStore
from service.store.definitions_redis import RedisDefinitionStore

if TYPE_CHECKING:
    from service.store.base import BlockStore
    from service.store.tiered import TieredStore

log = logging.getLogger(__name__)


def build_store(settings: Settings, *, redis_connect_timeout_s: float = 2.0, redis_op_timeout_s: float = 5.0,
                retry_interval_s: float = 2.0) -> tuple["TieredStore", DefinitionStore]:
    """memory: memory tier + in-memory definitions (tests).
    disk (default): memory + disk (<store_dir>/blocks); definitions on disk (<store_dir>/skills).
    redis: memory + disk + redis; definitions in Redis.
    Nothing connects here: Redis is reached on first use, so a down Redis does not block startup.
    """
    # the block tiers hold tensors (torch): imported when a store is built, not with this module (the API imports it)
    from service.kv.quant import roundtrip_block
    from service.store.disk import DiskBlockStore
    from service.store.memory import MemoryBlockStore
    from service.store.redis import RedisBlockStore
    from service.store.tiered import TieredStore

    tiers: list[BlockStore] = [MemoryBlockStore(settings.memory_cache_bytes)]
    definitions: DefinitionStore
    if settings.store == "memory":
        definitions = MemoryDefinitionStore()
    else:
        tiers.append(DiskBlockStore(settings.store_dir / "blocks", compression=settings.kv_compression,
                                   max_bytes=settings.disk_cache_bytes))
        if settings.store == "redis":
            tiers.append(RedisBlockStore(
                settings.redis_url, chunk_bytes=settings.redis_chunk_bytes, ttl_s=settings.redis_ttl_s,
                connect_timeout_s=redis_connect_timeout_s, op_timeout_s=redis_op_timeout_s,
                compression=settings.kv_compression,
            ))
            # read-through cache: known skills keep composing while Redis is down (definitions_cache.py)
            definitions = CachedDefinitionStore(RedisDefinitionStore(
                settings.redis_url, connect_timeout_s=redis_connect_timeout_s, op_timeout_s=redis_op_timeout_s,
            ), retry_interval_s=retry_interval_s)
        else:
            definitions = DiskDefinitionStore(settings.store_dir / "skills")
    # with int8 storage, a freshly compiled block is served and cached in memory as it will read back
    # from disk/Redis (dequantized), so a request's result does not depend on which tier answered
    canonicalize = roundtrip_block if settings.kv_compression == "int8" and len(tiers) > 1 else None
    store = TieredStore(tiers, lock_timeout_s=settings.compile_lock_timeout_s, retry_interval_s=retry_interval_s,
                        canonicalize=canonicalize)
    log.info("store: tiers %s, definitions in %s", [t.name for t in tiers], definitions.name)
    return store, definitions
