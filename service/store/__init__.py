"""Block and definition storage: memory / disk / Redis tiers behind one TieredStore."""

from service.store.base import BlockStore
from service.store.definitions import DefinitionStore, DiskDefinitionStore, MemoryDefinitionStore
from service.store.definitions_redis import RedisDefinitionStore
from service.store.disk import DiskBlockStore
from service.store.errors import CorruptBlock, StoreError, StoreUnavailable, StoreWriteError
from service.store.factory import build_store
from service.store.key import BlockKey, check_name
from service.store.memory import MemoryBlockStore
from service.store.redis import RedisBlockStore
from service.store.serde import decode_block, encode_block
from service.store.tiered import TieredStore

__all__ = [
    "BlockKey", "BlockStore", "CorruptBlock", "DefinitionStore", "DiskBlockStore", "DiskDefinitionStore",
    "MemoryBlockStore", "MemoryDefinitionStore", "RedisBlockStore", "RedisDefinitionStore", "StoreError",
    "StoreUnavailable", "StoreWriteError", "TieredStore", "build_store", "check_name", "decode_block",
    "encode_block",
]
