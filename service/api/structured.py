"""Typed outputs: the JSON schema a request's reply must satisfy (Chat's `response_format`, Responses'
`text.format`, Messages' `output_config.format`), checked before the request runs and carried as JSON text in
GenParams.json_schema. The embedded engine decodes under it with llguidance (service/runtime/grammar.py), vLLM
with its own structured outputs. A schema the library cannot compile, or that no JSON value satisfies, is a 422
naming the keyword; `json_object` is any JSON object."""

from __future__ import annotations

import json
from typing import Any

import llguidance

from service.errors import InvalidRequest
from service.runtime.params import JSON_LAYOUT

ANY_OBJECT = '{"type": "object"}'
MAX_SCHEMA_BYTES = 256 * 1024
MAX_DEPTH = 64  # nesting of the schema document (a recursive schema uses $ref, not depth)


def _depth(doc: Any) -> int:
    """The nesting depth of a JSON document, without recursion (a hostile one may be thousands deep)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_DEPTH:
            break
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def schema_text(where: str, schema: Any) -> str:
    """The schema as JSON text, once llguidance compiles it; 422 naming `where` and the keyword otherwise."""
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(f"{where}: a JSON schema is an object (or true/false)")
    if schema is False:
        raise InvalidRequest(f"{where}: Unsatisfiable schema: schema is false (no value is valid)")
    if schema is True:
        schema = {}
    if _depth(schema) > MAX_DEPTH:
        raise InvalidRequest(f"{where}: nested deeper than {MAX_DEPTH} levels; use $defs and $ref for recursion")
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_BYTES:
        raise InvalidRequest(f"{where}: {len(text)} bytes; the limit is {MAX_SCHEMA_BYTES}")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_LAYOUT)
        err = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, RuntimeError) as e:
        err = str(e)
    if err:
        raise InvalidRequest(f"{where}: {err}")
    return text


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
    """A typed reply and tools the model may call are not combined yet (the grammar would have to allow a call)."""
    if schema is not None and tools is not None and tools.choice.mode != "none":
        raise InvalidRequest(f"{where}: a typed reply together with callable tools is not supported yet; send "
                             "tool_choice none, or the tools and the format in separate requests")
