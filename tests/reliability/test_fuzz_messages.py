"""Hostile input to the Messages API (POST /v1/messages): schemathesis over its OpenAPI operation against a real
uvicorn (no 5xx, statuses and responses as documented), and hand-written malformed blocks: each a typed 4xx in
Anthropic's error shape, and the service still answers after it."""

from __future__ import annotations

import httpx
import pytest

from conftest import ADMIN, app_client, bearer, documented_error_types, uvicorn_thread, write_keys
from fuzzing import fuzz, report

OP = "POST /v1/messages"
EXAMPLES_PER_MODE = 60  # x 2 modes: bounded to well under a minute on the tiny model


def test_schemathesis_on_messages_no_server_errors_and_responses_match_the_schema(tmp_path):
    def anthropic_shaped(response):
        if 400 <= response.status_code < 500 and response.headers["content-type"] == "application/json":
            body = response.json()
            assert body["type"] == "error" and body["error"]["error_type"] in documented_error_types(), body

    with uvicorn_thread(tmp_path, api_keys_file=write_keys(tmp_path / "keys.json"), max_tokens_cap=8,
                        max_skills_per_request=4) as (url, _app):
        n_cases, statuses, failures = fuzz(url, {OP}, {"x-api-key": ADMIN}, EXAMPLES_PER_MODE, anthropic_shaped)
        print(f"schemathesis {OP}: {n_cases} requests, statuses {sorted(statuses[OP])}")
        assert not failures, report(failures)
        assert n_cases >= 60 and 422 in statuses[OP]
        assert httpx.get(f"{url}/readyz").status_code == 200  # still serving


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with app_client(tmp_path_factory.mktemp("fuzz-messages"), max_body_bytes=1_000_000) as c:
        yield c


_USER = [{"role": "user", "content": "x"}]


def _body(**kw) -> dict:
    return {"model": "m", "max_tokens": 2, "messages": _USER, **kw}


def _user(*blocks) -> dict:
    return _body(messages=[{"role": "user", "content": list(blocks)}])


_CALL = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}
HOSTILE = [
    # (request kwargs, expected Anthropic type, expected error_type)
    ({"content": b"not json", "headers": {"content-type": "application/json"}}, "invalid_request_error",
     "invalid_request"),
    ({"content": b"\xc3\x28", "headers": {"content-type": "application/json"}}, "invalid_request_error",
     "invalid_request"),
    ({"json": [1, 2]}, "invalid_request_error", "invalid_request"),
    ({"content": b'{"model": "' + b"m" * 1_000_000 + b'"}', "headers": {"content-type": "application/json"}},
     "request_too_large", "limit_exceeded"),  # over max_body_bytes: the size limit answers in Anthropic's shape too
    ({"json": {"model": "m", "messages": _USER}}, "invalid_request_error", "invalid_request"),  # no max_tokens
    ({"json": _body(max_tokens=0)}, "invalid_request_error", "invalid_request"),
    ({"json": _body(max_tokens=900_000)}, "request_too_large", "limit_exceeded"),  # over the cap
    ({"json": _body(messages=[])}, "invalid_request_error", "invalid_request"),
    ({"json": _body(messages="hi")}, "invalid_request_error", "invalid_request"),
    ({"json": _user({"type": "text"})}, "invalid_request_error", "invalid_request"),  # no text
    ({"json": _user({"type": "text", "text": 5})}, "invalid_request_error", "invalid_request"),
    ({"json": _user({"type": "video"})}, "invalid_request_error", "invalid_request"),  # unknown block type
    ({"json": _user({"text": "no type"})}, "invalid_request_error", "invalid_request"),
    ({"json": _user("a string, not a block")}, "invalid_request_error", "invalid_request"),
    ({"json": _user({"type": "image", "source": {"type": "base64", "data": "AAAA"}})}, "invalid_request_error",
     "invalid_request"),
    ({"json": _user({"type": "tool_result", "tool_use_id": "t1", "content": "r"})}, "invalid_request_error",
     "invalid_request"),  # answers no call
    ({"json": _body(messages=[*_USER, _CALL, *_USER])}, "invalid_request_error", "invalid_request"),  # unanswered
    ({"json": _body(messages=[*_USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "bad name!", "input": {}}]}])}, "invalid_request_error",
     "invalid_request"),
    ({"json": _body(messages=[*_USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": "not an object"}]}])}, "invalid_request_error",
     "invalid_request"),
    ({"json": _body(system=[{"type": "image", "source": {}}])}, "invalid_request_error", "invalid_request"),
    ({"json": _body(system=[{"type": "text", "text": "x", "cache_control": {"type": "forever"}}])},
     "invalid_request_error", "invalid_request"),
    ({"json": _body(system=[{"type": "text", "text": "", "cache_control": {"type": "ephemeral"}}])},
     "invalid_request_error", "invalid_request"),
    ({"json": _body(tools=[{"name": "f", "input_schema": "object"}])}, "invalid_request_error", "invalid_request"),
    ({"json": _body(tool_choice={"type": "any"})}, "invalid_request_error", "invalid_request"),  # no tools
    ({"json": _body(tool_choice={"type": "sometimes"})}, "invalid_request_error", "invalid_request"),
    ({"json": _body(stop_sequences=[""])}, "invalid_request_error", "invalid_request"),
    ({"json": _body(skills=["nope"])}, "not_found_error", "skill_not_found"),
    ({"json": _body(skills=["a", "b", "c", "d", "e"] * 60)}, "invalid_request_error", "invalid_request"),
    ({"json": _body(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}] * 5000}])},
     "invalid_request_error", "invalid_request"),
]


@pytest.mark.parametrize("kw, atype, etype", HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_malformed_messages_are_a_typed_4xx_in_anthropics_shape(client, kw, atype, etype):
    r = client.post("/v1/messages", **kw)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == atype, body
    assert body["error"]["error_type"] == etype and body["error"]["message"], body
    ok = client.post("/v1/messages", json=_body(), headers=bearer(ADMIN))
    assert ok.status_code == 200 and ok.json()["type"] == "message", ok.text
