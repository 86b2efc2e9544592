"""A JSON schema a reply or a tool call's arguments are decoded under, checked before the request runs: llguidance
compiles it (the grammar service/runtime/grammar.py decodes with; vLLM's structured outputs take the same JSON), or
the request is a 422 naming where and the keyword. No torch here: the API imports it."""

from __future__ import annotations

import json
from typing import Any

import llguidance

from service.errors import InvalidRequest
from service.runtime.params import JSON_LAYOUT

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
