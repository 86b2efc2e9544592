"""Sessions with tools: the tools block composed into the head once, forced calls kept in the transcript, tool
results as a turn, OpenAI's rules for them, and a resumed session that keeps its tools."""

import pytest
import torch

from appclient import make_client
from service.tools.spec import Tool, ToolsParams

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture
def app(tmp_path):
    with make_client(tmp_path) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        yield c


def _session(app, **extra):
    r = app.post("/v1/sessions", json={"tools": [WEATHER], **extra})
    assert r.status_code == 201, r.text
    return r.json()


def test_a_tool_loop_in_a_session_reuses_the_cache_and_keeps_the_calls(app):
    s = _session(app)
    sid, n0 = s["id"], s["n_tokens"]
    assert s["tools"] == [WEATHER] and s["usage"]["reused_tokens"] > 0  # the tools block was copied into the head
    r = app.post(f"/v1/sessions/{sid}/turns", json={"user": "Weather in Oslo?", "tool_choice": NAMED,
                                                    "max_tokens": 12}).json()
    [call] = r["tool_calls"]
    assert call["function"]["name"] == "get_weather" and r["usage"]["reused_tokens"] >= n0 - 1
    assert r["tools"] == {"format": "fallback", "native": False, "n_tokens": r["tools"]["n_tokens"],
                          "source": "session"}
    out = app.post(f"/v1/sessions/{sid}/turns", json={
        "tool_results": [{"tool_call_id": call["id"], "content": "snow, -3 C"}], "tool_choice": "none",
        "max_tokens": 6}).json()
    assert out["tool_calls"] == [] and out["finish_reason"] in ("stop", "length")
    got = app.get(f"/v1/sessions/{sid}").json()
    assert [m["role"] for m in got["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert got["messages"][1]["tool_calls"] == [call] and got["messages"][2]["tool_call_id"] == call["id"]
    assert got["turns"] == 2


def test_the_cache_holds_what_the_transcript_renders_to(app):
    """After a turn, the session's cached ids are the transcript (calls and results included) rendered from scratch,
    plus the reply's tokens: a tool turn never leaves the cache out of step with the conversation."""
    mgr = app.app.state.skillcache.sessions
    sid = _session(app, system="Be brief.")["id"]
    call = app.post(f"/v1/sessions/{sid}/turns", json={"user": "Oslo?", "tool_choice": NAMED,
                                                       "max_tokens": 10}).json()["tool_calls"][0]
    app.post(f"/v1/sessions/{sid}/turns", json={"tool_results": [{"tool_call_id": call["id"], "content": "ok"}],
                                                "user": "Thanks", "max_tokens": 4, "tool_choice": "none"})
    s = mgr.live[sid]
    block = mgr.p.tool_prompt.block(ToolsParams([Tool.from_openai(WEATHER)]))
    plan, index = mgr.p.tool_prompt.build(mgr._head(s) + s.messages, s.skill_ids, s.base_errata, block,
                                          add_generation_prompt=False)
    assert index == 0
    assert plan.ids[: len(s.ids) - 1] == s.ids[:-1]


def test_required_chooses_an_offered_tool_and_the_session_keeps_its_tokens(app):
    time = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    mgr = app.app.state.skillcache.sessions
    sid = _session(app, tools=[WEATHER, time])["id"]
    n_before = mgr.live[sid].cache.get_seq_length()
    r = app.post(f"/v1/sessions/{sid}/turns", json={"user": "Oslo?", "tool_choice": "required", "max_tokens": 8})
    [call] = r.json()["tool_calls"]
    assert call["function"]["name"] in {"get_weather", "get_time"}
    s = mgr.live[sid]
    assert len(s.ids) == s.cache.get_seq_length() > n_before
    opening = mgr.p.tool_prompt.encode_template(call["function"]["name"] + '"')
    assert any(s.ids[i:i + len(opening)] == opening for i in range(n_before, len(s.ids)))  # the chosen name is held
    nxt = app.post(f"/v1/sessions/{sid}/turns", json={
        "tool_results": [{"tool_call_id": call["id"], "content": "ok"}], "max_tokens": 2, "tool_choice": "none"})
    assert nxt.status_code == 200 and nxt.json()["usage"]["reused_tokens"] > n_before


@pytest.mark.parametrize("body,where", [
    ({"max_tokens": 2}, "user: required"),
    ({"tool_results": [{"tool_call_id": "nope", "content": "x"}], "max_tokens": 2}, "tool_results.0.tool_call_id"),
    ({"tool_choice": {"type": "function", "function": {"name": "other"}}, "user": "x"}, "tool_choice"),
])
def test_turn_errors_name_the_field(app, body, where):
    sid = _session(app)["id"]
    r = app.post(f"/v1/sessions/{sid}/turns", json=body)
    assert r.status_code == 422 and r.json()["error"]["message"].startswith(where), r.text


def test_unanswered_calls_block_the_next_user_turn(app):
    sid = _session(app)["id"]
    app.post(f"/v1/sessions/{sid}/turns", json={"user": "Oslo?", "tool_choice": NAMED, "max_tokens": 8})
    r = app.post(f"/v1/sessions/{sid}/turns", json={"user": "never mind", "max_tokens": 2})
    assert r.status_code == 422 and "have no tool message answering them" in r.json()["error"]["message"]


def test_a_session_resumed_from_the_store_keeps_its_tools(app):
    state = app.app.state.skillcache
    sid = _session(app)["id"]
    call = app.post(f"/v1/sessions/{sid}/turns", json={"user": "Oslo?", "tool_choice": NAMED,
                                                       "max_tokens": 8}).json()["tool_calls"][0]
    app.portal.call(state.sessions.drain)
    state.sessions.live.clear()  # dropped from memory: the next request resumes the saved copy
    r = app.post(f"/v1/sessions/{sid}/turns", json={
        "tool_results": [{"tool_call_id": call["id"], "content": "ok"}], "tool_choice": NAMED, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert r.json()["tool_calls"][0]["function"]["name"] == "get_weather"
    assert r.json()["usage"]["reused_tokens"] > 0
    assert torch.is_tensor(state.sessions.live[sid].cache.layers[0].keys)
