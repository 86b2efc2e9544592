"""Blocks served per key and tier by this process: the per-skill view of `skillcache_skill_hits_total`.

TieredStore.get_or_compile, the one way a skill's block is obtained for a request (compose, chat, a new session,
a registration or the start-up preload), counts each block it hands out under the tier it came from, or
"compiled". The listing (`GET /v1/skills`) reports them per skill. Counts live in this process only: they start
at zero with it and are not shared between replicas, like the metric.
"""

from __future__ import annotations

import threading
from collections import Counter

from service.store.key import BlockKey


class HitCounts:
    def __init__(self) -> None:
        self._by_key: dict[BlockKey, Counter[str]] = {}
        self._lock = threading.Lock()

    def add(self, key: BlockKey, source: str) -> None:
        with self._lock:
            self._by_key.setdefault(key, Counter())[source] += 1

    def of(self, key: BlockKey) -> dict[str, int]:
        """{tier or "compiled": blocks served}; empty when this process never served the key."""
        with self._lock:
            return dict(self._by_key.get(key, ()))

    def forget(self, namespace: str, content_hash: str) -> None:
        """The blocks of that content were deleted (every model): their counts go with them."""
        with self._lock:
            for key in [k for k in self._by_key if k.namespace == namespace and k.content_hash == content_hash]:
                del self._by_key[key]
