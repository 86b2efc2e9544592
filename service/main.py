"""create_app(settings) -> FastAPI. The lifespan builds the store and starts loading the model."""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request

from service import __version__
from service.api.auth import Authenticator, authenticate
from service.api.errors import install_error_handlers, request_id
from service.api.limits import BodyLimitMiddleware
from service.api.responses_store import Stored
from service.api.routes import chat, compose, conversations, health, memories, messages, responses, sessions, skills
from service.api.routes.playground import install_playground
from service.config import Settings
from service.api.schemas.common import ErrorResponse
from service.metrics import REQUESTS
from service.state import AppState


def create_app(settings: Settings | None = None, runtime: Any | None = None) -> FastAPI:
    """Raises service.api.auth.AuthConfigError for unusable auth settings (a bad keys file)."""
    settings = settings or Settings()
    auth = Authenticator(settings)  # before anything starts: a bad keys file must stop the process

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state = AppState(settings, runtime)
        app.state.skillcache = state
        app.state.responses_store = stored = Stored(settings, state.definitions)  # /v1/responses, /v1/conversations
        await state.start()
        stored.start_sweeper()
        try:
            yield
        finally:
            stored.stop_sweeper()
            await state.stop()

    app = FastAPI(title="skillcache", version=__version__, lifespan=lifespan,
                  description="Precompiled, composable and editable KV caches for agent skills.")
    app.state.auth = auth
    install_error_handlers(app)
    app.include_router(health.router)  # /livez, /readyz, /metrics: open
    install_playground(app)  # /ui: static files, open (they hold no data; the page calls /v1 with its key)
    auth_errors = {c: {"model": ErrorResponse} for c in (401, 403, 429)}
    # every /v1 route needs a key
    for r in (skills.router, compose.router, sessions.router, chat.router, memories.router, responses.router,
              conversations.router, messages.router):
        app.include_router(r, dependencies=[Depends(authenticate)], responses=auth_errors)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.max_body_bytes)

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        rid = request_id(request)  # X-Request-ID: the client's, or one made here; on every response
        response = await call_next(request)
        response.headers.setdefault("X-Request-ID", rid)
        route = request.scope.get("route")
        principal = getattr(request.state, "principal", None)
        REQUESTS.labels(getattr(route, "path", "unmatched"), str(response.status_code),
                        principal.namespace if principal else "").inc()
        return response

    return app


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.Formatter.converter = time.gmtime
