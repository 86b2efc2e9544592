"""AsyncSkillcacheClient: the same protocol, awaited (run with asyncio.run; no plugin needed)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from skillcache_client import AsyncSkillcacheClient, SkillcacheError
from skillcache_fakes import DONE_EVENT, FakeServer, skill_record, sse, stream_response


def make(server: FakeServer) -> AsyncSkillcacheClient:
    return AsyncSkillcacheClient("http://sc.test", api_key="k", transport=server.transport())


def test_async_crud_and_health(server: FakeServer) -> None:
    server.on("POST", "/v1/skills", lambda r: httpx.Response(201, json=skill_record("a")))
    server.on("GET", "/v1/skills", {"skills": [skill_record("a")]})
    server.on("GET", "/v1/skills/a", skill_record("a", version=2))
    server.on("DELETE", "/v1/skills/a", {"deleted": "a", "versions": [1, 2]})
    server.on("GET", "/readyz", httpx.Response(503, json={"status": "not_ready"}))
    server.on("GET", "/livez", {"status": "ok"})

    async def run() -> None:
        async with make(server) as c:
            assert (await c.add_skill("a", "t", fields={"f": "v"}))["name"] == "a"
            assert server.last_json() == {"name": "a", "text": "t", "fields": {"f": "v"}}
            assert server.last.headers["authorization"] == "Bearer k"
            assert len(await c.list_skills()) == 1
            assert (await c.get_skill("a", version=2))["version"] == 2
            assert server.last.url.params["version"] == "2"
            assert (await c.delete_skill("a"))["versions"] == [1, 2]
            assert (await c.health())["status"] == "not_ready"
            assert await c.live() is True
            with pytest.raises(SkillcacheError) as ei:
                await c.get_skill("missing")
            assert ei.value.status == 404

    asyncio.run(run())


def test_async_compose_and_stream(server: FakeServer) -> None:
    body = sse({"type": "delta", "text": "DE"}, {"type": "delta", "text": "NY"}, DONE_EVENT)
    server.on("POST", "/v1/compose", lambda r: stream_response(body, 5) if b'"stream": true' in r.content
              or b'"stream":true' in r.content else httpx.Response(200, json={"text": "DENY"}))

    async def run() -> None:
        async with make(server) as c:
            assert (await c.compose(["a"], "u", temperature=0.5))["text"] == "DENY"
            assert server.last_json() == {"skills": ["a"], "user": "u", "stream": False, "temperature": 0.5}
            events = [e async for e in c.compose_stream(["a"], "u", fields={"x": "y"})]
            assert server.last_json()["fields"] == {"x": "y"}
            assert [e["type"] for e in events] == ["delta", "delta", "done"]
            assert "".join(e.get("text", "") for e in events) == "DENY"

    asyncio.run(run())


def test_async_stream_error_event(server: FakeServer) -> None:
    body = sse({"type": "error", "error": {"type": "context_too_long", "message": "8300 > 8192"}}, done=False)
    server.on("POST", "/v1/compose", lambda r: stream_response(body, 2))

    async def run() -> None:
        async with make(server) as c:
            with pytest.raises(SkillcacheError) as ei:
                async for _ in c.compose_stream(["a"], "u"):
                    pass
            assert (ei.value.error_type, ei.value.message) == ("context_too_long", "8300 > 8192")

    asyncio.run(run())


def test_async_transport_error() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async def run() -> None:
        async with AsyncSkillcacheClient("http://sc.test", transport=httpx.MockTransport(refuse)) as c:
            assert await c.live() is False
            with pytest.raises(SkillcacheError) as ei:
                await c.list_skills()
            assert ei.value.error_type == "connection_error"

    asyncio.run(run())
