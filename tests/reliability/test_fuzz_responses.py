"""Bad input to POST /v1/responses: schemathesis over its OpenAPI operation against a real uvicorn (no 5xx,
responses match the schema), and hand-written malformed items and hostile bodies: each a typed 4xx, never a 5xx."""

from __future__ import annotations

import httpx
import pytest

from conftest import ADMIN, app_client, bearer, documented_error_types, uvicorn_thread, write_keys
from fuzzing import fuzz, report

TEXT = "Refunds are allowed within 30 days of delivery when the item is unused."
OP = "POST /v1/responses"
EXAMPLES = 40  # x 2 modes, one operation: ~80 requests on the tiny model, well under a minute


def test_schemathesis_responses_no_server_errors_and_responses_match_the_schema(tmp_path):
    with uvicorn_thread(tmp_path, api_keys_file=write_keys(tmp_path / "keys.json"), max_tokens_cap=16,
                        max_skills_per_request=4) as (url, _app):
        auth = bearer(ADMIN)
        assert httpx.post(f"{url}/v1/skills", json={"name": "a", "text": TEXT}, headers=auth).status_code == 201
        n_cases, statuses, failures = fuzz(url, {OP}, auth, EXAMPLES)
        print(f"schemathesis: {n_cases} requests on {OP};", sorted(statuses[OP]))
        assert not failures, report(failures)
        assert n_cases >= 40 and 422 in statuses[OP]
        assert httpx.get(f"{url}/readyz").status_code == 200  # still serving


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with app_client(tmp_path_factory.mktemp("fuzz-responses"), max_body_bytes=1_000_000) as c:
        yield c


_CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
HOSTILE = [
    b"not json", b"", b"[1, 2]", b"null", b'{"input": "hi", "temperature": NaN}',
    b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # deep nesting
    b'{"input": "\xff\xfe"}',  # invalid UTF-8
]
HOSTILE_JSON = [
    {"input": [{"type": "message", "role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
    {"input": [{"type": "message", "role": "robot", "content": "x"}]},
    {"input": [{"type": "reasoning", "summary": []}]},
    {"input": [{"type": "function_call_output", "call_id": "", "output": "x"}]},
    {"input": [{"type": "function_call_output", "call_id": "c1", "output": {"nested": 1}}]},
    {"input": [_CALL, {"type": "function_call_output", "call_id": "c1", "output": "x"}], "tools": [{"x": 1}]},
    {"input": [{"role": "user", "content": "q"}, _CALL, _CALL,
               {"type": "function_call_output", "call_id": "c1", "output": "x"}]},  # a call id twice
    {"input": [{"role": "user", "content": "q"}, {**_CALL, "name": "bad name!"}]},
    {"input": [{"role": "user", "content": "q"}, {**_CALL, "arguments": {"a": 1}}]},
    {"input": [{"role": "user", "content": "x"}] * 1025},
    {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "not an object"}]},
    {"input": "hi", "tools": [{"type": "function", "name": "f", "extra": 1}]},
    {"input": "hi", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
    {"input": "hi", "tool_choice": {"type": "function", "name": "g"}, "tools": [{"type": "function", "name": "f"}]},
    {"input": "hi", "include": ["x"] * 100},
    {"input": "hi", "metadata": {"k": "v" * 10_000}},
    {"input": "hi", "skills": ["nope"]},
    {"input": "hi", "skills": "a"},
    {"input": "hi", "max_output_tokens": 10**40},
    {"input": "hi", "reasoning": {"effort": "bogus"}},
    {"input": "hi", "stream": "yes"},
]


@pytest.mark.parametrize("content", HOSTILE, ids=[f"raw{i}" for i in range(len(HOSTILE))])
def test_hostile_bytes_are_a_clean_4xx(client, content):
    r = client.post("/v1/responses", content=content, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert r.json()["error"]["type"] in documented_error_types()


@pytest.mark.parametrize("body", HOSTILE_JSON, ids=[f"json{i}" for i in range(len(HOSTILE_JSON))])
def test_malformed_items_are_a_typed_4xx(client, body):
    r = client.post("/v1/responses", json=body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert r.json()["error"]["type"] in documented_error_types(), r.text
    assert client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1}).status_code == 200
