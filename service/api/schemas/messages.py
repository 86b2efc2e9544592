"""Anthropic Messages API bodies (POST /v1/messages): the request with skillcache's composition extras, its content
blocks, tools and tool choice, and the response and error shapes as documented in OpenAPI.

Block types the service does not serve (images, documents, thinking, server tools' blocks) parse here and are
refused by service/api/messages_blocks.py with a message naming them, rather than failing as an unknown tag."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StringConstraints, model_validator

from service.api.schemas.common import Composition, StopString, Text
from service.api.schemas.tools import ToolName
from service.tools.spec import MAX_TOOLS

ToolUseId = Annotated[str, StringConstraints(min_length=1, max_length=256)]
# content block types of Anthropic's API that this service refuses by name (what they would need, it lacks)
UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "thinking", "redacted_thinking", "server_tool_use",
                      "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
                      "bash_code_execution_tool_result", "text_editor_code_execution_tool_result",
                      "tool_search_tool_result", "container_upload", "mcp_tool_use", "mcp_tool_result")


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = Field(None, description="accepted; blocks stay cached while the store keeps "
                                            "them (least recently used first out), not for a fixed time")


class UnsupportedBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal[UNSUPPORTED_BLOCKS]  # type: ignore[valid-type]


class _Block(BaseModel):
    # extra keys ignored: clients send back the blocks they got (the SDK's `citations`, `caller`...)
    model_config = ConfigDict(extra="ignore")
    cache_control: CacheControl | None = None


class TextBlockIn(_Block):
    type: Literal["text"]
    text: Text


class ToolUseIn(_Block):
    type: Literal["tool_use"]
    id: ToolUseId
    name: ToolName
    input: dict[str, Any]


class ToolResultIn(_Block):
    type: Literal["tool_result"]
    tool_use_id: ToolUseId
    content: Text | list[Annotated[TextBlockIn | UnsupportedBlock, Field(discriminator="type")]] | None = None
    is_error: bool | None = Field(None, description="accepted: the result's text is what the model reads")


ContentBlockIn = Annotated[TextBlockIn | ToolUseIn | ToolResultIn | UnsupportedBlock, Field(discriminator="type")]


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlockIn] = Field(max_length=4096)


class ToolIn(BaseModel):
    """A custom tool (Anthropic's shape); a server tool (`type` web_search_..., bash_...) is refused by name."""

    model_config = ConfigDict(extra="forbid")
    name: ToolName
    type: str | None = Field(None, max_length=128, description='"custom" (or omitted); server tools are refused')
    description: Annotated[str, StringConstraints(max_length=16384)] | None = None
    input_schema: dict[str, Any] | None = Field(None, description="a JSON schema (an object): required for a "
                                                "custom tool")
    cache_control: CacheControl | None = Field(None, description="accepted, a no-op: the tools block is always "
                                               "cached")
    strict: bool | None = None
    input_examples: list[dict[str, Any]] | None = Field(None, max_length=64)
    eager_input_streaming: bool | None = None
    defer_loading: bool | None = None
    allowed_callers: list[str] | None = Field(None, max_length=8)


class _Choice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    disable_parallel_tool_use: bool | None = None


class ChoiceAuto(_Choice):
    type: Literal["auto"]


class ChoiceAny(_Choice):
    type: Literal["any"]


class ChoiceTool(_Choice):
    type: Literal["tool"]
    name: ToolName


class ChoiceNone(_Choice):
    type: Literal["none"]


ToolChoiceIn = Annotated[ChoiceAuto | ChoiceAny | ChoiceTool | ChoiceNone, Field(discriminator="type")]


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: Annotated[str, StringConstraints(max_length=256)] | None = None


class MessagesRequest(Composition):
    """Anthropic's request, plus skillcache's composition extras (`skills`, `fields`, `mode`, `seam_tokens`,
    `memory`: the SDK's extra_body). Unknown fields are refused (422 naming them)."""

    model: Annotated[str, StringConstraints(max_length=256)]
    max_tokens: int = Field(ge=1, le=1_000_000)
    messages: list[MessageIn] = Field(min_length=1, max_length=1024)
    system: Text | Annotated[list[TextBlockIn], Field(max_length=256)] | None = None  # the bound: blocks, not text
    stop_sequences: list[StopString] | None = Field(None, max_length=16)
    stream: StrictBool = False
    temperature: float = Field(0.0, ge=0.0, le=1.0, description="0 (the default here): greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    tools: list[ToolIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceIn | None = None
    metadata: Metadata | None = None
    cache_control: CacheControl | None = Field(None, description="automatic caching: a breakpoint on the last "
                                               "system block")
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard"] | None = None
    inference_geo: Annotated[str, StringConstraints(max_length=64)] | None = None
    user_profile_id: Annotated[str, StringConstraints(max_length=256)] | None = None
    workspace_id: Annotated[str, StringConstraints(max_length=256)] | None = None
    top_k: int | None = Field(None, ge=1, description="sample among the k most likely tokens (with temperature > 0)")
    thinking: dict[str, Any] | None = Field(None, description="a hint: the model does not think before it answers; "
                                            "no thinking blocks are produced")
    # Anthropic's fields this service does not honour: accepted by the schema, refused with a 400 when used
    container: Any = None
    mcp_servers: list[Any] | None = None
    context_management: Any = None
    output_config: dict[str, Any] | None = None
    diagnostics: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """An explicit null (the SDK's Optional parameters) means the default."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


# ---- responses (for OpenAPI; the route builds plain dicts) ----------------------------------------------------------
class UsageOut(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


class MessageOut(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: UsageOut
    skillcache: dict[str, Any] = Field(description="skillcache's report: timings, skills (and cache_control "
                                       "blocks), edits, tools, memory")


class AnthropicErrorBody(BaseModel):
    type: str
    message: str
    error_type: str = Field(description="skillcache's stable error type")


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorBody
    request_id: str | None = None
