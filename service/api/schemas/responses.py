"""OpenAI Responses API bodies (POST /v1/responses): input items, function tools, tool_choice, and the request with
skillcache's composition extras (`skills`, `fields`, `mode`, `seam_tokens`, `memory`, as on chat completions).

Every field of OpenAI's request is declared: the ones this service cannot honour are accepted by the schema and
refused with a 422 naming them (service/api/responses_items.py: refuse_unsupported), so a client never believes it
got what it asked for; a field OpenAI does not know is a 422 too, as at OpenAI."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from service.api.schemas.common import Composition, GenerationIn, Text
from service.api.schemas.tools import CallId, ToolName
from service.tools.spec import MAX_TOOLS

MAX_ITEMS = 1024


class Echoed(BaseModel):
    """An item or part as clients send them back: the keys of OpenAI's output this service does not read (`id`,
    `status`, `annotations`, `logprobs`, `phase`...) are ignored."""

    model_config = ConfigDict(extra="ignore")


class TextPart(Echoed):
    type: Literal["input_text", "output_text"] = Field(description="text parts only: the model reads text")
    text: Text


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(Echoed):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]

    def text(self) -> str:
        return _text(self.content)


class FunctionCallItem(Echoed):
    type: Literal["function_call"]
    call_id: CallId
    name: ToolName
    arguments: Annotated[str, StringConstraints(max_length=1_000_000)]


class FunctionCallOutputItem(Echoed):
    type: Literal["function_call_output"]
    call_id: CallId
    output: Text | list[TextPart]

    def text(self) -> str:
        return _text(self.output)


InputItem = Annotated[Union[MessageItem, FunctionCallItem, FunctionCallOutputItem], Field(discriminator="type")]


class FunctionToolIn(BaseModel):
    """Responses' flat function tool: {"type": "function", "name", "description", "parameters", "strict"}."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: ToolName = Field(description="the function's name")
    description: Annotated[str, StringConstraints(max_length=16384)] | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema (an object) of its arguments")
    strict: bool | None = Field(None, description="accepted and ignored: arguments are not constrained to the schema")


class OtherToolIn(BaseModel):
    """Any other tool type (OpenAI's built-in tools: web_search, file_search, ...): refused with a 422."""

    model_config = ConfigDict(extra="allow")
    type: Annotated[str, StringConstraints(max_length=64)]

    @model_validator(mode="after")
    def _not_function(self):
        if self.type == "function":
            raise ValueError("a function tool has exactly the keys type, name, description, parameters, strict")
        return self


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: ToolName


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Annotated[str, StringConstraints(max_length=64)]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptionsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_obfuscation: bool | None = None


Label = Annotated[str, StringConstraints(max_length=512)]


class ConversationRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: Label


Metadata = dict[Annotated[str, StringConstraints(max_length=64)], Label]


class ConversationCreate(BaseModel):
    """POST /v1/conversations: its first items (input items, as in a request's `input`) and metadata."""

    model_config = ConfigDict(extra="forbid")
    items: list[InputItem] | None = Field(None, json_schema_extra={"maxItems": MAX_ITEMS})
    metadata: Metadata | None = Field(None, max_length=16)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        return _defaults(data, "items")


class ResponsesRequest(GenerationIn, Composition):
    """POST /v1/responses. `temperature`, `top_p`, `stream` come from GenerationIn, as do `seed` and `stop`
    (skillcache extras here); the output's length is `max_output_tokens` (`max_tokens` is refused)."""

    model_config = ConfigDict(extra="forbid")
    model: Label | None = None
    input: Text | list[InputItem] = Field(description="text (one user message), or message, function_call and "
                                          "function_call_output items", json_schema_extra={"maxItems": MAX_ITEMS})
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_tokens: int | None = Field(None, ge=1, le=1_000_000, description="refused: use max_output_tokens")
    tools: list[FunctionToolIn | OtherToolIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    metadata: Metadata | None = Field(None, max_length=16)
    user: Label | None = None
    safety_identifier: Label | None = None
    prompt_cache_key: Label | None = None
    store: bool | None = Field(None, description="true or omitted (OpenAI's default): the Response and the "
                               "conversation it completed are kept (GET /v1/responses/{id}, previous_response_id); "
                               "false: nothing is kept")
    text: TextConfig | None = None
    reasoning: ReasoningIn | None = None
    include: list[Annotated[str, StringConstraints(max_length=128)]] | None = Field(None, max_length=32)
    # hints: accepted, and the Response says what was applied (docs/API.md)
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    stream_options: StreamOptionsIn | None = None
    background: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tool_calls: int | None = Field(None, ge=1)
    previous_response_id: Label | None = Field(None, description="a stored response: its conversation comes "
                                               "first (its instructions do not)")
    conversation: Label | ConversationRef | None = Field(None, description="a conversation (POST "
                                                         "/v1/conversations): its items come first, and this "
                                                         "response's input and output items are added to it")
    # OpenAI fields this service does not honour: refused with a 422 when set (to anything but null)
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    background_options: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        return _defaults(data, "input")


def _defaults(data, key: str):
    """OpenAI accepts null for any optional parameter: null means the default. A message item may omit its `type`
    (OpenAI's EasyInputMessage)."""
    if not isinstance(data, dict):
        return data
    data = {k: v for k, v in data.items() if v is not None}
    items = data.get(key)
    if isinstance(items, list):
        if len(items) > MAX_ITEMS:
            raise ValueError(f"{key}: at most {MAX_ITEMS} items")
        data[key] = [{**x, "type": "message"} if isinstance(x, dict) and "type" not in x and "role" in x
                     else x for x in items]
    return data
