"""The one place where errors become HTTP: {"error": {"type": <stable error_type>, "message": ..., "request_id": ...}}
(the Messages API's paths answer in Anthropic's shape, with the same stable type as `error.error_type`).

Every error the service raises is a ServiceError (service/errors.py; the store's too) carrying its status and type.
The request id (the client's `X-Request-ID`, or one made here; echoed in every response's header) names a 500 in the
log, so a report of our own bug can be found."""

from __future__ import annotations

import logging
import re
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.errors import InternalError, ServiceError
from service.metrics import ERRORS

log = logging.getLogger(__name__)

_HTTP_TYPES = {404: "not_found", 405: "method_not_allowed", 413: "limit_exceeded", 415: "unsupported_media_type"}


_CLIENT_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def request_id(request: Request) -> str:
    """This request's id: the client's X-Request-ID when it is a plain token, else one made now (kept on the
    request)."""
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        given = request.headers.get("x-request-id", "")
        rid = request.state.request_id = given if _CLIENT_ID.fullmatch(given) else f"req-{secrets.token_hex(8)}"
    return rid


# Anthropic's error types by status: the Messages API (/v1/messages) answers in its shape, which its SDK parses
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
                   429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(status: int, error_type: str, message: str) -> dict:
    """{"type": "error", "error": {"type": <Anthropic's>, "message", "error_type": <ours, stable>}}."""
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message,
                                       "error_type": error_type}}


def error_response(status: int, error_type: str, message: str, headers: dict | None = None,
                   rid: str | None = None, request: Request | None = None) -> JSONResponse:
    ERRORS.labels(error_type).inc()
    if rid is not None:
        headers = {**(headers or {}), "X-Request-ID": rid}
    path = request.url.path if request is not None else ""
    return JSONResponse(error_body(path, status, error_type, message, rid), status_code=status, headers=headers)


def error_body(path: str, status: int, error_type: str, message: str, rid: str | None = None) -> dict:
    """The error's JSON for a request to `path`: Anthropic's shape on the Messages API, ours everywhere else."""
    if path.startswith("/v1/messages"):
        return {**anthropic_error(status, error_type, message), "request_id": rid}
    body = {"type": error_type, "message": message}
    if rid is not None:
        body["request_id"] = rid
    return {"error": body}


def error_payload(exc: BaseException) -> dict:
    """The error object for a stream that already started."""
    if isinstance(exc, ServiceError):
        return {"type": exc.error_type, "message": exc.message}
    return {"type": "internal_error", "message": "generation failed; see the server log"}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service(request: Request, exc: ServiceError):
        rid = request_id(request)
        if isinstance(exc, InternalError):
            log.error("internal error (request %s): %s", rid, exc.message, exc_info=exc)
            return error_response(500, "internal_error", f"internal error ({exc.message}); report request {rid}",
                                  rid=rid, request=request)
        return error_response(exc.status, exc.error_type, exc.message, exc.headers, rid, request)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors()[:5]:
            if e.get("type") == "json_invalid":  # its loc is a character offset, not a field
                at = e.get("loc", ("body", "?"))[-1]
                parts.append(f"the request body is not valid JSON (at character {at}): {e.get('msg')}")
                continue
            # field names and list indices only: union members ("constrained-int", "literal['auto']") are pydantic's
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body" and (isinstance(x, int) or x.isidentifier()))
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
        return error_response(422, "invalid_request", "; ".join(parts) or "invalid request body",
                              rid=request_id(request), request=request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        rid = request_id(request)
        if exc.status_code == 400:  # FastAPI could not parse the body (e.g. invalid UTF-8): a bad body, like any other
            return error_response(422, "invalid_request", f"the request body is not valid JSON in UTF-8 ({exc.detail})",
                                  rid=rid, request=request)
        return error_response(exc.status_code, _HTTP_TYPES.get(exc.status_code, "http_error"), str(exc.detail),
                              getattr(exc, "headers", None), rid, request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        rid = request_id(request)
        log.exception("unhandled error (request %s)", rid)
        return error_response(500, "internal_error", f"internal error; report request {rid}", rid=rid,
                              request=request)
