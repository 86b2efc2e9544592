"""Test helpers: a fake skillcache server behind httpx.MockTransport, and SSE body builders."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx


class ChunkedStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body delivered in the given chunks, to sync and async clients alike."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def __iter__(self) -> Iterator[bytes]:
        yield from self.chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for c in self.chunks:
            yield c


def sse(*events: Any, done: bool = True) -> bytes:
    """An SSE body: one `data:` event per dict (or raw str), then `data: [DONE]`."""
    out = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    if done:
        out.append("data: [DONE]\n\n")
    return "".join(out).encode()


def split_every(data: bytes, n: int) -> list[bytes]:
    return [data[i:i + n] for i in range(0, len(data), n)]


Handler = Callable[[httpx.Request], httpx.Response]


class FakeServer:
    """Routes (method, path) to handlers and records every request it receives."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Handler] = {}
        self.requests: list[httpx.Request] = []

    def on(self, method: str, path: str, handler: Handler | httpx.Response | dict) -> None:
        if isinstance(handler, httpx.Response):
            resp = handler
            handler = lambda req: resp  # noqa: E731
        elif isinstance(handler, dict):
            body = handler
            handler = lambda req: httpx.Response(200, json=body)  # noqa: E731
        self.routes[(method, path)] = handler

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        handler = self.routes.get((request.method, request.url.path))
        if handler is None:
            return httpx.Response(404, json={"error": {"type": "not_found", "message": "no route"}})
        return handler(request)

    @property
    def last(self) -> httpx.Request:
        return self.requests[-1]

    def last_json(self) -> Any:
        return json.loads(self.last.content)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)


def stream_response(body: bytes, chunk: int | None = None, status: int = 200,
                    content_type: str = "text/event-stream") -> httpx.Response:
    """A streamed response whose body arrives `chunk` bytes at a time (all at once if None)."""
    chunks = split_every(body, chunk) if chunk else [body]
    return httpx.Response(status, headers={"content-type": content_type}, stream=ChunkedStream(chunks))


DONE_EVENT = {
    "type": "done", "finish_reason": "stop",
    "usage": {"prompt_tokens": 900, "reused_tokens": 812, "recomputed_tokens": 88, "completion_tokens": 3},
    "timings": {"ttft_ms": 41.5, "compose_ms": 3.25, "store_ms": 1.0, "total_ms": 80.0},
    "skills": [{"name": "refund-policy", "version": 1, "content_hash": "ab", "source": "memory"}],
}


def skill_record(name: str, version: int = 1, n_tokens: int = 812, **extra: Any) -> dict[str, Any]:
    return {"name": name, "version": version, "content_hash": "c0ffee", "n_tokens": n_tokens,
            "compiled": True, "description": None, "fields": {}, "text": "...", "created_at": 0.0, **extra}
