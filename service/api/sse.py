"""Server-sent events: `data: <json>` frames, then `data: [DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from service.api.errors import error_payload

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# OpenAPI: a route that streams when the body says "stream": true also answers 200 as text/event-stream
# The schema describes one parsed event (OpenAPI 3.0/3.1 `schema`, 3.2 `itemSchema`), as the OpenAPI spec's
# generic text/event-stream schema does: each `data` is one JSON object, or "[DONE]" at the end.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON object, or [DONE] after the last one"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
SSE_200 = {200: {"content": {"text/event-stream": {"schema": SSE_EVENT}},
                 "description": "JSON; with \"stream\": true, server-sent events (data: <json>, then data: [DONE])"}}


def frame(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[Any], to_json: Callable[[Any], list[dict]],
                 on_error: Callable[[dict], dict] = lambda e: {"type": "error", "error": e},
                 start: Callable[[], list[dict]] | None = None) -> StreamingResponse:
    """Stream `events`, each mapped by `to_json` to zero or more JSON frames (`start`: frames sent first, before
    the first event). An error after the stream began is sent as one error frame (the status line is already
    out)."""

    async def body() -> AsyncIterator[str]:
        try:
            for obj in start() if start is not None else []:
                yield frame(obj)
            async for ev in events:
                for obj in to_json(ev):
                    yield frame(obj)
        except Exception as e:  # noqa: BLE001 - reported in-band, the stream is already open
            yield frame(on_error(error_payload(e)))
        yield "data: [DONE]\n\n"

    return EventStream(body(), events)


class EventStream(StreamingResponse):
    """Closes its events when the response ends, however it ends. A client that hangs up cancels the response
    while the generators are paused at a `yield`; nothing else closes them then, and what they hold (a session's
    turn lock, the worker's job) would stay held until the garbage collector finalized them."""

    def __init__(self, body: AsyncIterator[str], events: AsyncIterator[Any]) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await _close(self.body_iterator)
            await _close(self.events)  # the body may never have started (cancelled at the status line)


async def _close(it: AsyncIterator[Any]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()
