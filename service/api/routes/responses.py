"""OpenAI's Responses API, POST /v1/responses: the same pipeline as chat completions (skillcache's composition extras
in the body), text or input items in, a Response out, or its typed stream events (each with its sequence_number).
Stored responses (service/api/responses_store.py): a request continues a previous response or a conversation, and
its Response is kept (store) before it is returned or its response.completed event is sent; GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items."""

from __future__ import annotations

import functools
from typing import Any, Literal

from fastapi import APIRouter, Query

from service.api.deps import Memories, Namespace, Pipeline, State
from service.api.params import compose_params, gen_params, tools_params
from service.api.structured import check_with_tools, responses_schema
from service.api.responses_items import (
    DEFAULT_MAX_OUTPUT_TOKENS, ResponseHead, call_item, conversation, extra, message_item, new_id, output_items,
    refuse_unsupported, text_part,
)
from service.api.responses_store import StoredDep, Turn, page
from service.api.schemas.common import ErrorResponse
from service.api.schemas.responses import FunctionToolIn, ResponsesRequest
from service.api.schemas.tools import FunctionIn, FunctionName, NamedToolChoice, ToolIn
from service.api.sse import SSE_200, sse_response
from service.compose.pipeline import ComposeParams, Final
from service.errors import InvalidRequest
from service.runtime.params import Delta
from service.tools.parser import CallEvent

router = APIRouter(prefix="/v1", tags=["openai"])
_ERRORS: dict[int | str, dict[str, Any]] = {c: {"model": ErrorResponse} for c in (404, 413, 422, 429, 503)}


def _tools(body: ResponsesRequest):
    """Responses' flat function tools and named choice in chat completions' shapes, through the one mapping."""
    tools = [ToolIn(type="function", function=FunctionIn(name=t.name, description=t.description,
                                                          parameters=t.parameters, strict=t.strict))
             for t in body.tools or [] if isinstance(t, FunctionToolIn)]
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice(type="function", function=FunctionName(name=choice.name))
    try:
        return tools_params(tools, choice, body.parallel_tool_calls)
    except InvalidRequest as e:
        raise InvalidRequest(e.message.replace(".function.name", ".name")) from None


async def _params(body: ResponsesRequest, ns: str, memories, turn: Turn) -> ComposeParams:
    messages = conversation(body, turn.prior, turn.origin)
    tools = _tools(body)
    gen = gen_params(body, None, body.max_output_tokens or DEFAULT_MAX_OUTPUT_TOKENS)
    fmt = body.text.format if body.text is not None else None
    gen.json_schema = responses_schema(fmt.model_dump() if fmt is not None else None)
    check_with_tools("text.format", gen.json_schema, tools)
    return await compose_params(body, messages, gen, ns, memories, tools)


class _Stream:
    """The pipeline's events as Responses stream events: the created/in_progress pair, then each output item
    (added, its content or arguments, done), then response.completed (or .incomplete) with the whole Response."""

    def __init__(self, head: ResponseHead) -> None:
        self.head, self.seq = head, 0
        self.output: list[dict] = []
        self.msg: dict | None = None  # the message item being streamed
        self.pending = ""  # whitespace not yet in a message: a reply of calls alone has no message item

    def event(self, type_: str, **fields) -> dict:
        ev = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return ev

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.head.response([])),
                self.event("response.in_progress", response=self.head.response([]))]

    def _open(self) -> list[dict]:
        self.msg = message_item(new_id("msg"), "")
        self.output.append(self.msg)
        at = {"item_id": self.msg["id"], "output_index": len(self.output) - 1}
        added = {**self.msg, "status": "in_progress", "content": []}
        return [self.event("response.output_item.added", output_index=at["output_index"], item=added),
                self.event("response.content_part.added", **at, content_index=0, part=text_part(""))]

    def text(self, text: str, force: bool = False) -> list[dict]:
        if self.msg is None and not force and not (self.pending + text).strip():
            self.pending += text
            return []
        out = self._open() if self.msg is None else []
        text, self.pending = self.pending + text, ""
        if not text:
            return out
        self.msg["content"][0]["text"] += text
        return out + [self.event("response.output_text.delta", item_id=self.msg["id"],
                                 output_index=len(self.output) - 1, content_index=0, delta=text, logprobs=[])]

    def close(self, status: str = "completed") -> list[dict]:
        if self.msg is None:
            return []
        msg, self.msg = self.msg, None
        msg["status"] = status
        part = msg["content"][0]
        at = {"item_id": msg["id"], "output_index": self.output.index(msg)}
        return [self.event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[]),
                self.event("response.content_part.done", **at, content_index=0, part=part),
                self.event("response.output_item.done", output_index=at["output_index"], item=msg)]

    def call(self, ev: CallEvent) -> list[dict]:
        out = self.close()
        item = call_item(new_id("fc"), ev.call)
        self.output.append(item)
        at = {"item_id": item["id"], "output_index": len(self.output) - 1}
        return out + [
            self.event("response.output_item.added", output_index=at["output_index"],
                       item=call_item(item["id"], ev.call, "in_progress")),
            self.event("response.function_call_arguments.delta", **at, delta=item["arguments"]),
            self.event("response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=at["output_index"], item=item)]

    def finish(self, final: Final) -> list[dict]:
        out = [] if self.output else self.text("", force=True)  # an empty reply is still one (empty) message
        out += self.close("incomplete" if final.done.finish_reason == "length" else "completed")
        response = self.head.response(self.output, final)
        done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return out + [self.event(done, response={**response, "skillcache": extra(final)})]

    def error(self, e: dict) -> dict:
        return self.event("error", code=e["type"], message=e["message"], param=None)

    def to_json(self, ev) -> list[dict]:
        if isinstance(ev, Delta):
            return self.text(ev.text)
        if isinstance(ev, CallEvent):
            return self.call(ev)
        return self.finish(ev)


class _Keeping:
    """The pipeline's events, with the final one turned into its stream events here, and the Response kept before
    they go out (a client that reads response.completed finds it stored). Closing it closes the events."""

    def __init__(self, events, stream: _Stream, keep) -> None:
        self.events, self.stream, self.keep = events, stream, keep

    def __aiter__(self) -> "_Keeping":
        return self

    async def __anext__(self):
        ev = await self.events.__anext__()
        if not isinstance(ev, Final):
            return ev
        frames = self.stream.finish(ev)
        await self.keep(frames[-1]["response"])
        return frames

    async def aclose(self) -> None:
        aclose = getattr(self.events, "aclose", None)
        if aclose is not None:
            await aclose()


@router.post("/responses", responses={**_ERRORS, **SSE_200})
async def create_response(body: ResponsesRequest, pipeline: Pipeline, state: State, ns: Namespace,
                          memories: Memories, stored: StoredDep):
    refuse_unsupported(body)
    turn = await stored.begin(ns, body)
    params = await _params(body, ns, memories, turn)
    prep = await pipeline.prepare(params)
    events = await pipeline.start(prep)
    head = ResponseHead(body, state.runtime.loaded.name, turn.conversation)
    keep = functools.partial(stored.keep, ns, body, turn)
    if not body.stream:
        final = None
        async for ev in events:
            final = ev
        response = {**head.response(output_items(final), final), "skillcache": extra(final)}
        await keep(response)
        return response

    stream = _Stream(head)
    to_json = lambda ev: ev if isinstance(ev, list) else stream.to_json(ev)  # noqa: E731 - frames made by _Keeping
    return sse_response(_Keeping(events, stream, keep), to_json, on_error=stream.error, start=stream.start)


@router.get("/responses/{rid}", responses=_ERRORS)
async def get_response(rid: str, stored: StoredDep, ns: Namespace) -> dict:
    """A stored response: the Response object as its POST returned it."""
    return (await stored.response(ns, rid))["response"]


@router.delete("/responses/{rid}", responses=_ERRORS)
async def delete_response(rid: str, stored: StoredDep, ns: Namespace) -> dict:
    return await stored.delete_response(ns, rid)


@router.get("/responses/{rid}/input_items", responses=_ERRORS)
async def list_input_items(rid: str, stored: StoredDep, ns: Namespace, order: Literal["asc", "desc"] = "desc",
                           limit: int = Query(20, ge=1, le=100), after: str | None = None) -> dict:
    """A stored response's own input items (not those of the response or conversation it continued)."""
    return page((await stored.response(ns, rid))["input_items"], order, limit, after)
