"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.api.deps import State

router = APIRouter(tags=["health"])


@router.get("/livez")
async def livez() -> dict:
    """The process is up and serving HTTP (the model may still be loading)."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(state: State) -> JSONResponse:
    """Model loaded, self-check passed, definitions store reachable; per-tier details in the body."""
    ok, details = await state.readiness()
    return JSONResponse({"status": "ready" if ok else "not_ready", **details}, status_code=200 if ok else 503)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}, "description": "Prometheus text"}})
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
