"""OpenAI's Conversations API, as far as the Responses API's `conversation` needs it: create (with first items and
metadata), read, delete, list the items (service/api/responses_store.py keeps them)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Query

from service.api.deps import Namespace
from service.api.responses_store import StoredDep, conversation_object, page
from service.api.schemas.common import ErrorResponse
from service.api.schemas.responses import ConversationCreate

router = APIRouter(prefix="/v1/conversations", tags=["openai"])
# 413: a body past SKILLCACHE_MAX_BODY_BYTES (the body limit answers before the route)
_ERRORS: dict[int | str, dict[str, Any]] = {c: {"model": ErrorResponse} for c in (404, 413, 422, 503)}


@router.post("", responses=_ERRORS)
async def create_conversation(body: ConversationCreate, stored: StoredDep, ns: Namespace) -> dict:
    return await stored.create_conversation(ns, body.items or [], body.metadata or {})


@router.get("/{cid}", responses=_ERRORS)
async def get_conversation(cid: str, stored: StoredDep, ns: Namespace) -> dict:
    return conversation_object(await stored.conversation(ns, cid))


@router.delete("/{cid}", responses=_ERRORS)
async def delete_conversation(cid: str, stored: StoredDep, ns: Namespace) -> dict:
    return await stored.delete_conversation(ns, cid)


@router.get("/{cid}/items", responses=_ERRORS)
async def list_items(cid: str, stored: StoredDep, ns: Namespace, order: Literal["asc", "desc"] = "desc",
                     limit: int = Query(20, ge=1, le=100), after: str | None = None) -> dict:
    return page((await stored.conversation(ns, cid))["items"], order, limit, after)
