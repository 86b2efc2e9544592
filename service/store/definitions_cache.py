"""CachedDefinitionStore: a read-through cache of skill definitions in front of Redis.

While Redis answers, every call goes to it (so a version added or a skill deleted on another replica is seen
at once) and each definition read refreshes the cache. While Redis is unreachable (StoreUnavailable):
  - reads of a skill this process has read or written before are answered from the cache, so requests that
    use known skills keep working through an outage or a restart of Redis;
  - writes (register, delete), listings and skills never seen here fail with 503 `store_unavailable`:
    nothing is acknowledged that Redis has not stored.
After a failure Redis is skipped for `retry_interval_s`, then probed by one caller at a time, so a
black-holed Redis costs one timeout per interval rather than one per request.
"""

from __future__ import annotations

import builtins

import copy
import logging
from collections import OrderedDict
from typing import Any

from service.store.definitions import DefinitionStore, dump_doc
from service.store.errors import StoreUnavailable
from service.store.health import BackendHealth

log = logging.getLogger(__name__)


class CachedDefinitionStore(DefinitionStore):
    serves_when_down = True  # readiness: known skills are still served while the backend is down

    def __init__(self, inner: DefinitionStore, *, max_bytes: int = 64 * 1024 * 1024,
                 retry_interval_s: float = 2.0) -> None:
        self.inner = inner
        self.name = inner.name
        self.max_bytes = max_bytes
        self._docs: OrderedDict[tuple[str, str], dict[int, tuple[dict[str, Any], int]]] = OrderedDict()
        self._bytes = 0
        self.health = BackendHealth(f"definition store {self.name}", retry_interval_s)

    # -- backend state --

    @property
    def down(self) -> str | None:
        return self.health.down

    @property
    def was_up(self) -> bool:  # reached at least once: a process that never was has nothing cached
        return self.health.was_up

    def _unavailable(self) -> StoreUnavailable:
        return StoreUnavailable(f"definition store {self.name} is unavailable: {self.down or 'down'}")

    async def _call(self, fn, *args):
        """Call the backend unless it is known down (then raise without waiting for a timeout)."""
        if not self.health.available():
            raise self._unavailable()
        try:
            result = await fn(*args)
        except StoreUnavailable as e:
            self.health.mark_down(e, "serving cached definitions")
            raise
        self.health.mark_up()
        return result

    # -- the cache (an LRU over skills, bounded by the JSON size of the docs) --

    def _remember(self, namespace: str, name: str, version: int, doc: dict[str, Any]) -> None:
        size = len(dump_doc(doc))
        versions = self._docs.pop((namespace, name), {})
        old = versions.pop(version, None)
        if old is not None:
            self._bytes -= old[1]
        versions[version] = (copy.deepcopy(doc), size)
        self._bytes += size
        self._docs[(namespace, name)] = versions
        while self._bytes > self.max_bytes and len(self._docs) > 1:
            _, evicted = self._docs.popitem(last=False)
            self._bytes -= sum(s for _, s in evicted.values())

    def _forget(self, namespace: str, name: str, version: int | None = None) -> None:
        versions = self._docs.get((namespace, name))
        if not versions:
            return
        for v in [version] if version is not None else list(versions):
            gone = versions.pop(v, None)
            if gone is not None:
                self._bytes -= gone[1]
        if not versions:
            del self._docs[(namespace, name)]

    def _cached(self, namespace: str, name: str, version: int | None) -> dict[str, Any] | None:
        versions = self._docs.get((namespace, name))
        if not versions:
            return None
        self._docs.move_to_end((namespace, name))
        hit = versions.get(max(versions) if version is None else version)
        return copy.deepcopy(hit[0]) if hit else None

    # -- DefinitionStore --

    async def put(self, namespace: str, name: str, version: int, doc: dict[str, Any]) -> None:
        await self._call(self.inner.put, namespace, name, version, doc)
        self._remember(namespace, name, version, doc)

    async def get(self, namespace: str, name: str, version: int | None = None) -> dict[str, Any] | None:
        try:
            doc = await self._call(self.inner.get, namespace, name, version)
        except StoreUnavailable:
            cached = self._cached(namespace, name, version)
            if cached is None:
                raise self._unavailable() from None
            return cached
        if doc is not None:
            v = version if version is not None else doc.get("version")
            if isinstance(v, int):
                self._remember(namespace, name, v, doc)
        else:
            self._forget(namespace, name, version)  # deleted (by us or another replica) while we cached it
        return doc

    async def list(self, namespace: str) -> list[dict[str, Any]]:
        return await self._call(self.inner.list, namespace)

    async def versions(self, namespace: str, name: str) -> "builtins.list[int]":
        try:
            return await self._call(self.inner.versions, namespace, name)
        except StoreUnavailable:
            versions = self._docs.get((namespace, name))
            if not versions:
                raise self._unavailable() from None
            return sorted(versions)  # the versions this process has seen

    async def delete(self, namespace: str, name: str) -> "builtins.list[dict[str, Any]]":
        docs = await self._call(self.inner.delete, namespace, name)
        self._forget(namespace, name)
        return docs

    async def namespaces(self) -> "builtins.list[str]":
        return await self._call(self.inner.namespaces)

    async def ping(self) -> bool:
        ok = await self.inner.ping()
        if ok:
            self.health.mark_up()
        elif self.down is None:
            self.health.mark_down(StoreUnavailable("ping failed"), "serving cached definitions")
        return ok

    async def close(self) -> None:
        await self.inner.close()
