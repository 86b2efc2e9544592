"""SkillcacheClient against a fake server: request shapes, results, streaming and error mapping."""

from __future__ import annotations

import json

import httpx
import pytest
from skillcache_client import SkillcacheClient, SkillcacheError
from skillcache_fakes import DONE_EVENT, FakeServer, skill_record, sse, stream_response


def make(server: FakeServer, **kw) -> SkillcacheClient:
    return SkillcacheClient("http://sc.test:9000", transport=server.transport(), **kw)


def test_add_skill_body_omits_none(server: FakeServer) -> None:
    server.on("POST", "/v1/skills", lambda r: httpx.Response(201, json=skill_record("a")))
    with make(server) as c:
        assert c.add_skill("a", "text")["version"] == 1
        assert server.last_json() == {"name": "a", "text": "text"}
        c.add_skill("a", "t {{x}}", description="d", fields={"x": "1"})
        assert server.last_json() == {"name": "a", "text": "t {{x}}", "description": "d", "fields": {"x": "1"}}
    assert server.last.url == "http://sc.test:9000/v1/skills"
    assert server.last.headers["content-type"] == "application/json"
    assert "authorization" not in server.last.headers


def test_api_key_is_a_bearer_token(server: FakeServer) -> None:
    server.on("GET", "/v1/skills", {"skills": []})
    with make(server, api_key="s3cret") as c:
        assert c.list_skills() == []
    assert server.last.headers["authorization"] == "Bearer s3cret"
    assert server.last.headers["user-agent"].startswith("skillcache-client/")


def test_base_url_path_prefix_is_kept(server: FakeServer) -> None:
    server.on("GET", "/api/v1/skills", {"skills": [skill_record("a")]})
    with SkillcacheClient("http://sc.test/api/", transport=server.transport()) as c:
        assert [s["name"] for s in c.list_skills()] == ["a"]


def test_get_and_delete(server: FakeServer) -> None:
    server.on("GET", "/v1/skills/refund-policy", lambda r: httpx.Response(200, json=skill_record(
        "refund-policy", version=int(r.url.params.get("version", 3)))))
    server.on("DELETE", "/v1/skills/refund-policy", {"deleted": "refund-policy", "versions": [1, 2, 3]})
    with make(server) as c:
        assert c.get_skill("refund-policy")["version"] == 3
        assert "version" not in server.last.url.params
        assert c.get_skill("refund-policy", version=2)["version"] == 2
        assert server.last.url.params["version"] == "2"
        assert c.delete_skill("refund-policy") == {"deleted": "refund-policy", "versions": [1, 2, 3]}


def test_compose_body(server: FakeServer) -> None:
    server.on("POST", "/v1/compose", {"text": "APPROVE", **{k: v for k, v in DONE_EVENT.items() if k != "type"}})
    with make(server) as c:
        out = c.compose(["refund-policy", {"name": "style-guide", "version": 2}], "Refund?")
        assert out["text"] == "APPROVE" and out["usage"]["prompt_tokens"] == 900
        assert server.last_json() == {
            "skills": ["refund-policy", {"name": "style-guide", "version": 2}], "user": "Refund?", "stream": False,
        }
        c.compose("refund-policy", "u", system="s", fields={"order_status": "shipped"}, max_tokens=8,
                  temperature=0.0, top_p=0.9, seed=0, stop=["\n"], mode="full", seam_tokens=0,
                  logprobs=5, edit_mode="erratum")
        assert server.last_json() == {
            "skills": ["refund-policy"], "user": "u", "stream": False, "system": "s",
            "fields": {"order_status": "shipped"}, "max_tokens": 8, "temperature": 0.0, "top_p": 0.9,
            "seed": 0, "stop": ["\n"], "mode": "full", "seam_tokens": 0, "logprobs": 5, "edit_mode": "erratum",
        }
        c.compose([{"name": "a", "version": None}], "u")
        assert server.last_json()["skills"] == [{"name": "a"}]
        with pytest.raises(TypeError):
            c.compose([3], "u")  # type: ignore[list-item]


@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_compose_stream(server: FakeServer, chunk: int | None) -> None:
    body = sse({"type": "delta", "text": "APPR"}, {"type": "delta", "text": "OVE ✓"}, DONE_EVENT)
    server.on("POST", "/v1/compose", lambda r: stream_response(body, chunk))
    with make(server) as c:
        events = list(c.compose_stream(["refund-policy"], "Refund?", max_tokens=4))
    assert server.last_json()["stream"] is True and server.last_json()["max_tokens"] == 4
    assert "".join(e["text"] for e in events if e["type"] == "delta") == "APPROVE ✓"  # split UTF-8 survives
    assert events[-1] == DONE_EVENT


def test_compose_stream_error_before_streaming(server: FakeServer) -> None:
    server.on("POST", "/v1/compose", lambda r: stream_response(
        b'{"error": {"type": "skill_not_found", "message": "no skill \'nope\'"}}', 4, status=404,
        content_type="application/json"))
    with make(server) as c, pytest.raises(SkillcacheError) as ei:
        list(c.compose_stream(["nope"], "hi"))
    assert (ei.value.status, ei.value.error_type, ei.value.message) == (404, "skill_not_found", "no skill 'nope'")
    assert not ei.value.streamed


def test_compose_stream_error_event(server: FakeServer) -> None:
    body = sse({"type": "delta", "text": "Hi"},
               {"type": "error", "error": {"type": "internal_error", "message": "generation failed"}}, done=False)
    server.on("POST", "/v1/compose", lambda r: stream_response(body, 3))
    got = []
    with make(server) as c, pytest.raises(SkillcacheError) as ei:
        for ev in c.compose_stream(["a"], "hi"):
            got.append(ev)
    assert got == [{"type": "delta", "text": "Hi"}]
    assert (ei.value.error_type, ei.value.streamed) == ("internal_error", True)


@pytest.mark.parametrize(
    ("status", "body", "headers", "expected"),
    [
        (404, {"error": {"type": "skill_not_found", "message": "no skill 'x'"}}, {},
         ("skill_not_found", "no skill 'x'")),
        (429, {"error": {"type": "overloaded", "message": "busy"}}, {"Retry-After": "3"}, ("overloaded", "busy")),
        (422, {"detail": [{"loc": ["body", "user"], "msg": "Field required"}]}, {},
         ("invalid_request", "user: Field required")),
        (405, {"detail": "Method Not Allowed"}, {}, ("http_error", "Method Not Allowed")),
        (502, "<html>Bad Gateway</html>", {}, ("http_error", "<html>Bad Gateway</html>")),
        (500, "", {}, ("http_error", "HTTP 500")),
    ],
)
def test_error_mapping(server: FakeServer, status, body, headers, expected) -> None:
    content = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    server.on("GET", "/v1/skills/x", httpx.Response(status, content=content, headers=headers))
    with make(server) as c, pytest.raises(SkillcacheError) as ei:
        c.get_skill("x")
    assert ei.value.status == status
    assert (ei.value.error_type, ei.value.message) == expected
    assert ei.value.retry_after == (3.0 if headers else None)


def test_non_json_success_is_bad_response(server: FakeServer) -> None:
    server.on("GET", "/v1/skills", httpx.Response(200, text="hello"))
    with make(server) as c, pytest.raises(SkillcacheError) as ei:
        c.list_skills()
    assert ei.value.error_type == "bad_response"


def test_health_returns_body_on_503_and_live(server: FakeServer) -> None:
    server.on("GET", "/readyz", httpx.Response(503, json={"status": "loading", "model": False}))
    server.on("GET", "/livez", {"status": "ok"})
    with make(server) as c:
        assert c.health() == {"status": "loading", "model": False}
        assert c.live() is True
    server.on("GET", "/livez", httpx.Response(500, text="boom"))
    with make(server) as c:
        assert c.live() is False


def test_transport_errors(server: FakeServer) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    with SkillcacheClient("http://sc.test", transport=httpx.MockTransport(refuse)) as c:
        assert c.live() is False
        with pytest.raises(SkillcacheError) as ei:
            c.list_skills()
        assert (ei.value.status, ei.value.error_type) == (0, "connection_error")
        with pytest.raises(SkillcacheError) as ei:
            list(c.compose_stream(["a"], "hi"))
        assert ei.value.error_type == "connection_error"
    with SkillcacheClient("http://sc.test", transport=httpx.MockTransport(slow)) as c:
        with pytest.raises(SkillcacheError) as ei:
            c.health()
        assert ei.value.error_type == "timeout"
