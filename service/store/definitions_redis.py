"""RedisDefinitionStore: skill definitions in Redis (a hash of versions per skill + a set of names)."""

from __future__ import annotations

import builtins

import json
import logging
from contextlib import AbstractAsyncContextManager
from typing import Any

from redis.exceptions import WatchError

from service.metrics import STORE_CORRUPT
from service.store.definitions import DefinitionStore, check_version, dump_doc
from service.store.errors import StoreUnavailable
from service.store.key import check_name
from service.store.redisconn import guard, make_client, redacted

log = logging.getLogger(__name__)


class RedisDefinitionStore(DefinitionStore):
    """Keys `<prefix>:def:{<ns>}:names` (set) and `<prefix>:def:{<ns>}:skill:<name>` (hash version -> JSON).

    Both keys of a namespace share a hash tag, so MULTI/EXEC works on Redis Cluster too. Durability
    is Redis's: run it with appendonly yes (or RDB snapshots you accept losing the tail of).
    """

    name = "redis"

    def __init__(self, url: str, prefix: str = "skillcache", *, connect_timeout_s: float = 2.0,
                 op_timeout_s: float = 5.0) -> None:
        self.where = redacted(url)
        self.prefix = check_name(prefix, "prefix")
        self._r = make_client(url, connect_timeout_s=connect_timeout_s, op_timeout_s=op_timeout_s,
                              decode_responses=True)

    def _names_key(self, namespace: str) -> str:
        return f"{self.prefix}:def:{{{check_name(namespace, 'namespace')}}}:names"

    def _skill_key(self, namespace: str, name: str) -> str:
        return f"{self.prefix}:def:{{{check_name(namespace, 'namespace')}}}:skill:{check_name(name, 'name')}"

    def _guard(self, write: bool = False) -> AbstractAsyncContextManager[None]:
        return guard(self.where, "redis_definitions", write=write)

    @staticmethod
    def _parse(raw: str | None, where: str) -> dict[str, Any] | None:
        """The doc, or None when it is not a JSON object. Our writes are whole JSON objects, so anything
        else is damage or a hand edit: logged, counted and skipped, like the disk store does."""
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
        except ValueError as e:
            doc, why = None, f"not valid JSON: {e}"
        else:
            why = "not a JSON object"
        if isinstance(doc, dict):
            return doc
        STORE_CORRUPT.labels(tier="definitions", reason="format").inc()
        log.error("definition %s is %s, ignoring it", where, why)
        return None

    def _latest(self, skill: str, versions: dict[str, str]) -> dict[str, Any] | None:
        """The newest version that parses (an older one stands in for a damaged latest, as on disk)."""
        for v in sorted(versions, key=int, reverse=True):
            if (doc := self._parse(versions[v], f"{skill} version {v}")) is not None:
                return doc
        return None

    async def put(self, namespace: str, name: str, version: int, doc: dict[str, Any]) -> None:
        data, skill, names = dump_doc(doc), self._skill_key(namespace, name), self._names_key(namespace)
        async with self._guard(write=True):
            pipe = self._r.pipeline(transaction=True)  # MULTI ... EXEC
            pipe.hset(skill, str(check_version(version)), data)
            pipe.sadd(names, name)
            await pipe.execute()

    async def get(self, namespace: str, name: str, version: int | None = None) -> dict[str, Any] | None:
        skill = self._skill_key(namespace, name)
        async with self._guard():
            if version is None:
                return self._latest(skill, await self._r.hgetall(skill))
            raw = await self._r.hget(skill, str(check_version(version)))
        return self._parse(raw, f"{skill} version {version}")

    async def list(self, namespace: str) -> list[dict[str, Any]]:
        names_key = self._names_key(namespace)
        async with self._guard():
            names = sorted(await self._r.smembers(names_key))
            pipe = self._r.pipeline(transaction=False)
            for n in names:
                pipe.hgetall(self._skill_key(namespace, n))
            results = await pipe.execute() if names else []
        skills = [self._skill_key(namespace, n) for n in names]
        return [doc for skill, r in zip(skills, results) if (doc := self._latest(skill, r)) is not None]

    async def versions(self, namespace: str, name: str) -> "builtins.list[int]":
        async with self._guard():
            return sorted(int(v) for v in await self._r.hkeys(self._skill_key(namespace, name)))

    async def delete(self, namespace: str, name: str) -> "builtins.list[dict[str, Any]]":
        skill, names = self._skill_key(namespace, name), self._names_key(namespace)
        async with self._guard(write=True):
            async with self._r.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(skill)  # a concurrent put of a new version restarts the delete
                        versions = await pipe.hgetall(skill)
                        pipe.multi()
                        pipe.delete(skill)
                        pipe.srem(names, name)
                        await pipe.execute()
                        break
                    except WatchError:
                        continue
        docs = (self._parse(versions[v], f"{skill} version {v}") for v in sorted(versions, key=int))
        return [doc for doc in docs if doc is not None]

    async def namespaces(self) -> "builtins.list[str]":
        head, tail = f"{self.prefix}:def:{{", "}:names"  # SCAN: O(keys) per call; for background sweeps only
        async with self._guard():
            keys = [k async for k in self._r.scan_iter(match=f"{head}*{tail}", count=1000)]
        return sorted({k[len(head):-len(tail)] for k in keys})

    async def ping(self) -> bool:
        try:
            async with self._guard():
                await self._r.ping()
            return True
        except StoreUnavailable:
            return False

    async def close(self) -> None:
        await self._r.aclose()
