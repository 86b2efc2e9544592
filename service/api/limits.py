"""Request body size limit as a pure ASGI middleware (counts bytes, chunked bodies included)."""

from __future__ import annotations

import json

from service.api.errors import error_body
from service.metrics import ERRORS


class BodyLimitMiddleware:
    def __init__(self, app, max_body_bytes: int) -> None:
        self.app = app
        self.max = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max:
            return await self._reject(scope, send)
        seen = 0
        too_large = started = False

        async def limited_receive():
            nonlocal seen, too_large
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max:
                    too_large = True
                    raise _TooLarge()
            return message

        async def guarded_send(message):
            nonlocal started
            if too_large:
                return  # the app's reply to a body it could not read (FastAPI makes it a 400): 413 instead
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _TooLarge:
            pass
        if too_large and not started:
            await self._reject(scope, send)

    async def _reject(self, scope, send) -> None:
        ERRORS.labels("limit_exceeded").inc()
        message = f"request body exceeds {self.max} bytes (SKILLCACHE_MAX_BODY_BYTES)"
        body = json.dumps(error_body(scope.get("path", ""), 413, "limit_exceeded", message)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
