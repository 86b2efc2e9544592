"""OpenAI-compatible chat completions (plus extra body fields `skills`, `fields`), tool calling, and /v1/models."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from service.api.chat_messages import ChatMessage, conversation, refuse_unsupported
from service.api.deps import Namespace, Pipeline, State
from service.api.routes.compose import gen_params
from service.api.schemas import ErrorResponse, GenerationIn, SeamTokens, SkillName, SkillRefIn
from service.api.sse import SSE_200, sse_response
from service.api.tool_schemas import ToolChoiceIn, ToolIn, tools_params
from service.compose.pipeline import ComposeParams, Final, SkillRef
from service.runtime.params import Delta
from service.tools.events import tool_calls_of
from service.tools.parser import CallEvent
from service.tools.spec import MAX_TOOLS

router = APIRouter(prefix="/v1", tags=["openai"])
_ERRORS = {c: {"model": ErrorResponse} for c in (404, 413, 422, 429, 503)}


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(GenerationIn):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    n: int = Field(1, ge=1)
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    skills: list[SkillName | SkillRefIn] = Field(default_factory=list, max_length=256)
    fields: dict[str, Annotated[str, StringConstraints(max_length=1024)]] | None = None
    mode: Literal["compose", "full"] = "compose"
    seam_tokens: SeamTokens = None
    tools: list[ToolIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields this service does not honour: accepted by the schema, refused with a 422 when used
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """OpenAI accepts null for any optional parameter (the SDK sends it for None): null means the default."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def _params(body: ChatRequest, ns: str) -> ComposeParams:
    refuse_unsupported(body)
    messages = conversation(body.messages)
    tools = tools_params(body.tools, body.tool_choice, body.parallel_tool_calls)
    body.max_tokens = body.max_completion_tokens or body.max_tokens or 256
    k = (body.top_logprobs or 1) if body.logprobs else None
    refs = [SkillRef(s.name, s.version) if isinstance(s, SkillRefIn) else SkillRef(s) for s in body.skills]
    return ComposeParams(
        skills=refs, messages=messages, fields=dict(body.fields or {}), gen=gen_params(body, k),
        mode=body.mode, seam_tokens=None if body.seam_tokens == "auto" else body.seam_tokens, namespace=ns,
        tools=tools,
    )


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
    return {**out, "tools": final.tools} if final.tools is not None else out


def _logprobs(final: Final) -> dict | None:
    top = final.done.top_logprobs
    if not top:
        return None
    tops = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top]
    return {"content": [{**tops[0], "top_logprobs": tops}]}


@router.post("/chat/completions", responses={**_ERRORS, **SSE_200})
async def chat_completions(body: ChatRequest, pipeline: Pipeline, state: State, ns: Namespace):
    params = _params(body, ns)
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
