"""Saved sessions: the Session record, and its copy in the stores (KV in the block store, the document in the
definition store) so another replica, or this one after a restart, can resume it. Saved copies with no turn
for longer than SKILLCACHE_SESSION_STORE_TTL_S are deleted by a background sweep on every replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from service import metrics
from service.errors import SessionNotFound
from service.kv.layout import LAYOUT_VERSION
from service.store.key import BlockKey

log = logging.getLogger(__name__)
_SUFFIX = ".sessions"  # session documents live beside skill definitions, in their own namespace
_TOMBSTONES = 10_000  # ids of sessions deleted by this process, remembered so that no late save revives them
_ORPHAN_GRACE_S = 300.0  # a local KV copy this recent may belong to a session whose document is being written


@dataclass
class Session:
    id: str
    namespace: str
    skills: list[dict]  # [{"name", "version", "content_hash"}]
    system: str | None
    fields: dict[str, str]  # current values
    messages: list[dict] = field(default_factory=list)  # turns so far (OpenAI-shaped: tool_calls, tool results)
    base_errata: list[str] = field(default_factory=list)  # field values given at creation
    skill_ids: list[list[int]] = field(default_factory=list)  # each skill block's ids, as composed
    tools: list[dict] = field(default_factory=list)  # OpenAI tool objects offered on every turn
    # per skill, the value of each field it declares as the prompt says it: its text, or the last erratum line
    # (skills may declare one field with different defaults)
    skill_fields: list[dict[str, str]] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # tokens held by `cache`
    memory: str | None = None  # a memory floated before each user turn (service/memory/), never held in `cache`
    memory_seam_tokens: int | None = None  # None: SKILLCACHE_MEMORY_SEAM_TOKENS
    mode: str = "compose"  # how the head is prefilled: "compose", or "full"
    seam_tokens: int | None = None  # the head's seams (None: calibrated); on vLLM it may be composed again
    cache: Any = None  # DynamicCache, owned by this session; None until loaded
    created_at: float = field(default_factory=time.time)
    saved_at: float | None = None  # wall clock of the last save (creation or turn): the store's expiry clock
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one turn at a time
    save_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # saves in order, the newest wins
    saves: int = 0

    @classmethod
    def from_doc(cls, doc: dict) -> "Session":
        """A saved document; keys a newer version added are ignored, so replicas of mixed versions (a rolling
        deploy) can still resume each other's sessions."""
        return cls(**{k: v for k, v in doc.items() if k in cls.__dataclass_fields__})

    def doc(self) -> dict:
        keep = ("id", "namespace", "skills", "system", "fields", "messages", "base_errata", "skill_ids",
                "skill_fields", "tools", "ids", "created_at", "saved_at", "memory", "memory_seam_tokens", "mode",
                "seam_tokens")
        return {k: getattr(self, k) for k in keep}

    def public(self) -> dict:
        messages = [{k: m[k] for k in ("role", "content", "tool_calls", "tool_call_id") if k in m}
                    for m in self.messages]
        out = {"id": self.id, "skills": self.skills, "memory": self.memory, "fields": self.fields,
               "messages": messages, "n_tokens": len(self.ids),
               "turns": sum(m["role"] == "assistant" for m in self.messages), "created_at": self.created_at}
        return {**out, "tools": self.tools} if self.tools else out


def valid_id(sid: str) -> bool:
    return sid.startswith("s-") and len(sid) == 26 and all(c in "0123456789abcdef" for c in sid[2:])


class SavedSessions:
    """Save, load, delete and expire the stored copies. `live` is the manager's map of sessions in memory."""

    def __init__(self, pipeline, live: OrderedDict[str, Session]) -> None:
        st = pipeline.settings
        self.p, self.live = pipeline, live
        self.enabled, self.ttl_s = st.session_persist, st.session_store_ttl_s
        self.kv = st.engine == "embedded"  # else the engine keeps the conversation's K/V: the document is the session
        self._bg: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None
        self._deleted: OrderedDict[str, None] = OrderedDict()  # tombstones, oldest first (ids are never reused)

    @property
    def _defs(self):
        return self.p.registry.definitions

    def _key(self, s: Session) -> BlockKey:
        return BlockKey(self.p.rt.fingerprint, LAYOUT_VERSION, s.namespace, s.id)

    def is_deleted(self, sid: str) -> bool:
        """True if this process deleted (or expired) that session: it must not be saved, admitted or resumed."""
        return sid in self._deleted

    def expired(self, doc: dict, now: float) -> bool:
        saved = doc.get("saved_at") or doc.get("created_at") or 0.0
        return self.ttl_s > 0 and now - saved > self.ttl_s

    # ---- save, load, delete --------------------------------------------------------------------
    def save_later(self, s: Session) -> None:
        """Save the session's current state in the background (best effort; the newest state wins)."""
        if not self.enabled or self.is_deleted(s.id):
            return
        from service.kv.block import KVBlock

        s.saved_at = time.time()
        doc = s.doc()
        block = None
        if self.kv:  # copies: the next turn extends the session's cache in place while this save may still be queued
            layers = [(layer.keys.clone(), layer.values.clone()) for layer in s.cache.layers]  # [1, H_kv, T, D]
            block = KVBlock([k for k, _ in layers], [v for _, v in layers], list(s.ids), self.p.rt.fingerprint)
        s.saves += 1
        generation = s.saves

        async def save() -> None:
            async with s.save_lock:
                if generation < s.saves or self.is_deleted(s.id):
                    return  # a newer state is queued behind us, or the session was deleted meanwhile
                try:
                    if block is not None:
                        await self.p.store.put(self._key(s), block)
                    await self._defs.put(s.namespace + _SUFFIX, s.id, 1, doc)  # the document last
                except Exception as e:  # persistence is best effort: the live session keeps working
                    log.warning("session %s not persisted: %s", s.id, e)

        task = asyncio.create_task(save())
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def drain(self) -> None:
        while self._bg:
            await asyncio.gather(*list(self._bg), return_exceptions=True)

    async def load(self, ns: str, sid: str) -> Session:
        """A session this process does not hold: its document and KV from the store."""
        from service.kv.cache import cache_from_block

        doc = await self._defs.get(ns + _SUFFIX, sid) if valid_id(sid) and not self.is_deleted(sid) else None
        if doc is None:
            raise SessionNotFound(f"session {sid!r} not found (it may have expired)")
        s = Session.from_doc(doc)
        if self.expired(doc, time.time()):
            await self.delete(s)
            raise SessionNotFound(f"session {sid!r} expired: no turn for over {self.ttl_s:g} s "
                                  "(SKILLCACHE_SESSION_STORE_TTL_S); start a new one")
        if not self.kv:
            return s
        # a replica that served earlier turns may hold an older copy in its memory or disk tier: only the KV of
        # exactly these tokens will do (the newest is in the shared tier)
        block, _ = await self.p.store.get(self._key(s), accept=lambda b: b.token_ids == s.ids)
        if self.is_deleted(sid):  # deleted while we read it
            raise SessionNotFound(f"session {sid!r} not found")
        if block is None or block.token_ids != s.ids:
            raise SessionNotFound(f"session {sid!r} lost its cache (expired from the store); start a new one")
        s.cache = cache_from_block(self.p.rt.model.config, block)
        return s

    async def delete(self, s: Session) -> None:
        """The document first (a resume then finds nothing), then the KV. Marks the session deleted first, so
        that saves queued for it are skipped, and waits for a save in progress (save_lock): none can write the
        document or the KV again after this returns."""
        self._deleted[s.id] = None
        while len(self._deleted) > _TOMBSTONES:
            self._deleted.popitem(last=False)
        async with s.save_lock:
            await self._defs.delete(s.namespace + _SUFFIX, s.id)
            await self.p.store.delete(self._key(s))

    # ---- expiry ----------------------------------------------------------------------------------
    async def sweep(self, now: float | None = None) -> int:
        """Delete the saved sessions with no turn for longer than the TTL, in every namespace; returns how
        many. Safe on every replica at once: a session in use is saved on every turn, so it is never stale."""
        if not self.enabled or self.ttl_s <= 0:
            return 0
        now = time.time() if now is None else now
        n = 0
        kept: set[tuple[str, str]] = set()  # (namespace, id) of the documents still there
        for doc_ns in await self._defs.namespaces():
            if not doc_ns.endswith(_SUFFIX):
                continue
            for doc in await self._defs.list(doc_ns):
                live = self.live.get(doc["id"])
                if live is not None and (live.lock.locked() or not self.expired(live.doc(), now)):
                    kept.add((doc_ns[: -len(_SUFFIX)], doc["id"]))
                    continue  # in use here, or saved since this listing was read
                if self.expired(doc, now):
                    self.live.pop(doc["id"], None)
                    await self.delete(live or Session.from_doc(doc))
                    n += 1
                else:
                    kept.add((doc_ns[: -len(_SUFFIX)], doc["id"]))
        if n:
            metrics.SESSIONS_EXPIRED.inc(n)
            log.info("deleted %d saved sessions with no turn for over %g s", n, self.ttl_s)
        await self._sweep_orphans(kept, now)
        return n

    async def _sweep_orphans(self, kept: set[tuple[str, str]], now: float) -> int:
        """Delete this replica's disk-tier copies of session KV whose document is gone: with a shared store
        (Redis) another replica deleted or expired the session, and only cleaned its own tiers and Redis.
        Copies written in the last _ORPHAN_GRACE_S are left alone (a save writes the KV before the document),
        as are sessions this process holds; each candidate's document is looked up once more before."""
        n = 0
        for key, mtime in await self.p.store.disk_keys("s-"):
            sid = key.content_hash
            if (key.namespace, sid) in kept or sid in self.live or not valid_id(sid) or now - mtime < _ORPHAN_GRACE_S:
                continue
            if await self._defs.get(key.namespace + _SUFFIX, sid) is not None:
                continue  # saved since the listing
            await self.p.store.delete(key)
            n += 1
        if n:
            log.info("deleted %d local copies of session KV whose session is gone", n)
        return n

    def start_sweeper(self) -> None:
        if self.enabled and self.ttl_s > 0:
            self._sweeper = asyncio.create_task(self._sweep_forever(min(max(self.ttl_s / 10, 1.0), 600.0)))

    def stop_sweeper(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def _sweep_forever(self, every_s: float) -> None:
        await sweep_forever(self.sweep, every_s, "session sweep")


async def sweep_forever(sweep, every_s: float, what: str) -> None:
    """`sweep()` every `every_s` seconds until cancelled; a failure (a store outage) is logged and tried next time.
    Saved sessions and stored responses (service/api/responses_store.py) expire this way."""
    while True:
        await asyncio.sleep(every_s)
        try:
            await sweep()
        except Exception as e:
            log.warning("%s failed: %s", what, e)
