"""Sessions: create with skills and fields, run turns (only new tokens are prefilled), read, delete."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import Namespace, Sessions
from service.api.params import gen_params, seam_tokens, skill_refs, tool_choice, tools_params
from service.api.routes.compose import respond
from service.api.schemas.common import ErrorResponse
from service.api.schemas.sessions import SessionCreate, TurnRequest
from service.api.sse import SSE_200

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])
_ERRORS = {c: {"model": ErrorResponse} for c in (404, 409, 413, 422, 429, 503)}


@router.post("", status_code=201, responses=_ERRORS)
async def create_session(body: SessionCreate, sessions: Sessions, ns: Namespace) -> dict:
    s, usage = await sessions.create(ns, skill_refs(body), body.system, dict(body.fields or {}), body.mode,
                                      seam_tokens(body),
                                      tools=tools_params(body.tools, None, None), memory=body.memory,
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
