"""OpenAI Chat Completions bodies: messages, and the request with skillcache's composition extras."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.api.schemas.common import Composition, GenerationIn, Text
from service.api.schemas.tools import CallId, ToolCallIn, ToolFields
from service.tools.spec import MAX_TOOLS


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, refusal, audio...: ignored
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: CallId | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(GenerationIn, Composition, ToolFields):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    n: int = Field(1, ge=1)
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # OpenAI fields this service does not honour: accepted by the schema, refused with a 422 when used
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """OpenAI accepts null for any optional parameter (the SDK sends it for None): null means the default."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data
