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
from service.api.tool_schemas import CallId, ToolChoiceIn, ToolIn, tool_choice, tool_specs
from service.compose.pipeline import SkillRef
from service.tools.spec import MAX_TOOLS, tools_params

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])
_ERRORS = {c: {"model": ErrorResponse} for c in (404, 409, 413, 422, 429, 503)}
FieldValues = dict[str, Annotated[str, StringConstraints(max_length=1024)]]


class SessionCreate(Strict):
    skills: list[SkillName | SkillRefIn] = Field(default_factory=list, max_length=256)
    system: Text | None = None
    fields: FieldValues | None = Field(None, max_length=256)
    mode: Literal["compose", "full"] = "compose"
    seam_tokens: SeamTokens = None
    tools: list[ToolIn] | None = Field(None, max_length=MAX_TOOLS, description="offered on every turn")
    memory: MemoryName | None = None  # floated before every user turn (service/memory/)
    memory_seam_tokens: MemorySeam = None


class ToolResultIn(Strict):
    tool_call_id: CallId
    content: Text


class TurnRequest(GenerationIn):
    user: Text | None = Field(None, min_length=1, description="required unless the turn brings tool_results")
    fields: FieldValues | None = Field(None, max_length=256)
    logprobs: int | None = Field(None, ge=1, le=20)
    tool_choice: ToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None
    tool_results: list[ToolResultIn] | None = Field(None, max_length=MAX_TOOLS,
                                                    description="answers to every tool call of the last reply")


@router.post("", status_code=201, responses=_ERRORS)
async def create_session(body: SessionCreate, sessions: Sessions, ns: Namespace) -> dict:
    refs = [SkillRef(s.name, s.version) if isinstance(s, SkillRefIn) else SkillRef(s) for s in body.skills]
    s, usage = await sessions.create(ns, refs, body.system, dict(body.fields or {}), body.mode,
                                      None if body.seam_tokens == "auto" else body.seam_tokens,
                                      tools=tools_params(tool_specs(body.tools), None, None), memory=body.memory,
                                      memory_seam_tokens=body.memory_seam_tokens)
    return {**s.public(), "usage": usage}


@router.post("/{sid}/turns", responses={**_ERRORS, **SSE_200})
async def run_turn(sid: str, body: TurnRequest, sessions: Sessions, ns: Namespace):
    results = [r.model_dump() for r in body.tool_results or []]
    events = await sessions.turn(ns, sid, body.user, dict(body.fields or {}), gen_params(body, body.logprobs),
                                 tool_choice(body.tool_choice), body.parallel_tool_calls, results)
    return await respond(events, body.stream, {"session": sid})


@router.get("/{sid}", responses=_ERRORS)
async def get_session(sid: str, sessions: Sessions, ns: Namespace) -> dict:
    return (await sessions.get(ns, sid)).public()


@router.delete("/{sid}", responses=_ERRORS)
async def delete_session(sid: str, sessions: Sessions, ns: Namespace) -> dict:
    await sessions.delete(ns, sid)
    return {"deleted": sid}
