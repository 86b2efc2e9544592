"""Skill registry endpoints: register (and compile), list, read, delete."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query, Response

from service.api.auth import RequireAdmin
from service.api.deps import Namespace, Pipeline, State
from service.api.schemas.common import MAX_VERSION, ErrorResponse
from service.api.schemas.skills import SkillCreate, SkillDeleted, SkillList, SkillOut
from service.compose.pipeline import ComposePipeline
from service.registry.skill import SkillRecord

router = APIRouter(prefix="/v1/skills", tags=["skills"])
_ERRORS = {404: {"model": ErrorResponse}, 413: {"model": ErrorResponse}, 422: {"model": ErrorResponse}}
_LIST_CONCURRENCY = 16  # skills described at once by a listing (each: a versions read and a block-header read)


async def _out(pipeline: ComposePipeline, ns: str, rec: SkillRecord) -> SkillOut:
    """The record with what the service knows of its block, the same in the listing and for one skill: `compiled`
    and `calibration` from the stored block's header (no tensors loaded), this process's shadow checks, degraded
    flag and hits."""
    key = pipeline.registry.block_key(ns, rec.default_text)
    meta = await pipeline.store.read_meta(key)
    return SkillOut(**rec.public(), compiled=meta is not None, versions=await pipeline.registry.versions(ns, rec.name),
                    hits=pipeline.store.hits.of(key), **pipeline.guard.report(str(key), meta))


@router.post("", response_model=SkillOut, status_code=201, dependencies=[RequireAdmin],
             responses={**_ERRORS, 200: {"model": SkillOut, "description": "Already registered: the same version"}})
async def register_skill(
    body: SkillCreate, response: Response, state: State, pipeline: Pipeline, ns: Namespace,
    compile: bool = Query(True, description="compile the KV block now (false: on first use)"),
) -> SkillOut:
    """Register a skill. The same text and fields again: 200 with the same version; changed: a new version."""
    rec, created = await pipeline.registry.register(ns, body.name, body.text, body.description, body.fields)
    if compile:
        await pipeline.compile_skill(ns, rec.default_text)
    response.status_code = 201 if created else 200
    return await _out(pipeline, ns, rec)


@router.get("", response_model=SkillList)
async def list_skills(pipeline: Pipeline, ns: Namespace) -> SkillList:
    """The latest version of every skill, with the same block state as GET /v1/skills/{name}."""
    gate = asyncio.Semaphore(_LIST_CONCURRENCY)

    async def one(rec: SkillRecord) -> SkillOut:
        async with gate:
            return await _out(pipeline, ns, rec)

    return SkillList(skills=await asyncio.gather(*(one(r) for r in await pipeline.registry.list(ns))))


@router.get("/{name}", response_model=SkillOut, responses=_ERRORS)
async def get_skill(name: str, pipeline: Pipeline, ns: Namespace,
                    version: int | None = Query(None, ge=1, le=MAX_VERSION)) -> SkillOut:
    return await _out(pipeline, ns, await pipeline.registry.get(ns, name, version))


@router.delete("/{name}", response_model=SkillDeleted, responses=_ERRORS, dependencies=[RequireAdmin])
async def delete_skill(name: str, pipeline: Pipeline, ns: Namespace) -> SkillDeleted:
    """Remove every version of the definition and its blocks in every tier."""
    records = await pipeline.registry.delete(ns, name)
    keys = [pipeline.registry.block_key(ns, rec.default_text) for rec in records]
    await pipeline.guard.forget(keys)  # first: a calibration in flight must not write a block back after this
    for key in keys:
        await pipeline.store.delete_namespace_hash(ns, key.content_hash)
    return SkillDeleted(deleted=name, versions=sorted(r.version for r in records))
