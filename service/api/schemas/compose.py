"""/v1/compose bodies: the request (with tool calling's fields) and the response."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from service.api.schemas.common import Composition, GenerationIn, Text
from service.api.schemas.tools import ToolFields


class ComposeRequest(GenerationIn, Composition):
    system: Text | None = None
    user: Text = Field(min_length=1)
    logprobs: int | None = Field(None, ge=1, le=20)
    edit_mode: Literal["erratum", "field+erratum", "in_place", "recompile"] = "erratum"


class ComposeToolsRequest(ComposeRequest, ToolFields):
    """The compose body with tool calling's fields."""


class Usage(BaseModel):
    prompt_tokens: int
    reused_tokens: int  # composed_tokens + prefix_tokens
    composed_tokens: int  # copied from precompiled blocks (re-rotated)
    prefix_tokens: int  # an exact cached prefix (sessions, refined skill sequences, automatic heads)
    auto_tokens: int = 0  # of prefix_tokens, from an automatic head (SKILLCACHE_AUTO_REUSE)
    recomputed_tokens: int
    completion_tokens: int


class Timings(BaseModel):
    ttft_ms: float
    compose_ms: float
    store_ms: float
    total_ms: float


class SkillUse(BaseModel):
    name: str
    version: int
    content_hash: str
    source: Literal["memory", "disk", "redis", "compiled", "engine"]
    path: Literal["compose", "full", "prefix"]  # prefix: inside a refined skill sequence, copied exact
    seam: int | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float


class ToolCallFunctionOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunctionOut


class ToolsUse(BaseModel):
    format: Literal["hermes", "fallback", "llama3_json"]
    native: bool  # rendered by the chat template's own tools support
    n_tokens: int
    source: Literal["memory", "disk", "redis", "compiled", "engine"] | None = None
    path: Literal["compose", "full", "prefix", "text"]
    seam: int | None = None


class ComposeResponse(BaseModel):
    text: str
    finish_reason: str
    usage: Usage
    timings: Timings
    skills: list[SkillUse]
    edits: list[dict[str, Any]] = []
    logprobs: list[TopLogprob] | None = None
    tool_calls: list[ToolCallOut] | None = None  # when the request offered tools
    tools: ToolsUse | None = None
    memory: dict[str, Any] | None = Field(None, description="the memory placed in the prompt: revision, blocks")
