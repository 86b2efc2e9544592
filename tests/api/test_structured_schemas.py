"""200 generated JSON schemas (nested objects, arrays, enums, anyOf, required and optional properties, string
formats, $defs/$ref), each as a Chat response_format on the embedded engine with sampling on: every reply parses
and validates (formats checked too). The tiny random-weight model has no wish to close a string or an array, so
every string and array here is bounded (maxLength, maxItems) and objects take no other properties: what a
schema leaves unbounded, a real model closes."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from appclient import make_client

pytestmark = pytest.mark.slow

# not "time"/"date-time": llguidance allows a leap second (23:59:60), as RFC 3339 does; Python's datetime (and so
# jsonschema's checker and pydantic) refuses it (docs/API.md, Structured outputs)
FORMATS = ["date", "uuid", "ipv4", "email"]


def _leaf(r: random.Random) -> dict:
    kind = r.choice(["string", "enum", "format", "integer", "number", "boolean", "null", "const"])
    if kind == "string":
        return {"type": "string", "minLength": r.randint(0, 2), "maxLength": r.randint(2, 8)}
    if kind == "enum":
        return {"enum": r.sample(["red", "green", "blue", "a b", "é", "x\"y", "", "42"], r.randint(1, 4))}
    if kind == "format":
        fmt = r.choice(FORMATS)
        return {"type": "string", "format": fmt, **({"maxLength": 24} if fmt == "email" else {})}
    if kind == "integer":
        lo = r.randint(-100, 100)
        return {"type": "integer", "minimum": lo, "maximum": lo + r.randint(0, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": -5, "maximum": 5, "multipleOf": r.choice([0.5, 0.25, 1])}
    if kind == "const":
        return {"const": r.choice(["fixed", 7, True, None])}
    return {"type": kind}


def _node(r: random.Random, depth: int) -> dict:
    roll = r.random()
    if depth <= 0 or roll < 0.4:
        return _leaf(r)
    if roll < 0.65:
        return _object(r, depth - 1)
    if roll < 0.85:
        return {"type": "array", "items": _node(r, depth - 1), "minItems": r.randint(0, 1), "maxItems": r.randint(1, 3)}
    return {"anyOf": [_node(r, depth - 1), _leaf(r)]}


def _object(r: random.Random, depth: int) -> dict:
    names = r.sample(["id", "name", "kind", "items", "when", "score", "meta", "ok", "note"], r.randint(1, 4))
    props = {n: _node(r, depth) for n in names}
    return {"type": "object", "properties": props, "required": r.sample(names, r.randint(0, len(names))),
            "additionalProperties": False}


def generated(i: int) -> dict:
    r = random.Random(i)
    schema = _object(r, 3)
    if i % 5 == 0:  # a recursive part through $defs / $ref, bounded by maxItems and optional properties
        schema["$defs"] = {"node": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0,
                                                                         "maximum": 9},
                                                                   "kids": {"type": "array", "maxItems": 2,
                                                                            "items": {"$ref": "#/$defs/node"}}},
                                    "required": ["v"], "additionalProperties": False}}
        schema["properties"]["tree"] = {"$ref": "#/$defs/node"}
    return schema


def test_two_hundred_generated_schemas_every_reply_validates(tmp_path):
    checker = jsonschema.FormatChecker()
    bad = []
    with make_client(tmp_path) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        for i in range(200):
            schema = generated(i)
            r = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"Case {i}"}], "max_tokens": 600, "temperature": 1.0,
                "seed": i, "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}",
                                                                                    "schema": schema}}})
            assert r.status_code == 200, (i, r.text[:300])
            choice = r.json()["choices"][0]
            try:
                assert choice["finish_reason"] == "stop", "cut by max_tokens"
                jsonschema.validate(json.loads(choice["message"]["content"]), schema, format_checker=checker)
            except (AssertionError, ValueError, jsonschema.ValidationError) as e:
                bad.append((i, str(e)[:200], choice["message"]["content"][:200]))
    assert not bad, bad[:5]
