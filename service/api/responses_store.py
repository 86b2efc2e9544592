"""Stored responses and conversations (the Responses API's `store`, `previous_response_id` and `conversation`;
GET/DELETE /v1/responses/{id}, /v1/conversations): JSON documents per tenant in the registry's definition store
(Redis when configured, else disk), beside skills and saved sessions under namespaces of their own
(`<tenant>.responses`, `<tenant>.conversations`), so any replica can resume them.

A stored response keeps the Response object and the conversation it completed as input items: the stored items it
followed, its input items but system and developer messages (instructions are not carried over, as at OpenAI), its
output items. A conversation keeps its items; every response made with it appends the same. Each kind is bounded
per tenant (SKILLCACHE_RESPONSES_MAX_PER_TENANT: past it the least recently saved goes first) and expires
SKILLCACHE_RESPONSES_TTL_S after its last save: not served past it (the stored time is checked on read) and deleted
by a background sweep on every replica, as saved sessions are (service/sessions/saved.py).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from service.api.responses_items import items_of, new_id, turn_items
from service.api.schemas.responses import ResponsesRequest
from service.errors import ConversationNotFound, ResponseNotFound
from service.sessions.saved import sweep_forever

log = logging.getLogger(__name__)
_ID = re.compile(r"(resp|conv)_[0-9a-f]{32}")  # new_id's: anything else was never stored here


class Documents:
    """One kind of document (each with its `id`) per tenant, bounded and expiring. Which of a tenant's documents is
    the oldest is this process's view: listed from the store on the tenant's first write here, kept on each write,
    and listed again by every sweep, which also applies the bound to what other replicas wrote."""

    def __init__(self, defs: Any, suffix: str, ttl_s: float, max_per_tenant: int,
                 clock: Callable[[], float] = time.time) -> None:
        self.defs, self.suffix, self.ttl_s, self.max, self.clock = defs, suffix, ttl_s, max_per_tenant, clock
        self._order: dict[str, OrderedDict[str, float]] = {}  # tenant -> id -> saved_at, least recent first

    def expired(self, doc: dict, now: float) -> bool:
        return self.ttl_s > 0 and now - doc.get("saved_at", 0.0) > self.ttl_s

    async def get(self, ns: str, doc_id: str) -> dict | None:
        """The document, or None: never stored, deleted, expired (deleted now), or another tenant's."""
        if not _ID.fullmatch(doc_id):
            return None
        doc = await self.defs.get(ns + self.suffix, doc_id)
        if doc is None or not self.expired(doc, self.clock()):
            return doc
        await self.delete(ns, doc_id)
        return None

    async def put(self, ns: str, doc: dict) -> None:
        """Save `doc` (its saved_at set now); past the bound, the tenant's least recently saved are deleted."""
        doc["saved_at"] = self.clock()
        await self.defs.put(ns + self.suffix, doc["id"], 1, doc)
        order = await self._order_of(ns)
        order[doc["id"]] = doc["saved_at"]
        order.move_to_end(doc["id"])
        while len(order) > self.max:
            oldest, _ = order.popitem(last=False)
            await self.defs.delete(ns + self.suffix, oldest)

    async def delete(self, ns: str, doc_id: str) -> bool:
        """False if there was no such document."""
        self._order.get(ns, OrderedDict()).pop(doc_id, None)
        return _ID.fullmatch(doc_id) is not None and bool(await self.defs.delete(ns + self.suffix, doc_id))

    async def _order_of(self, ns: str) -> OrderedDict[str, float]:
        if ns not in self._order:
            docs = await self.defs.list(ns + self.suffix)
            self._order.setdefault(ns, _by_time((d["id"], d.get("saved_at", 0.0)) for d in docs))
        return self._order[ns]

    async def sweep(self, now: float | None = None) -> int:
        """Delete every tenant's expired documents, and the least recently saved past the bound; returns how many.
        Safe on every replica at once (a document deleted twice is deleted once)."""
        started = self.clock()
        now = started if now is None else now
        n = 0
        for doc_ns in await self.defs.namespaces():
            if not doc_ns.endswith(self.suffix):
                continue
            ns = doc_ns[: -len(self.suffix)]
            kept: dict[str, float] = {}
            for doc in await self.defs.list(doc_ns):
                if self.expired(doc, now):
                    await self.defs.delete(doc_ns, doc["id"])
                    n += 1
                else:
                    kept[doc["id"]] = doc.get("saved_at", 0.0)
            written = {i: t for i, t in self._order.get(ns, {}).items() if t >= started}  # here, since it began
            order = _by_time({**kept, **written}.items())
            while len(order) > self.max:
                oldest, _ = order.popitem(last=False)
                await self.defs.delete(doc_ns, oldest)
                n += 1
            self._order[ns] = order
        return n


def _by_time(pairs) -> OrderedDict[str, float]:
    return OrderedDict(sorted(pairs, key=lambda p: p[1]))


@dataclass
class Turn:
    """What a request continues: the stored items that come first in its prompt, and what they come from."""

    prior: list[dict]
    origin: str  # "previous_response_id", "conversation" or "" (their items are named so in errors)
    conversation: str | None  # the conversation's id
    inputs: list[dict]  # this request's input items, as stored


class Stored:
    """The stored responses and conversations of every tenant, and their sweeper."""

    def __init__(self, settings: Any, defs: Any) -> None:
        ttl, cap = settings.responses_ttl_s, settings.responses_max_per_tenant
        self.responses = Documents(defs, ".responses", ttl, cap)
        self.conversations = Documents(defs, ".conversations", ttl, cap)
        self._locks: weakref.WeakValueDictionary[tuple[str, str], asyncio.Lock] = weakref.WeakValueDictionary()
        self._sweeper: asyncio.Task | None = None

    async def begin(self, ns: str, body: ResponsesRequest) -> Turn:
        """The request's Turn; 404 for a previous response or a conversation that is not there."""
        inputs = items_of(body.input)
        if body.previous_response_id is not None:
            doc = await self.responses.get(ns, body.previous_response_id)
            if doc is None:
                raise ResponseNotFound(f"Previous response with id '{body.previous_response_id}' not found.")
            return Turn(doc["items"], "previous_response_id", None, inputs)
        if body.conversation is not None:
            cid = body.conversation if isinstance(body.conversation, str) else body.conversation.id
            return Turn((await self.conversation(ns, cid))["items"], "conversation", cid, inputs)
        return Turn([], "", None, inputs)

    async def keep(self, ns: str, body: ResponsesRequest, turn: Turn, response: dict) -> None:
        """After a response: its items added to its conversation, and (store not false) the response kept."""
        added = turn_items(turn.inputs, response["output"])
        if turn.conversation is not None:
            async with self._lock(ns, turn.conversation):  # appends in order (on this replica)
                conv = await self.conversations.get(ns, turn.conversation)
                if conv is not None:  # else deleted meanwhile: nothing to add to
                    conv["items"] += added
                    await self.conversations.put(ns, conv)
        if body.store is not False:
            await self.responses.put(ns, {"id": response["id"], "response": response,
                                          "items": turn.prior + added, "input_items": turn.inputs})

    async def response(self, ns: str, rid: str) -> dict:
        doc = await self.responses.get(ns, rid)
        if doc is None:
            raise ResponseNotFound(f"Response with id '{rid}' not found.")
        return doc

    async def delete_response(self, ns: str, rid: str) -> dict:
        if not await self.responses.delete(ns, rid):
            raise ResponseNotFound(f"Response with id '{rid}' not found.")
        return {"id": rid, "object": "response", "deleted": True}

    async def create_conversation(self, ns: str, items: list, metadata: dict) -> dict:
        doc = {"id": new_id("conv"), "created_at": int(time.time()), "metadata": metadata, "items": items_of(items)}
        await self.conversations.put(ns, doc)
        return conversation_object(doc)

    async def conversation(self, ns: str, cid: str) -> dict:
        doc = await self.conversations.get(ns, cid)
        if doc is None:
            raise ConversationNotFound(f"Conversation with id '{cid}' not found.")
        return doc

    async def delete_conversation(self, ns: str, cid: str) -> dict:
        async with self._lock(ns, cid):
            if not await self.conversations.delete(ns, cid):
                raise ConversationNotFound(f"Conversation with id '{cid}' not found.")
        return {"id": cid, "object": "conversation.deleted", "deleted": True}

    def _lock(self, ns: str, cid: str) -> asyncio.Lock:
        lock = self._locks.get((ns, cid))
        if lock is None:
            lock = self._locks[(ns, cid)] = asyncio.Lock()
        return lock

    # ---- expiry ------------------------------------------------------------------------------------
    async def sweep(self, now: float | None = None) -> int:
        n = await self.responses.sweep(now) + await self.conversations.sweep(now)
        if n:
            log.info("deleted %d stored responses and conversations (expired, or past the bound)", n)
        return n

    def start_sweeper(self) -> None:
        ttl = self.responses.ttl_s
        self._sweeper = asyncio.create_task(self._sweep_forever(min(max(ttl / 10, 1.0), 600.0) if ttl else 600.0))

    def stop_sweeper(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()

    async def _sweep_forever(self, every_s: float) -> None:
        await sweep_forever(self.sweep, every_s, "sweep of stored responses")


def conversation_object(doc: dict) -> dict:
    return {"id": doc["id"], "object": "conversation", "created_at": doc["created_at"], "metadata": doc["metadata"]}


def page(items: list[dict], order: str = "desc", limit: int = 20, after: str | None = None) -> dict:
    """OpenAI's list object over `items` (oldest first): `order` desc is newest first; `after` an item's id."""
    items = items[::-1] if order == "desc" else list(items)
    if after is not None:
        at = next((i for i, x in enumerate(items) if x.get("id") == after), len(items))
        items = items[at + 1:]
    data = items[:limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(items) > limit}


def get_stored(request: Request) -> Stored:
    return request.app.state.responses_store


StoredDep = Annotated[Stored, Depends(get_stored)]
