"""Sessions: create with skills and fields, run turns (only new tokens are prefilled), read, delete."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter
from pydantic import Field, StringConstraints

from service.api.deps import Namespace, Sessions
from service.api.routes.compose import gen_params, respond
from service.api.schemas import (ErrorResponse, GenerationIn, MemoryName, MemorySeam, SeamTokens, SkillName,
                                 SkillRefIn, Strict, Text)
from service.api.sse import SSE_200
from service.compose.pipeline import SkillRef

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])
_ERRORS = {c: {"model": ErrorResponse} for c in (404, 409, 413, 422, 429, 503)}
FieldValues = dict[str, Annotated[str, StringConstraints(max_length=1024)]]


class SessionCreate(Strict):
    skills: list[SkillName | SkillRefIn] = Field(default_factory=list, max_length=256)
    system: Text | None = None
    fields: FieldValues | None = Field(None, max_length=256)
    mode: Literal["compose", "full"] = "compose"
    seam_tokens: SeamTokens = None
    memory: MemoryName | None = None  # floated before every user turn (service/memory/)
    memory_seam_tokens: MemorySeam = None


class TurnRequest(GenerationIn):
    user: Text = Field(min_length=1)
    fields: FieldValues | None = Field(None, max_length=256)
    logprobs: int | None = Field(None, ge=1, le=20)


@router.post("", status_code=201, responses=_ERRORS)
async def create_session(body: SessionCreate, sessions: Sessions, ns: Namespace) -> dict:
    refs = [SkillRef(s.name, s.version) if isinstance(s, SkillRefIn) else SkillRef(s) for s in body.skills]
    s, usage = await sessions.create(ns, refs, body.system, dict(body.fields or {}), body.mode,
                                      None if body.seam_tokens == "auto" else body.seam_tokens, body.memory,
                                      body.memory_seam_tokens)
    return {**s.public(), "usage": usage}


@router.post("/{sid}/turns", responses={**_ERRORS, **SSE_200})
async def run_turn(sid: str, body: TurnRequest, sessions: Sessions, ns: Namespace):
    events = await sessions.turn(ns, sid, body.user, dict(body.fields or {}), gen_params(body, body.logprobs))
    return await respond(events, body.stream, {"session": sid})


@router.get("/{sid}", responses=_ERRORS)
async def get_session(sid: str, sessions: Sessions, ns: Namespace) -> dict:
    return (await sessions.get(ns, sid)).public()


@router.delete("/{sid}", responses=_ERRORS)
async def delete_session(sid: str, sessions: Sessions, ns: Namespace) -> dict:
    await sessions.delete(ns, sid)
    return {"deleted": sid}
