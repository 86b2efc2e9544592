"""FastAPI dependencies: the app state, the pipeline, the caller's namespace."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from service.api.auth import Principal, authenticate
from service.compose.pipeline import ComposePipeline
from service.memory.registry import MemoryRegistry
from service.sessions.manager import SessionManager
from service.state import AppState


def get_state(request: Request) -> AppState:
    return request.app.state.skillcache


def get_pipeline(state: Annotated[AppState, Depends(get_state)]) -> ComposePipeline:
    return state.require_pipeline()


def get_sessions(state: Annotated[AppState, Depends(get_state)]) -> SessionManager:
    return state.require_sessions()


def get_memories(state: Annotated[AppState, Depends(get_state)]) -> MemoryRegistry:
    return state.require_memories()


def get_namespace(principal: Annotated[Principal, Depends(authenticate)]) -> str:
    """The caller's namespace: the API key's, or "default" when auth is off (service/api/auth.py)."""
    return principal.namespace


State = Annotated[AppState, Depends(get_state)]
Pipeline = Annotated[ComposePipeline, Depends(get_pipeline)]
Namespace = Annotated[str, Depends(get_namespace)]
Sessions = Annotated[SessionManager, Depends(get_sessions)]
Memories = Annotated[MemoryRegistry, Depends(get_memories)]
