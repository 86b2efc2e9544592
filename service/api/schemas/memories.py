"""User memory bodies (/v1/memories, service/memory/)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints

from service.api.schemas.common import NAME_PATTERN, MemoryName, Strict, Text


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
