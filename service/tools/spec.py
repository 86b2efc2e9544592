"""Tool calling's plain data: the tools a request offers, how it wants them used, and the calls parsed back.

OpenAI's shapes are kept at the edges (`Tool.openai()`, `ToolCall.openai()`); inside, a tool is a name, a
description and a JSON schema, and a call is a name and its arguments as a JSON string.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from service.errors import InvalidRequest
from service.runtime.schema import schema_text

TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names
MAX_TOOLS = 128


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (an object), as the client sent it

    def function(self) -> dict[str, Any]:
        """The function object as rendered for the model: what the client sent, without API-only flags."""
        out: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            out["description"] = self.description
        if self.parameters is not None:
            out["parameters"] = self.parameters
        return out

    def openai(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function()}

    @classmethod
    def from_openai(cls, obj: dict[str, Any]) -> "Tool":
        fn = obj["function"]
        return cls(fn["name"], fn.get("description"), fn.get("parameters"))

    def first_required(self) -> tuple[str, str | None] | None:
        """(name, JSON type) of the schema's first required property, when it has one."""
        params = self.parameters or {}
        required = params.get("required")
        props = params.get("properties")
        if not isinstance(required, list) or not required or not isinstance(props, dict):
            return None
        key = required[0]
        if not isinstance(key, str) or key not in props:
            return None
        kind = props[key].get("type") if isinstance(props[key], dict) else None
        return key, kind if isinstance(kind, str) else None

    def arguments_schema(self) -> dict[str, Any]:
        """What a forced call's arguments are decoded under: the parameters as sent, an object whatever they say (a
        call's arguments are one); none sent: any object."""
        params = dict(self.parameters or {})
        params.setdefault("type", "object")
        return params

    def takes_no_arguments(self) -> bool:
        params = self.parameters
        return params is not None and not params.get("properties") and not params.get("required")


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["auto", "none", "required", "named"] = "auto"
    name: str | None = None  # with mode "named"

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


@dataclass
class ToolsParams:
    """What a request asks of tool calling."""

    tools: list[Tool]
    choice: ToolChoice = field(default_factory=ToolChoice)
    parallel: bool = True

    def digest(self) -> str:
        """Content hash of the tool specs (not of the choice): one block per distinct set of tools."""
        text = json.dumps([t.openai() for t in self.tools], ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def names(self) -> set[str]:
        return {t.name for t in self.tools}

    def get(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)


def tools_params(tools: list[Tool], choice: ToolChoice | None, parallel: bool | None) -> ToolsParams | None:
    """The tools offered and the choice; None when none are offered. 422 naming the field for tools or a choice
    that cannot be honoured."""
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.name in seen:
            raise InvalidRequest(f"tools.{i}.function.name: {t.name!r} is offered twice; tool names must be unique")
        seen.add(t.name)
    choice = choice or ToolChoice()
    if choice.forced and not tools:
        raise InvalidRequest(f"tool_choice: {choice.name or choice.mode!r} needs tools; none are offered")
    if choice.mode == "named" and choice.name not in seen:
        raise InvalidRequest(f"tool_choice: no tool named {choice.name!r} among the tools offered ({sorted(seen)})")
    for i, t in enumerate(tools):  # a call the service forces is decoded under the tool's schema: it must compile
        if choice.mode == "required" or t.name == choice.name:
            schema_text(f"tools.{i}.function.parameters", t.arguments_schema())
    return ToolsParams(list(tools), choice, True if parallel is None else parallel) if tools else None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it (the model's, normalized when it parsed)

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def arguments_value(self) -> Any:
        """The arguments as JSON data for a template (a dict when they parse), else the text as is."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"
