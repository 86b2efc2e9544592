"""OpenAI-compatible chat completions (plus extra body fields `skills`, `fields`), tool calling, and /v1/models."""

from __future__ import annotations

import time
import uuid
from fastapi import APIRouter

from service.api.chat_messages import conversation, refuse_unsupported
from service.api.deps import Memories, Namespace, Pipeline, State
from service.api.params import compose_params, gen_params, tools_params
from service.api.structured import chat_schema, check_with_tools
from service.api.schemas.common import ErrorResponse
from service.api.schemas.chat import ChatRequest
from service.api.sse import SSE_200, sse_response
from service.compose.pipeline import ComposeParams, Final
from service.runtime.params import Delta
from service.tools.events import tool_calls_of
from service.tools.parser import CallEvent

router = APIRouter(prefix="/v1", tags=["openai"])
_ERRORS = {c: {"model": ErrorResponse} for c in (404, 413, 422, 429, 503)}


async def _params(body: ChatRequest, ns: str, memories) -> ComposeParams:
    refuse_unsupported(body)
    messages = conversation(body.messages)
    tools = tools_params(body.tools, body.tool_choice, body.parallel_tool_calls)
    k = (body.top_logprobs or 1) if body.logprobs else None
    gen = gen_params(body, k, body.max_completion_tokens or body.max_tokens or 256)
    gen.json_schema = chat_schema(body.response_format)
    check_with_tools("response_format", gen.json_schema, tools)
    return await compose_params(body, messages, gen, ns, memories, tools)


def _usage(final: Final) -> dict:
    u = final.usage
    return {
        "prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
        "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": u["reused_tokens"]},
    }


def _finish(final: Final) -> str:
    reason = final.done.finish_reason
    return reason if reason in ("length", "tool_calls") else "stop"


def _message(final: Final) -> dict:
    calls = tool_calls_of(final.done)
    if not calls:
        return {"role": "assistant", "content": final.done.text}
    return {"role": "assistant", "content": final.done.text or None, "tool_calls": [c.openai() for c in calls]}


def _extra(final: Final) -> dict:
    out = {"timings": final.timings, "skills": final.skills, "edits": final.edits}
    if final.memory is not None:
        out["memory"] = final.memory
    return {**out, "tools": final.tools} if final.tools is not None else out


def _logprobs(final: Final) -> dict | None:
    top = final.done.top_logprobs
    if not top:
        return None
    tops = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top]
    return {"content": [{**tops[0], "top_logprobs": tops}]}


@router.post("/chat/completions", responses={**_ERRORS, **SSE_200})
async def chat_completions(body: ChatRequest, pipeline: Pipeline, state: State, ns: Namespace, memories: Memories):
    params = await _params(body, ns, memories)
    prep = await pipeline.prepare(params)
    events = await pipeline.start(prep)
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), state.runtime.loaded.name
    head = {"id": cid, "created": created, "model": model}
    if not body.stream:
        final = None
        async for ev in events:
            final = ev
        choice = {"index": 0, "message": _message(final), "finish_reason": _finish(final),
                  "logprobs": _logprobs(final)}
        return {**head, "object": "chat.completion", "choices": [choice], "usage": _usage(final),
                "skillcache": _extra(final)}

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunk = {**head, "object": "chat.completion.chunk"}
    first = [True]

    def delta(d: dict) -> dict:
        if first[0]:
            d, first[0] = {"role": "assistant", **d}, False
        return {**chunk, "choices": [{"index": 0, "delta": d, "finish_reason": None}]}

    def to_json(ev):
        if isinstance(ev, Delta):
            return [delta({"content": ev.text})]
        if isinstance(ev, CallEvent):  # a complete call: its name first, then its arguments, as OpenAI streams them
            c = ev.call
            head = {"index": ev.index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
            return [delta({"tool_calls": [head]}),
                    delta({"tool_calls": [{"index": ev.index, "function": {"arguments": c.arguments}}]})]
        out = [{**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": _finish(ev),
                                      "logprobs": _logprobs(ev)}]}]
        if include_usage:
            out.append({**chunk, "choices": [], "usage": _usage(ev)})
        return out

    return sse_response(events, to_json, on_error=lambda e: {"error": e})


@router.get("/models")
async def list_models(state: State):
    rt = state.runtime
    name = rt.loaded.name if rt is not None else state.settings.model
    return {"object": "list", "data": [{"id": name, "object": "model", "created": int(state.started_at),
                                        "owned_by": "skillcache"}]}
