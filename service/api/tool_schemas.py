"""Tool calling in request bodies (OpenAI's shapes), and their conversion to service/tools' data."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from service.api.schemas import Strict
from service.tools.spec import MAX_TOOLS, TOOL_NAME_PATTERN, Tool, ToolChoice, ToolsParams
from service.tools.spec import tools_params as make_params

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


def tool_choice(choice: ToolChoiceIn | None) -> ToolChoice | None:
    if choice is None:
        return None
    return ToolChoice("named", choice.function.name) if isinstance(choice, NamedToolChoice) else ToolChoice(choice)


def tool_specs(tools: list[ToolIn] | None) -> list[Tool]:
    return [Tool(t.function.name, t.function.description, t.function.parameters) for t in tools or []]


def tools_params(tools: list[ToolIn] | None, choice: ToolChoiceIn | None, parallel: bool | None
                 ) -> ToolsParams | None:
    """The request's tools and choice (None when it offers none); 422 for a choice that cannot be honoured."""
    return make_params(tool_specs(tools), tool_choice(choice), parallel)
