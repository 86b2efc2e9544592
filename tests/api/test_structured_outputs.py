"""Typed outputs on the embedded engine (tiny random-weight model, sampling on): Chat's response_format and
Responses' text.format through the official openai SDK's parse helpers, Messages' output_config.format; the reply
always parses and validates, streamed or not, composed skills or not. Schemas llguidance cannot compile, or that
nothing satisfies, are a 422 naming the keyword."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field, StringConstraints

from appclient import make_client

from service.api.structured import schema_text
from service.errors import InvalidRequest

Short = Annotated[str, StringConstraints(max_length=6)]


class Weather(BaseModel):
    city: Literal["Oslo", "Paris", "Rome"]
    temp_c: int = Field(ge=-40, le=50)
    rain: bool
    tags: list[Short] = Field(max_length=3)


def strict_schema() -> dict:
    """Weather's schema as the openai SDK sends it (strict: no properties beyond those named; a random model would
    otherwise add keys with strings of any length until max_tokens)."""
    from openai.lib._pydantic import to_strict_json_schema

    return to_strict_json_schema(Weather)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with make_client(tmp_path_factory.mktemp("structured")) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        assert c.post("/v1/skills", json={"name": "policy", "text": "Answer about the weather."}).status_code \
            in (200, 201)
        yield c


@pytest.fixture(scope="module")
def sdk(client):
    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


def test_chat_parse_returns_the_model_every_time_with_sampling_on(sdk):
    for seed in range(4):
        r = sdk.chat.completions.parse(model="m", messages=[{"role": "user", "content": "Weather?"}],
                                       response_format=Weather, temperature=1.0, seed=seed, max_tokens=200,
                                       extra_body={"skills": ["policy"]} if seed % 2 else None)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", msg.content
        assert isinstance(msg.parsed, Weather), msg.content


def test_chat_json_object_and_a_stream_are_json(sdk):
    r = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "JSON please"}], seed=3,
                                    response_format={"type": "json_object"}, temperature=1.0, max_tokens=300)
    if r.choices[0].finish_reason == "stop":  # a random model may fill max_tokens inside a long string
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    schema = strict_schema()
    stream = sdk.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Weather?"}], temperature=0.7, seed=5, max_tokens=200,
        stream=True, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), schema)


def test_responses_parse_returns_the_model(sdk):
    r = sdk.responses.parse(model="m", input="Weather?", text_format=Weather, temperature=1.0, max_output_tokens=200)
    assert isinstance(r.output_parsed, Weather), r.output_text
    assert r.text.format.type == "json_schema"  # echoed as applied


def test_messages_output_config_format_is_json_valid_under_the_schema(client):
    schema = strict_schema()
    r = client.post("/v1/messages", json={
        "model": "m", "max_tokens": 200, "temperature": 1.0, "messages": [{"role": "user", "content": "Weather?"}],
        "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["content"][0]["text"]), schema)


@pytest.mark.parametrize("schema, says", [
    ({"type": "object", "if": {}, "then": {}}, "if"),
    ({"type": "string", "format": "weird"}, "weird"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "Unsatisfiable"),
    ({"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False}, "Unsatisfiable"),
    ({"enum": []}, "Unsatisfiable"),
    (False, "Unsatisfiable"),
    ("a string", "object"),
])
def test_a_schema_that_cannot_be_kept_is_refused_naming_why(schema, says):
    with pytest.raises(InvalidRequest) as e:
        schema_text("response_format.json_schema.schema", schema)
    assert e.value.message.startswith("response_format.json_schema.schema") and says in e.value.message


def test_pathological_schemas_are_typed_4xx_without_a_hang(client, sdk):
    deep = '{"type": "object", "properties": {"a": ' * 2000 + "{}" + "}}" * 2000  # JSON text: no recursion here
    huge = json.dumps({"enum": [f"v{i}" for i in range(30000)]})
    for schema in (deep, huge):
        body = ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "response_format": '
                '{"type": "json_schema", "json_schema": {"name": "s", "schema": ' + schema + "}}}")
        r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text[:300]
    bad = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                     "response_format": {"type": "xml"}})
    assert bad.status_code == 422 and "response_format.type" in bad.json()["error"]["message"]
    both = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
    assert both.status_code == 422 and both.json()["error"]["message"].startswith("response_format")


def test_the_grammar_vocabulary_is_built_once_and_off_the_model_thread(tmp_path, monkeypatch):
    """llguidance's view of a 49k-id tokenizer takes seconds to build: built on the serving loop's thread at a typed
    request's first sample, it stalled every stream decoding then (measured on make run: the first typed reply took
    4.8 s where later ones take 0.7 s). It is built in a worker thread before the request is submitted, once."""
    import threading

    import llguidance.hf

    from service.runtime import grammar

    built = []
    real = llguidance.hf.from_tokenizer

    def spy(*a, **kw):
        built.append(threading.current_thread().name)
        return real(*a, **kw)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", spy)
    monkeypatch.setattr(grammar, "_TOKENIZERS", grammar.weakref.WeakKeyDictionary())
    with make_client(tmp_path) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        loop_thread = c.app.state.skillcache.engine.thread.name
        for i in range(3):
            r = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"JSON {i}"}], "max_tokens": 40, "temperature": 1.0,
                "seed": i, "response_format": {"type": "json_schema", "json_schema": {"name": "w",
                                                                                    "schema": strict_schema()}}})
            assert r.status_code == 200, r.text
    assert len(built) == 1 and built[0] != loop_thread, (built, loop_thread)
