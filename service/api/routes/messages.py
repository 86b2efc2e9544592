"""Anthropic's Messages API, POST /v1/messages: the same pipeline as chat completions (skills, cache_control blocks,
tools, memory), answered as a Message or as Anthropic's stream of named events (`event: <type>` + `data: <json>`).

Errors before the stream starts come out in Anthropic's shape from service/api/errors.py; an error inside a stream is
an `event: error` frame of the same shape."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter

from service.api import messages_blocks as mb
from service.api.deps import Memories, Namespace, Pipeline, State
from service.api.errors import anthropic_error, error_payload
from service.api.structured import check_with_tools, messages_schema
from service.api.params import compose_params, gen_params, tools_params
from service.api.schemas.common import GenerationIn
from service.api.schemas.messages import AnthropicError, MessageOut, MessagesRequest
from service.api.sse import EventStream
from service.compose.pipeline import ComposeParams, Final
from service.errors import ServiceError
from service.runtime.params import Delta
from service.tools.parser import CallEvent

router = APIRouter(prefix="/v1", tags=["anthropic"])
_ERRORS = {c: {"model": AnthropicError} for c in (401, 404, 413, 422, 429, 503)}
_SSE = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string", "description": "message_start, content_block_start, ping, content_block_delta, "
              "content_block_stop, message_delta, message_stop, or error"},
    "data": {"type": "string", "description": "a JSON object whose `type` is the event's"}}}
_200 = {200: {"model": MessageOut, "content": {"text/event-stream": {"schema": _SSE}},
              "description": "a Message; with \"stream\": true, Anthropic's server-sent events"}}


async def _params(body: MessagesRequest, ns: str, memories) -> ComposeParams:
    mb.refuse_unsupported(body)
    blocks, system = mb.system_parts(body)
    messages = mb.conversation(body.messages, system)
    tools, choice, parallel = mb.openai_tools(body)
    gen = gen_params(GenerationIn(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  stop=body.stop_sequences))
    gen.top_k = body.top_k or 0
    gen.json_schema = messages_schema((body.output_config or {}).get("format"))
    tp = tools_params(tools, choice, parallel)
    check_with_tools("output_config.format", gen.json_schema, tp)
    params = await compose_params(body, messages, gen, ns, memories, tp)
    params.blocks = blocks
    return params


class _Reply:
    """What the response needs besides the events: the stop sequences, the tokenizer, each block's tokens."""

    def __init__(self, body: MessagesRequest, pipeline, prep) -> None:
        self.stops = list(body.stop_sequences or [])
        self.tokenizer = getattr(getattr(pipeline, "rt", None), "tokenizer", None)
        self.block_tokens = [len(getattr(b, "token_ids", ())) for b in prep.blocks[:len(prep.records)]]

    def usage(self, final: Final) -> dict:
        return mb.usage(final, self.block_tokens)

    def stop(self, final: Final) -> tuple[str, str | None]:
        return mb.stop(final, self.stops, self.tokenizer)


@router.post("/messages", responses={**_ERRORS, **_200})
async def create_message(body: MessagesRequest, pipeline: Pipeline, state: State, ns: Namespace,
                         memories: Memories):
    params = await _params(body, ns, memories)
    prep = await pipeline.prepare(params)
    reply = _Reply(body, pipeline, prep)
    events = await pipeline.start(prep)
    head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": state.runtime.loaded.name}
    if not body.stream:
        final = None
        async for ev in events:
            final = ev
        reason, sequence = reply.stop(final)
        return {**head, "content": mb.content(final), "stop_reason": reason, "stop_sequence": sequence,
                "usage": reply.usage(final), "skillcache": mb.report(final)}
    return EventStream(_stream(events, head, reply), events)


def _frame(obj: dict) -> str:
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(events: AsyncIterator[Any], head: dict, reply: _Reply) -> AsyncIterator[str]:
    """message_start, ping, per content block: start, deltas, stop; message_delta (stop reason, usage),
    message_stop. Text and tool calls arrive in order; a call closes the text block before it."""
    zero = {"input_tokens": 0, "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    yield _frame({"type": "message_start", "message": {**head, "content": [], "stop_reason": None,
                                                       "stop_sequence": None, "usage": zero}})
    yield _frame({"type": "ping"})
    index, text_open = 0, False
    try:
        async for ev in events:
            if isinstance(ev, Delta):
                if not ev.text:
                    continue
                if not text_open:
                    yield _frame({"type": "content_block_start", "index": index,
                                  "content_block": {"type": "text", "text": ""}})
                    text_open = True
                yield _frame({"type": "content_block_delta", "index": index,
                              "delta": {"type": "text_delta", "text": ev.text}})
                continue
            if text_open:
                yield _frame({"type": "content_block_stop", "index": index})
                index, text_open = index + 1, False
            if isinstance(ev, CallEvent):
                block = mb.tool_use(ev.call)
                yield _frame({"type": "content_block_start", "index": index,
                              "content_block": {**block, "input": {}}})
                yield _frame({"type": "content_block_delta", "index": index,
                              "delta": {"type": "input_json_delta",
                                        "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
                yield _frame({"type": "content_block_stop", "index": index})
                index += 1
                continue
            final: Final = ev
            if index == 0:  # an empty reply: one empty text block, as the non-streamed Message has
                yield _frame({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
                yield _frame({"type": "content_block_stop", "index": 0})
            reason, sequence = reply.stop(final)
            yield _frame({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": reply.usage(final), "skillcache": mb.report(final)})
            yield _frame({"type": "message_stop"})
    except Exception as e:  # noqa: BLE001 - reported in-band, the stream is already open
        err = error_payload(e)
        status = e.status if isinstance(e, ServiceError) else 500
        yield _frame(anthropic_error(status, err["type"], err["message"]))
