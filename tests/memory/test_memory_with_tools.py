"""A memory and tools in one request: the tools block composed after the skills, the memory floated late before the
last user turn (tool calls and their results may follow it), each block indexed and reported as its own."""

import pytest

from appclient import make_client
from service.tools.render import ToolPrompt
from service.tools.spec import Tool, ToolsParams
from tiny import random_ids, tiny_runtime
from tool_templates import QWEN25, tools_runtime

WEATHER_SPEC = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
PARAMS = ToolsParams([Tool.from_openai(WEATHER_SPEC)])
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
LOOP = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "snow", "tool_call_id": "c1", "name": "get_weather"}]
MEM = "# USER MEMORY\n- [profile] city: Oslo\n- [profile] units: celsius"


class _Late:
    def __init__(self, ids, lines=()):
        self.ids, self.lines = ids, list(lines)


@pytest.mark.parametrize("native", [False, True], ids=["fallback", "qwen2.5"])
@pytest.mark.parametrize("upto", [2, 4], ids=["user-last", "results-last"])
def test_late_blocks_follow_the_tools_block_and_lead_the_last_user_turn(native, upto):
    rt = tools_runtime(QWEN25) if native else tiny_runtime("llama")
    tp = ToolPrompt(rt.prompts)
    block = tp.block(PARAMS)
    assert block.native is native
    skill, mem = rt.prompts.encode_content("Refunds within 30 days."), [random_ids(12, seed=1), random_ids(7, seed=2)]
    msgs = LOOP[:upto]
    plain, t_index = tp.build(msgs, [skill], [], block)
    plan, index = tp.build(msgs, [skill], [], block, late=_Late(mem, ["[MEMORY UPDATE] x"]))
    assert index == t_index == 1
    kinds = [(s.skill_index, s.ids) for s in plan.segments if s.kind == "skill"]
    assert kinds == [(0, skill), (1, list(block.ids)), (2, mem[0]), (3, mem[1])]
    a, b = plan.late_span
    ids = plan.ids
    assert ids[:a] + ids[b:] == plain.ids  # the memory and its lines are all the late span adds
    question = rt.prompts.encode_content("Weather in Oslo?")
    assert ids[b:b + len(question)] == question  # the memory leads the question (the call and result after it)


def test_late_blocks_need_a_user_turn_only_tool_turns_may_follow():
    tp = ToolPrompt(tiny_runtime("llama").prompts)
    msgs = LOOP + [{"role": "assistant", "content": "Snow."}]
    with pytest.raises(ValueError, match="last user turn"):
        tp.build(msgs, [], [], tp.block(PARAMS), add_generation_prompt=False, late=_Late([random_ids(5, seed=3)]))


@pytest.fixture
def app(tmp_path):
    with make_client(tmp_path) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        assert c.post("/v1/skills", json={"name": "policy", "text": "Refunds within 30 days."}).status_code == 201
        assert c.post("/v1/memories", json={"name": "ada", "text": MEM}).status_code == 201
        yield c


def test_compose_with_tools_and_a_memory_reports_both(app):
    r = app.post("/v1/compose", json={"skills": ["policy"], "user": "Weather where I live?", "memory": "ada",
                                      "memory_seam_tokens": 3, "seam_tokens": 2, "tools": [WEATHER_SPEC],
                                      "tool_choice": NAMED, "max_tokens": 12})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["function"]["name"] for c in body["tool_calls"]] == ["get_weather"]
    assert body["tools"]["path"] == "compose" and body["tools"]["seam"] == 2
    assert body["memory"]["name"] == "ada" and [b["seam"] for b in body["memory"]["blocks"]] == [3]
    assert body["skills"][0]["seam"] == 0  # the first skill follows the template opening it was compiled after


def test_a_session_tool_loop_floats_the_memory_and_never_caches_it(app):
    state = app.app.state.skillcache
    mgr = state.sessions
    s = app.post("/v1/sessions", json={"skills": ["policy"], "system": "Be brief.", "tools": [WEATHER_SPEC],
                                       "memory": "ada"}).json()
    sid = s["id"]
    assert s["memory"] == "ada" and s["tools"] == [WEATHER_SPEC]
    mem_ids = app.portal.call(state.memories.resolve, "default", "ada").ids[0]
    turns = [{"user": "Weather where I live?", "tool_choice": NAMED, "max_tokens": 12}, None,
             {"user": "Thanks", "tool_choice": "none", "max_tokens": 4}]
    call = None  # set by the first turn, answered by the second
    for turn in turns:
        if turn is None:  # the results alone: the memory stays before the question they answer
            turn = {"tool_results": [{"tool_call_id": call["id"], "content": "snow"}], "tool_choice": "none",
                    "max_tokens": 4}
        r = app.post(f"/v1/sessions/{sid}/turns", json=turn)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["memory"]["name"] == "ada" and body["tools"]["source"] == "session"
        if "user" in turn and turn["tool_choice"] == NAMED:
            assert len(body["tool_calls"]) == 1
            call = body["tool_calls"][0]
        live = mgr.live[sid]
        assert live.cache.get_seq_length() == len(live.ids)
        assert not any(live.ids[i:i + len(mem_ids)] == mem_ids for i in range(len(live.ids)))
    # the cache is the transcript rendered from scratch (calls and results included), with no memory in it
    plan, _ = mgr.p.tool_prompt.build(mgr._head(live) + live.messages, live.skill_ids, live.base_errata,
                                      mgr.p.tool_prompt.block(PARAMS), add_generation_prompt=False)
    assert plan.ids[: len(live.ids) - 1] == live.ids[:-1]
    info = app.get(f"/v1/sessions/{sid}").json()
    assert [m["role"] for m in info["messages"]] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert info["memory"] == "ada" and info["turns"] == 3
