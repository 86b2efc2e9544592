"""User memories: create, read, replace, edit facts one by one, delete. Per tenant; any role may use its own."""

from __future__ import annotations

import time

from fastapi import APIRouter, Query, Response

from service.api.deps import Memories, Namespace
from service.api.schemas.common import ErrorResponse
from service.api.schemas.memories import (MemoryCreate, MemoryEdited, MemoryList, MemoryOut, MemoryPatch, MemoryReplace,
                                          MemorySummary)
from service.memory.edits import FactEdit

router = APIRouter(prefix="/v1/memories", tags=["memories"])
_ERRORS = {c: {"model": ErrorResponse} for c in (404, 409, 413, 422, 503)}
_COMPILE = Query(True, description="compile the blocks now (false: on the first turn that uses them)")


@router.post("", response_model=MemoryOut, status_code=201, responses={
    **_ERRORS, 200: {"model": MemoryOut, "description": "Exists with the same text: unchanged"}})
async def create_memory(body: MemoryCreate, response: Response, memories: Memories, ns: Namespace,
                        compile: bool = _COMPILE) -> dict:
    """Create a memory. The same text again: 200 and the memory as it is; other text: 409 (PUT replaces)."""
    rec, created = await memories.create(ns, body.name, body.text, body.max_block_tokens, compile)
    response.status_code = 201 if created else 200
    return rec.public()


@router.get("", response_model=MemoryList)
async def list_memories(memories: Memories, ns: Namespace) -> MemoryList:
    recs = sorted(await memories.list(ns), key=lambda r: r.name)
    return MemoryList(memories=[MemorySummary(name=r.name, revision=r.revision, n_tokens=r.n_tokens,
                                              n_blocks=len(r.blocks), updated_at=r.updated_at) for r in recs])


@router.get("/{name}", response_model=MemoryOut, responses=_ERRORS)
async def get_memory(name: str, memories: Memories, ns: Namespace) -> dict:
    return (await memories.get(ns, name)).public()


@router.put("/{name}", response_model=MemoryOut, responses={
    **_ERRORS, 201: {"model": MemoryOut, "description": "Created"}})
async def replace_memory(name: str, body: MemoryReplace, response: Response, memories: Memories, ns: Namespace,
                         compile: bool = _COMPILE) -> dict:
    """Replace the whole text (the next revision; blocks whose text is unchanged are not compiled again)."""
    rec, created = await memories.replace(ns, name, body.text, body.max_block_tokens, compile)
    response.status_code = 201 if created else 200
    return rec.public()


@router.patch("/{name}", response_model=MemoryEdited, responses=_ERRORS)
async def edit_memory(name: str, body: MemoryPatch, memories: Memories, ns: Namespace,
                      compile: bool = _COMPILE) -> dict:
    """Set facts' values, each by its own mode; `edits` says what was done to which block."""
    t0 = time.perf_counter()
    rec, reports = await memories.edit(ns, name, [FactEdit(e.label, e.value, e.mode) for e in body.edits], compile)
    return {**rec.public(), "edits": reports, "timings": {"edit_ms": round((time.perf_counter() - t0) * 1e3, 2)}}


@router.delete("/{name}", responses=_ERRORS)
async def delete_memory(name: str, memories: Memories, ns: Namespace) -> dict:
    await memories.delete(ns, name)
    return {"deleted": name}
