"""Skill registration bodies (/v1/skills)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints

from service.api.schemas.common import NAME_PATTERN, SkillName, Strict, Text


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
