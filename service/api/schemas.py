"""Request and response bodies. Pydantic validates shape; the stages validate meaning."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from service.registry.skill import NAME_PATTERN

SkillName = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
MAX_VERSION = 2**31 - 1  # versions count up from 1; a bound keeps absurd numbers out of store keys and paths
Text = Annotated[str, StringConstraints(max_length=1_000_000)]


# a number of tokens, or "auto" (omitted means the same): each skill's calibrated seam
SeamTokens = Annotated[int, Field(ge=0, le=4096)] | Literal["auto"] | None
MemoryName = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]  # user memories: service/memory/
MemorySeam = Annotated[int, Field(ge=0, le=4096)] | None  # None: SKILLCACHE_MEMORY_SEAM_TOKENS


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(BaseModel):
    type: str
    message: str
    request_id: str | None = Field(None, description="the request's X-Request-ID (given, or made by the service)")


class ErrorResponse(BaseModel):
    error: ErrorBody


class SkillCreate(Strict):
    name: SkillName = Field(description=f"Skill name, pattern {NAME_PATTERN}")
    text: Text = Field(min_length=1, description="The block's text; may refer to fields as {{field}}")
    description: Annotated[str, StringConstraints(max_length=2000)] | None = None
    fields: dict[str, Annotated[str, StringConstraints(max_length=1024)]] | None = Field(
        None, max_length=64, description="Mutable fields: name -> default value"
    )


class SkillOut(BaseModel):
    name: str
    version: int
    content_hash: str
    n_tokens: int
    description: str | None = None
    fields: dict[str, str] = {}
    text: str
    created_at: float
    compiled: bool = False
    versions: list[int] = []
    calibration: dict[str, Any] | None = Field(None, description="the seam chosen for this skill and its fidelity")
    shadow: dict[str, Any] | None = Field(None, description="live shadow checks against full recompute")
    degraded: bool = Field(False, description="a shadow check failed: served by full prefill until recalibrated")
    hits: dict[str, int] = Field({}, description="this version's block served by this process since it started, "
                                 "by where it came from (memory, disk, redis, compiled)")


class SkillList(BaseModel):
    skills: list[SkillOut]


class SkillDeleted(BaseModel):
    deleted: str
    versions: list[int]


class SkillRefIn(Strict):
    name: SkillName
    version: int | None = Field(None, ge=1, le=MAX_VERSION)


StopString = Annotated[str, StringConstraints(min_length=1, max_length=256)]


class GenerationIn(Strict):
    max_tokens: int = Field(128, ge=1, le=1_000_000)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: list[StopString] | StopString | None = None
    stream: bool = False


class ComposeRequest(GenerationIn):
    skills: list[SkillName | SkillRefIn] = Field(default_factory=list, max_length=256)
    system: Text | None = None
    user: Text = Field(min_length=1)
    fields: dict[str, Annotated[str, StringConstraints(max_length=1024)]] | None = Field(None, max_length=256)
    mode: Literal["compose", "full"] = "compose"
    seam_tokens: SeamTokens = None
    logprobs: int | None = Field(None, ge=1, le=20)
    edit_mode: Literal["erratum", "field+erratum", "in_place", "recompile"] = "erratum"
    memory: MemoryName | None = Field(None, description="a memory of this tenant, placed after the system turn, "
                                      "before the user text")
    memory_seam_tokens: MemorySeam = None


class Usage(BaseModel):
    prompt_tokens: int
    reused_tokens: int  # composed_tokens + prefix_tokens
    composed_tokens: int  # copied from precompiled blocks (re-rotated)
    prefix_tokens: int  # an exact cached prefix (sessions, refined skill sequences)
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
    source: Literal["memory", "disk", "redis", "compiled"]
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
    source: Literal["memory", "disk", "redis", "compiled"] | None = None
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


# ---- user memories (service/memory/) --------------------------------------------------------
class MemoryReplace(Strict):
    text: Text = Field(min_length=1, description="Markdown lines; `- [category] label: value` lines are facts")
    max_block_tokens: int | None = Field(None, ge=16, le=1_000_000, description="split into blocks of about this "
                                         "many tokens, compiled one by one (lines that refer to each other stay "
                                         "together); null: one block")


class MemoryCreate(MemoryReplace):
    name: MemoryName = Field(description=f"Memory name, pattern {NAME_PATTERN}")


class FactEditIn(Strict):
    label: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    value: Annotated[str, StringConstraints(max_length=1024)]
    mode: Literal["erratum", "in_place", "recompile"] = "erratum"


class MemoryPatch(Strict):
    edits: list[FactEditIn] = Field(min_length=1, max_length=256)


class MemoryFact(BaseModel):
    label: str
    category: str | None = None
    value: str
    block: int


class MemoryBlockOut(BaseModel):
    index: int
    n_tokens: int
    content_hash: str
    in_place_edits: int
    errata: dict[str, str]


class MemoryOut(BaseModel):
    name: str
    revision: int
    text: str
    n_tokens: int
    max_block_tokens: int | None = None
    facts: list[MemoryFact]
    blocks: list[MemoryBlockOut]
    created_at: float
    updated_at: float


class MemoryEdited(MemoryOut):
    edits: list[dict[str, Any]]
    timings: dict[str, float]


class MemorySummary(BaseModel):
    name: str
    revision: int
    n_tokens: int
    n_blocks: int
    updated_at: float


class MemoryList(BaseModel):
    memories: list[MemorySummary]
