"""Skill registry endpoints: register (and compile), list, read, delete."""

from __future__ import annotations

from fastapi import APIRouter, Query, Response

from service.api.auth import RequireAdmin
from service.api.deps import Namespace, Pipeline, State
from service.api.schemas import MAX_VERSION, ErrorResponse, SkillCreate, SkillDeleted, SkillList, SkillOut
from service.registry.skill import SkillRecord

router = APIRouter(prefix="/v1/skills", tags=["skills"])
_ERRORS = {404: {"model": ErrorResponse}, 413: {"model": ErrorResponse}, 422: {"model": ErrorResponse}}


def _out(rec: SkillRecord, compiled: bool = False, versions: list[int] | None = None) -> SkillOut:
    return SkillOut(**rec.public(), compiled=compiled, versions=versions or [rec.version])


@router.post("", response_model=SkillOut, status_code=201, dependencies=[RequireAdmin],
             responses={**_ERRORS, 200: {"model": SkillOut, "description": "Already registered: the same version"}})
async def register_skill(
    body: SkillCreate, response: Response, state: State, pipeline: Pipeline, ns: Namespace,
    compile: bool = Query(True, description="compile the KV block now (false: on first use)"),
) -> SkillOut:
    """Register a skill. The same text and fields again: 200 with the same version; changed: a new version."""
    rec, created = await pipeline.registry.register(ns, body.name, body.text, body.description, body.fields)
    if compile:
        await pipeline.block_for(ns, rec.default_text)
    compiled = compile or await pipeline.store.contains(pipeline.registry.block_key(ns, rec.default_text))
    response.status_code = 201 if created else 200
    return _out(rec, compiled=compiled, versions=await pipeline.registry.versions(ns, rec.name))


@router.get("", response_model=SkillList)
async def list_skills(pipeline: Pipeline, ns: Namespace) -> SkillList:
    return SkillList(skills=[_out(r) for r in await pipeline.registry.list(ns)])


@router.get("/{name}", response_model=SkillOut, responses=_ERRORS)
async def get_skill(name: str, pipeline: Pipeline, ns: Namespace,
                    version: int | None = Query(None, ge=1, le=MAX_VERSION)) -> SkillOut:
    rec = await pipeline.registry.get(ns, name, version)
    key = pipeline.registry.block_key(ns, rec.default_text)
    block, _ = await pipeline.store.get(key)
    out = _out(rec, compiled=block is not None, versions=await pipeline.registry.versions(ns, name))
    return out.model_copy(update=pipeline.guard.report(str(key), block))


@router.delete("/{name}", response_model=SkillDeleted, responses=_ERRORS, dependencies=[RequireAdmin])
async def delete_skill(name: str, pipeline: Pipeline, ns: Namespace) -> SkillDeleted:
    """Remove every version of the definition and its blocks in every tier."""
    records = await pipeline.registry.delete(ns, name)
    keys = [pipeline.registry.block_key(ns, rec.default_text) for rec in records]
    await pipeline.guard.forget(keys)  # first: a calibration in flight must not write a block back after this
    for key in keys:
        await pipeline.store.delete_namespace_hash(ns, key.content_hash)
    return SkillDeleted(deleted=name, versions=sorted(r.version for r in records))
