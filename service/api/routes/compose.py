"""POST /v1/compose: skills + a user turn -> text (JSON or server-sent events)."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import Memories, Namespace, Pipeline
from service.api.params import compose_params, gen_params, tools_params
from service.api.schemas.common import ErrorResponse
from service.api.schemas.compose import ComposeResponse, ComposeToolsRequest
from service.api.sse import SSE_200, sse_response
from service.compose.pipeline import Final
from service.runtime.params import Delta
from service.tools.events import tool_calls_of
from service.tools.parser import CallEvent

router = APIRouter(prefix="/v1", tags=["compose"])
_ERRORS = {c: {"model": ErrorResponse} for c in (404, 413, 422, 429, 503)}


def _final_json(final: Final, text: str | None = None) -> dict:
    out = {
        "finish_reason": final.done.finish_reason, "usage": final.usage, "timings": final.timings,
        "skills": final.skills, "edits": final.edits,
    }
    if final.memory is not None:
        out["memory"] = final.memory
    if text is not None:
        out = {"text": text, **out}
    if final.done.top_logprobs is not None:
        out["logprobs"] = [{"token": t, "logprob": lp} for t, lp in final.done.top_logprobs]
    if final.tools is not None:
        out["tool_calls"] = [c.openai() for c in tool_calls_of(final.done)]
        out["tools"] = final.tools
    return out


async def respond(events, stream: bool, extra: dict | None = None):
    """JSON (the final text) or server-sent events (deltas, then a done event) for a started request."""
    extra = extra or {}
    if stream:
        def to_json(ev):
            if isinstance(ev, Delta):
                return [{"type": "delta", "text": ev.text}]
            if isinstance(ev, CallEvent):
                return [{"type": "tool_call", "index": ev.index, "tool_call": ev.call.openai()}]
            return [{"type": "done", **_final_json(ev), **extra}]

        return sse_response(events, to_json)
    final = None
    async for ev in events:
        final = ev
    return {**_final_json(final, final.done.text), **extra}


@router.post("/compose", response_model=ComposeResponse, responses={**_ERRORS, **SSE_200})
async def compose(body: ComposeToolsRequest, pipeline: Pipeline, ns: Namespace, memories: Memories):
    messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
        {"role": "user", "content": body.user}]
    params = await compose_params(body, messages, gen_params(body, body.logprobs), ns, memories,
                                  tools_params(body.tools, body.tool_choice, body.parallel_tool_calls), body.edit_mode)
    prep = await pipeline.prepare(params)
    return await respond(await pipeline.start(prep), body.stream)
