"""Session bodies (/v1/sessions): the head is a composition; each turn brings a user text, field values, or the
results of the last reply's tool calls."""

from __future__ import annotations

from pydantic import Field

from service.api.schemas.common import Composition, FieldValues, GenerationIn, Strict, Text
from service.api.schemas.tools import CallId, ToolChoiceIn, ToolIn
from service.tools.spec import MAX_TOOLS


class SessionCreate(Composition):
    system: Text | None = None
    tools: list[ToolIn] | None = Field(None, max_length=MAX_TOOLS, description="offered on every turn")


class ToolResultIn(Strict):
    tool_call_id: CallId
    content: Text


class TurnRequest(GenerationIn):
    user: Text | None = Field(None, min_length=1, description="required unless the turn brings tool_results")
    fields: FieldValues | None = Field(None, max_length=256)
    logprobs: int | None = Field(None, ge=1, le=20)
    tool_choice: ToolChoiceIn | None = None
    parallel_tool_calls: bool | None = None
    tool_results: list[ToolResultIn] | None = Field(None, max_length=MAX_TOOLS,
                                                    description="answers to every tool call of the last reply")
