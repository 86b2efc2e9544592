"""What every API's bodies share: names, text bounds, the error body, generation settings, and the composition part
(skills, fields, mode, seam tokens, memory) that service/api/params.py maps into the pipeline's parameters."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StringConstraints

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
    stream: StrictBool = False  # JSON true or false: "yes" or 1 is a 422, not a stream
    ignore_eos: StrictBool = Field(False, description="generate max_tokens even past the end-of-sequence token (vLLM's "
                                   "and llama.cpp's ignore_eos): replies of one length, for benchmarks; a typed "
                                   "reply (a JSON schema) still ends where its JSON does")


FieldValues = dict[str, Annotated[str, StringConstraints(max_length=1024)]]


class Composition(Strict):
    """The composition part of a request (/v1/compose, chat completions, sessions, and the drop-in APIs' extras)."""

    skills: list[SkillName | SkillRefIn] = Field(default_factory=list, max_length=256)
    fields: FieldValues | None = Field(None, max_length=256, description="field values: name -> value")
    mode: Literal["compose", "full"] = "compose"
    seam_tokens: SeamTokens = None
    memory: MemoryName | None = Field(None, description="a memory of this tenant, placed after the system turn, "
                                      "before the user text")
    memory_seam_tokens: MemorySeam = None
