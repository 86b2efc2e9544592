"""Tool calling in request bodies (OpenAI's shapes); service/api/params.py turns them into service/tools' data."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from service.api.schemas.common import Strict
from service.tools.spec import MAX_TOOLS, TOOL_NAME_PATTERN

ToolName = Annotated[str, StringConstraints(pattern=TOOL_NAME_PATTERN)]
CallId = Annotated[str, StringConstraints(min_length=1, max_length=256)]


class FunctionIn(Strict):
    name: ToolName = Field(description=f"the function's name, pattern {TOOL_NAME_PATTERN}")
    description: Annotated[str, StringConstraints(max_length=16384)] | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema (an object) of its arguments")
    strict: bool | None = Field(None, description="accepted and ignored: arguments are not constrained to the schema")


class ToolIn(Strict):
    type: Literal["function"]
    function: FunctionIn


class FunctionName(Strict):
    name: ToolName


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoiceIn = Literal["auto", "none", "required"] | NamedToolChoice


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: ToolName
    arguments: Annotated[str, StringConstraints(max_length=1_000_000)]


class ToolCallIn(BaseModel):
    """A past call in an assistant message. Extra keys are ignored: clients send back what they got (the SDK's
    accumulated stream keeps each call's `index`)."""

    model_config = ConfigDict(extra="ignore")
    id: CallId
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ToolFields(Strict):
    """The tool-calling fields of /v1/compose and session bodies (chat completions declares its own)."""

    tools: list[ToolIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None
