"""Tool calling end to end: a real uvicorn serving the embedded model, driven by the official openai SDK.

An agent loop with two tools over three turns (a call, a tool result and the next call, then the answer), plain and
streamed; named tool_choice over 20 questions; skills and tools composed together. What the 135M model does with
tool_choice auto is measured by bench/tools.py (docs/BENCHMARKS.md), not asserted here."""

import json
import shutil

import pytest

from service.devserver import ROOT, ServiceNotReady, ServiceProcess

pytestmark = pytest.mark.slow

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                       "required": ["city"]}}},
]
RESULTS = {"get_weather": '{"city": "Paris", "temp_c": 18, "sky": "cloudy"}', "get_time": '{"time": "14:05"}'}


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    from openai import OpenAI

    skills = tmp_path_factory.mktemp("skills")  # one shipped skill: less to preload and calibrate on a busy CPU
    shutil.copy(ROOT / "skills" / "refund-policy.md", skills)
    svc = ServiceProcess(tmp_path_factory.mktemp("home"), {"SKILLCACHE_SKILLS_DIR": str(skills)}, threads=None)
    with svc:
        try:
            svc.wait_ready(300)
        except ServiceNotReady as e:
            pytest.fail(str(e))
        c = OpenAI(base_url=f"{svc.url}/v1", api_key="unused", max_retries=0, timeout=300)
        yield c, c.models.list().data[0].id


def _turns(client, model, stream: bool):
    """call, tool result + call, tool result + answer; yields (message, finish_reason, usage, skillcache)."""
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]
    for choice in (named("get_weather"), named("get_time"), "auto"):
        kw = dict(model=model, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=32)
        if stream:
            msg, finish, usage = _accumulate(client.chat.completions.create(
                **kw, stream=True, stream_options={"include_usage": True}))
            extra = None
        else:
            r = client.chat.completions.create(**kw)
            msg, finish, usage, extra = r.choices[0].message, r.choices[0].finish_reason, r.usage, r.model_extra
        yield msg, finish, usage, extra
        if not msg.tool_calls:
            return
        messages.append(msg.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": RESULTS[c.function.name]}
                     for c in msg.tool_calls]


def _accumulate(stream):
    """The SDK's own accumulation of a stream into one message (what its stream helpers build; the snapshot, as
    get_final_completion() raises on finish_reason length, which a forced call cut by max_tokens has)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    usage = None
    for chunk in stream:
        state.handle_chunk(chunk)
        usage = chunk.usage or usage
    done = state.current_completion_snapshot
    return done.choices[0].message, done.choices[0].finish_reason, usage


def test_agent_loop_two_tools_three_turns(client):
    c, model = client
    turns = list(_turns(c, model, stream=False))
    assert len(turns) == 3
    (m1, f1, u1, x1), (m2, f2, u2, x2), (m3, f3, u3, x3) = turns
    assert [t.function.name for t in m1.tool_calls] == ["get_weather"] and f1 in ("tool_calls", "length")
    assert [t.function.name for t in m2.tool_calls] == ["get_time"] and f2 in ("tool_calls", "length")
    assert all(isinstance(t.function.arguments, str) and t.id.startswith("call_") for t in m1.tool_calls + m2.tool_calls)
    tools = [x["skillcache"]["tools"] for x in (x1, x2, x3)]
    print("turns:", [(f, u.prompt_tokens, u.prompt_tokens_details.cached_tokens, t["source"]) for f, u, t in
                     zip((f1, f2, f3), (u1, u2, u3), tools)], "answer:", repr(m3.content), m3.tool_calls)
    assert tools[0]["source"] == "compiled" and u1.prompt_tokens_details.cached_tokens == 0  # the block's first use
    for t, u in zip(tools[1:], (u2, u3)):  # from the second turn on: copied from the memory tier
        assert t["source"] == "memory" and u.prompt_tokens_details.cached_tokens >= t["n_tokens"]
    assert f3 in ("stop", "length", "tool_calls")
    assert (m3.content is not None) or m3.tool_calls  # an answer, or (auto) another call: either parses


def test_agent_loop_streamed_accumulates_in_the_sdk(client):
    c, model = client
    turns = list(_turns(c, model, stream=True))
    assert [t.function.name for t in turns[0][0].tool_calls] == ["get_weather"]
    assert [t.function.name for t in turns[1][0].tool_calls] == ["get_time"]
    assert turns[1][2].prompt_tokens_details.cached_tokens > 0
    for msg, _, _, _ in turns:
        for t in msg.tool_calls or []:
            assert t.function.arguments  # the arguments chunks added up to the call's arguments


def test_named_tool_choice_always_yields_that_call(client):
    c, model = client
    cities = ["Paris", "London", "Cairo", "Oslo", "Lima", "Tokyo", "Sydney", "Berlin", "Chicago", "Mumbai"]
    n_json = 0
    for city in cities:
        for tool, question in (("get_weather", f"How is the weather in {city}?"), ("get_time", f"Time in {city}?")):
            r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": question}], tools=TOOLS,
                                          tool_choice=named(tool), max_tokens=32)
            [call] = r.choices[0].message.tool_calls
            assert call.function.name == tool
            try:
                n_json += isinstance(json.loads(call.function.arguments), dict)
            except ValueError:
                pass
    print(f"named tool_choice: 20/20 calls of the named tool, arguments a JSON object in {n_json}/20")


def test_skills_and_tools_compose_together(client):
    c, model = client
    body = dict(model=model, messages=[{"role": "user", "content": "Can I return order A-1?"}], tools=TOOLS,
                max_tokens=4, extra_body={"skills": ["refund-policy"]})
    c.chat.completions.create(**body)
    r = c.chat.completions.create(**body)
    x = r.model_extra["skillcache"]
    skill = x["skills"][0]
    assert x["tools"]["source"] == "memory" and x["tools"]["path"] in ("compose", "prefix")
    # the skill is copied as is, the tools block after it re-rotated (its seam recomputed) or inside a refined prefix
    assert r.usage.prompt_tokens_details.cached_tokens >= x["tools"]["n_tokens"] + 700 - (x["tools"]["seam"] or 0)
    assert skill["name"] == "refund-policy"
