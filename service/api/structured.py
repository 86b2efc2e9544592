"""Typed outputs: the JSON schema a request's reply must satisfy (Chat's `response_format`, Responses'
`text.format`, Messages' `output_config.format`), checked before the request runs and carried as JSON text in
GenParams.json_schema. The embedded engine decodes under it with llguidance (service/runtime/grammar.py), vLLM
with its own structured outputs. A schema the library cannot compile, or that no JSON value satisfies, is a 422
naming the keyword; `json_object` is any JSON object."""

from __future__ import annotations

from service.errors import InvalidRequest
from service.runtime.schema import schema_text

__all__ = ["schema_text"]  # the check itself lives with the decode side, for tools too

ANY_OBJECT = '{"type": "object"}'


def chat_schema(response_format: dict | None) -> str | None:
    """Chat Completions' response_format: text (None), json_object, or json_schema {name, schema, strict}."""
    rf = response_format or {}
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequest("response_format.json_schema: required for type json_schema ({name, schema})")
        return schema_text("response_format.json_schema.schema", spec.get("schema", {"type": "object"}))
    raise InvalidRequest(f"response_format.type: {kind!r} is none of text, json_object, json_schema")


def responses_schema(fmt: dict | None) -> str | None:
    """Responses' text.format: text (None), json_object, or json_schema {name, schema, strict} (flat)."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        return schema_text("text.format.schema", (fmt or {}).get("schema", {"type": "object"}))
    raise InvalidRequest(f"text.format.type: {kind!r} is none of text, json_object, json_schema")


def messages_schema(fmt: dict | None) -> str | None:
    """Anthropic's output_config.format: {type: json_schema, schema}."""
    if fmt is None:
        return None
    if fmt.get("type") != "json_schema":
        raise InvalidRequest(f"output_config.format.type: {fmt.get('type')!r} is not json_schema")
    return schema_text("output_config.format.schema", fmt.get("schema", {"type": "object"}))


def check_with_tools(where: str, schema: str | None, tools) -> None:
    """A typed reply beside tools the model may or may not call (tool_choice auto) is not combined yet (the grammar
    would have to allow a call or the reply); a forced call is decoded under its tool's schema instead."""
    if schema is not None and tools is not None and tools.choice.mode == "auto":
        raise InvalidRequest(f"{where}: a typed reply together with tool_choice auto is not supported yet; send "
                             "tool_choice none (the typed reply), required or a named tool (a call, decoded under "
                             "the tool's parameters schema), or the tools and the format in separate requests")
