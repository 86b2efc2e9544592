"""The SSE parser and the /v1/compose event protocol, fed in every chunking."""

from __future__ import annotations

import json

import pytest
from skillcache_client._sse import ComposeStream, SSEParser
from skillcache_client.errors import SkillcacheError

SSE_HEADERS = {"content-type": "text/event-stream; charset=utf-8"}


def parse_all(text: str, size: int) -> list[str]:
    p = SSEParser()
    out: list[str] = []
    for i in range(0, len(text), size):
        out.extend(p.feed(text[i:i + size]))
    out.extend(p.flush())
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("eol", ["\n", "\r\n", "\r"])
def test_parser_any_chunking_and_line_ends(size: int, eol: str) -> None:
    text = eol.join([
        ": keep-alive comment", "", "data: one", "", "event: message", "id: 7", "retry: 100",
        "data: line1", "data:line2", "data:  two spaces", "", "data", "", "data: [DONE]", "", "",
    ])
    assert parse_all(text, size) == ["one", "line1\nline2\n two spaces", "", "[DONE]"]


def test_parser_blank_lines_alone_dispatch_nothing() -> None:
    assert parse_all("\n\n\n: c\n\n", 1) == []


def test_parser_flushes_unterminated_last_event() -> None:
    assert parse_all("data: a\n\ndata: b", 3) == ["a", "b"]
    assert parse_all("data: a\n\ndata: b\n", 3) == ["a", "b"]


def feed_all(stream: ComposeStream, text: str, size: int) -> list[dict]:
    events: list[dict] = []
    for i in range(0, len(text), size):
        events.extend(stream.feed(text[i:i + size]))
        if stream.finished:
            break
    events.extend(stream.close())
    return events


@pytest.mark.parametrize("size", [1, 5, 4096])
def test_compose_stream_deltas_then_done(size: int) -> None:
    delta = json.dumps({"type": "delta", "text": "APP"})
    body = f"data: {delta}\n\ndata: {{\"type\": \"delta\",\ndata:  \"text\": \"ROVE\"}}\n\n" \
           'data: {"type": "done", "finish_reason": "stop"}\n\ndata: [DONE]\n\n'
    events = feed_all(ComposeStream(200, SSE_HEADERS), body, size)
    assert events == [
        {"type": "delta", "text": "APP"}, {"type": "delta", "text": "ROVE"},
        {"type": "done", "finish_reason": "stop"},
    ]


def test_compose_stream_ignores_anything_after_done_sentinel() -> None:
    body = 'data: {"type": "done"}\n\ndata: [DONE]\n\ndata: not json\n\n'
    assert feed_all(ComposeStream(200, SSE_HEADERS), body, 1000) == [{"type": "done"}]


def test_compose_stream_done_without_sentinel_is_fine() -> None:
    body = 'data: {"type": "delta", "text": "x"}\n\ndata: {"type": "done"}\n\n'
    assert [e["type"] for e in feed_all(ComposeStream(200, SSE_HEADERS), body, 4)] == ["delta", "done"]


def test_compose_stream_error_event_after_deltas() -> None:
    stream = ComposeStream(200, SSE_HEADERS)
    body = 'data: {"type": "delta", "text": "Hel"}\n\n' \
           'data: {"type": "error", "error": {"type": "overloaded", "message": "queue full"}}\n\n'
    got: list[dict] = []
    with pytest.raises(SkillcacheError) as ei:
        for ev in stream.feed(body):
            got.append(ev)
    assert got == [{"type": "delta", "text": "Hel"}]  # the delta before the error still arrives
    e = ei.value
    assert (e.status, e.error_type, e.message, e.streamed) == (200, "overloaded", "queue full", True)
    assert str(e) == "overloaded: queue full"


def test_compose_stream_truncated_raises_incomplete() -> None:
    with pytest.raises(SkillcacheError) as ei:
        feed_all(ComposeStream(200, SSE_HEADERS), 'data: {"type": "delta", "text": "x"}\n\n', 3)
    assert ei.value.error_type == "incomplete_stream"


def test_compose_stream_bad_json() -> None:
    with pytest.raises(SkillcacheError) as ei:
        feed_all(ComposeStream(200, SSE_HEADERS), "data: {nope\n\n", 100)
    assert ei.value.error_type == "bad_stream"


def test_compose_stream_error_status_body() -> None:
    stream = ComposeStream(404, {"content-type": "application/json"})
    with pytest.raises(SkillcacheError) as ei:
        feed_all(stream, '{"error": {"type": "skill_not_found", "message": "no skill \'x\'"}}', 5)
    assert (ei.value.status, ei.value.error_type) == (404, "skill_not_found")


def test_compose_stream_accepts_plain_json_reply() -> None:
    stream = ComposeStream(200, {"content-type": "application/json"})
    events = feed_all(stream, json.dumps({"text": "DENY", "finish_reason": "stop", "usage": {}}), 4)
    assert events == [{"type": "delta", "text": "DENY"}, {"type": "done", "finish_reason": "stop", "usage": {}}]
