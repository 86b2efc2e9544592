"""Redis client construction and redis-py exception -> StoreError mapping, shared by the Redis stores."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from service.metrics import STORE_UP
from service.store.errors import StoreUnavailable, StoreWriteError


def redacted(url: str) -> str:
    """host:port/db of a Redis URL, without credentials (for logs and error messages)."""
    u = urlsplit(url)
    return f"{u.scheme}://{u.hostname or ''}{':' + str(u.port) if u.port else ''}{u.path or ''}"


def make_client(url: str, *, connect_timeout_s: float = 2.0, op_timeout_s: float = 5.0,
                retries: int = 1, decode_responses: bool = False) -> aioredis.Redis:
    """A client with short timeouts and few retries, so a dead Redis fails fast instead of hanging.

    One retry is kept so a pooled connection broken by a server restart is replaced transparently.
    """
    return aioredis.Redis.from_url(
        url,
        decode_responses=decode_responses,
        socket_connect_timeout=connect_timeout_s,
        socket_timeout=op_timeout_s,
        retry=Retry(ExponentialWithJitterBackoff(cap=0.25, base=0.01), retries),
        health_check_interval=30,
    )


@contextlib.asynccontextmanager
async def guard(where: str, tier: str, *, write: bool = False) -> AsyncIterator[None]:
    """Map redis-py errors: unreachable -> StoreUnavailable, refused write -> StoreWriteError.

    Sets STORE_UP{tier} from the outcome.
    """
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, OSError) as e:
        STORE_UP.labels(tier=tier).set(0)
        raise StoreUnavailable(f"redis at {where} unreachable: {type(e).__name__}: {e}") from e
    except RedisError as e:
        if write:
            raise StoreWriteError(
                f"redis at {where} refused the write: {e} "
                "(check maxmemory / maxmemory-policy, that this is not a read-only replica, and ACLs)"
            ) from e
        raise StoreUnavailable(f"redis at {where} error: {type(e).__name__}: {e}") from e
    else:
        STORE_UP.labels(tier=tier).set(1)
