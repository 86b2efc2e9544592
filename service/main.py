"""create_app(settings) -> FastAPI. The lifespan builds the store and starts loading the model."""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request

from service import __version__
from service.api.errors import install_error_handlers
from service.api.limits import BodyLimitMiddleware
from service.api.routes import chat, compose, health, sessions, skills
from service.config import Settings
from service.metrics import REQUESTS
from service.state import AppState


def create_app(settings: Settings | None = None, runtime: Any | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state = AppState(settings, runtime)
        app.state.skillcache = state
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="skillcache", version=__version__, lifespan=lifespan,
                  description="Precompiled, composable and editable KV caches for agent skills.")
    install_error_handlers(app)
    for r in (health.router, skills.router, compose.router, sessions.router, chat.router):
        app.include_router(r)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        response = await call_next(request)
        route = request.scope.get("route")
        REQUESTS.labels(getattr(route, "path", "unmatched"), str(response.status_code)).inc()
        return response

    return app


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.Formatter.converter = time.gmtime
