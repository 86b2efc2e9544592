"""Fixtures for the store tests: synthetic KV blocks and real redis-server processes."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root, for `tests.redis_server`

from service.kv.block import LAYOUT_VERSION, KVBlock  # noqa: E402,F401
from service.store.key import BlockKey  # noqa: E402
from tests.redis_server import RedisServer, redis_or_skip  # noqa: E402
from tests.store.store_helpers import synthetic_block  # noqa: E402

MakeBlock = Callable[..., KVBlock]
MakeKey = Callable[..., BlockKey]


@pytest.fixture
def make_block() -> MakeBlock:
    return synthetic_block


@pytest.fixture
def make_key() -> MakeKey:
    def make(content_hash: str = "h0", namespace: str = "ns", fingerprint: str = "fp-test") -> BlockKey:
        return BlockKey(model_fingerprint=fingerprint, layout_version=LAYOUT_VERSION, namespace=namespace,
                        content_hash=content_hash)
    return make


@pytest.fixture(scope="session")
def shared_redis() -> Iterator[RedisServer]:
    """One redis-server for the session (flushed before each test through `redis_url`)."""
    redis_or_skip()
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def redis_url(shared_redis: RedisServer) -> str:
    import redis

    with redis.Redis.from_url(shared_redis.url) as r:
        r.flushall()
    return shared_redis.url


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of this test alone (it may stop and restart it)."""
    redis_or_skip()
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def sync_redis(redis_url: str) -> Iterator["object"]:
    """A plain sync client on the shared server, to inspect / tamper with keys."""
    import redis

    with redis.Redis.from_url(redis_url) as r:
        yield r
