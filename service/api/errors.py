"""The one place where errors become HTTP: {"error": {"type": <stable error_type>, "message": ...}}."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.errors import ServiceError
from service.metrics import ERRORS
from service.store.errors import StoreError

log = logging.getLogger(__name__)

_HTTP_TYPES = {404: "not_found", 405: "method_not_allowed", 413: "limit_exceeded", 415: "unsupported_media_type"}


def error_response(status: int, error_type: str, message: str, headers: dict | None = None) -> JSONResponse:
    ERRORS.labels(error_type).inc()
    return JSONResponse({"error": {"type": error_type, "message": message}}, status_code=status, headers=headers)


def error_payload(exc: BaseException) -> dict:
    """The error object for a stream that already started."""
    if isinstance(exc, ServiceError):
        return {"type": exc.error_type, "message": exc.message}
    return {"type": "internal_error", "message": "generation failed; see the server log"}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service(_: Request, exc: ServiceError):
        return error_response(exc.status, exc.error_type, exc.message, exc.headers)

    @app.exception_handler(StoreError)
    async def _store(_: Request, exc: StoreError):
        status = 507 if exc.error_type == "store_write_failed" else 503
        return error_response(status, exc.error_type, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors()[:5]:
            if e.get("type") == "json_invalid":  # its loc is a character offset, not a field
                at = e.get("loc", ("body", "?"))[-1]
                parts.append(f"the request body is not valid JSON (at character {at}): {e.get('msg')}")
                continue
            # field names and list indices only: union members ("constrained-int", "literal['auto']") are pydantic's
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body" and (isinstance(x, int) or x.isidentifier()))
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
        return error_response(422, "invalid_request", "; ".join(parts) or "invalid request body")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        if exc.status_code == 400:  # FastAPI could not parse the body (e.g. invalid UTF-8): a bad body, like any other
            return error_response(422, "invalid_request", f"the request body is not valid JSON in UTF-8 ({exc.detail})")
        return error_response(exc.status_code, _HTTP_TYPES.get(exc.status_code, "http_error"), str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal_error", "internal error; see the server log")
