"""A forced or chosen call's arguments are decoded under the tool's parameters schema: on a tiny random-weight model,
sampling on, they always parse and validate (without the grammar such a model writes anything). Chat, its stream and
Messages; tool_choice named and required among several; a schema that cannot be kept is a 422 naming the tool."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI

ORDER = {"type": "object", "properties": {
    "order_id": {"type": "string", "pattern": "^[0-9]{4}$"},
    "reason": {"enum": ["damaged", "late", "unwanted"]},
    "refund": {"type": "boolean"},
    "items": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "maxItems": 3},
    "note": {"type": "string", "maxLength": 8}},
    "required": ["order_id", "reason", "refund"], "additionalProperties": False}
TRACK = {"type": "object", "properties": {"order_id": {"type": "integer", "minimum": 1000, "maximum": 9999}},
         "required": ["order_id"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "refund_order", "description": "Refund an order",
                                           "parameters": ORDER}},
         {"type": "function", "function": {"name": "track_order", "description": "Where an order is",
                                           "parameters": TRACK}}]
SCHEMAS = {"refund_order": ORDER, "track_order": TRACK}
ASK = [{"role": "user", "content": "Refund order 1234, it came broken."}]


@pytest.fixture
def sdk(client):
    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


def valid(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


@pytest.mark.parametrize("seed", range(4))
def test_a_named_call_validates_under_the_tools_schema_with_sampling_on(sdk, seed):
    out = sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=96, temperature=1.0,
                                      seed=seed, tool_choice={"type": "function", "function": {"name": "refund_order"}})
    choice = out.choices[0]
    [call] = choice.message.tool_calls
    assert call.function.name == "refund_order" and choice.finish_reason == "tool_calls"
    valid("refund_order", call.function.arguments)


@pytest.mark.parametrize("seed", range(3))
def test_required_among_several_validates_under_the_chosen_tools_schema(sdk, seed):
    out = sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=96, temperature=1.0,
                                      seed=seed, tool_choice="required")
    [call] = out.choices[0].message.tool_calls
    valid(call.function.name, call.function.arguments)


def test_a_streamed_forced_call_validates(sdk):
    stream = sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=96, temperature=1.0,
                                         seed=7, stream=True,
                                         tool_choice={"type": "function", "function": {"name": "track_order"}})
    args, names = "", set()
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            names.add(d.function.name) if d.function.name else None
            args += d.function.arguments or ""
    assert names == {"track_order"}
    valid("track_order", args)


def test_anthropics_forced_tool_input_validates(client):
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    r = client.post("/v1/messages", json={"model": "m", "max_tokens": 96, "temperature": 1.0, "messages": ASK,
                                          "tools": tools, "tool_choice": {"type": "tool", "name": "refund_order"}})
    assert r.status_code == 200, r.text
    [use] = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert use["name"] == "refund_order" and r.json()["stop_reason"] == "tool_use"
    jsonschema.validate(use["input"], ORDER)


def test_a_typed_reply_beside_a_forced_call_is_the_call_and_beside_auto_a_422(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}
    body = {"model": "m", "messages": ASK, "tools": TOOLS, "max_tokens": 96, "response_format": fmt}
    r = client.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
    assert r.status_code == 200, r.text
    [call] = r.json()["choices"][0]["message"]["tool_calls"]
    valid(call["function"]["name"], call["function"]["arguments"])
    auto = client.post("/v1/chat/completions", json=body)
    assert auto.status_code == 422 and "tool_choice auto" in auto.json()["error"]["message"]


def test_a_forced_tools_schema_that_cannot_be_kept_is_a_422_naming_it(client):
    bad = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}}, "required": ["a"]}}}
    body = {"model": "m", "messages": ASK, "tools": [TOOLS[0], bad], "max_tokens": 8}
    for choice in ("required", {"type": "function", "function": {"name": "odd"}}):
        r = client.post("/v1/chat/completions", json={**body, "tool_choice": choice})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["message"].startswith("tools.1.function.parameters: ")
    # not forced: the model may call it or not, as before (its arguments are parsed, not decoded under the schema)
    named = client.post("/v1/chat/completions", json={**body, "tool_choice": {"type": "function",
                                                                              "function": {"name": "refund_order"}}})
    auto = client.post("/v1/chat/completions", json=body)
    assert named.status_code == 200 and auto.status_code == 200
