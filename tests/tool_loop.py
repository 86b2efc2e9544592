"""The agent loop the tool-calling end-to-end tests drive through the official openai SDK, on any model: two tools,
three turns (a named call, its result and a second named call, their results and an answer with tool_choice auto),
plain or streamed (accumulated by the SDK's own stream state)."""

from __future__ import annotations

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
QUESTION = "What is the weather in Paris, and what time is it there?"



def sdk_client(home, env: dict):
    """Start a real service (service.devserver.ServiceProcess) and yield (openai client, model id) while it runs."""
    import pytest
    from openai import OpenAI

    from service.devserver import ServiceNotReady, ServiceProcess

    with ServiceProcess(home, env, threads=None) as svc:
        try:
            svc.wait_ready(300)
        except ServiceNotReady as e:
            pytest.fail(str(e))
        c = OpenAI(base_url=f"{svc.url}/v1", api_key="unused", max_retries=0, timeout=300)
        yield c, c.models.list().data[0].id


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def named_calls(c, model, cities: list[str]) -> int:
    """Ask for the weather and the time in each city with that tool named: every reply must be one call of it.
    Returns how many calls' arguments were a JSON object."""
    import json

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
    return n_json


def agent_turns(client, model, stream: bool, system: str | None = "You are a helpful assistant.",
                max_tokens: int = 32):
    """call, tool result + call, tool results + answer; yields (message, finish_reason, usage, model_extra), the
    last None when streamed. Stops early when a turn makes no call."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": QUESTION}]
    for choice in (named("get_weather"), named("get_time"), "auto"):
        kw = dict(model=model, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=max_tokens)
        if stream:
            msg, finish, usage = accumulate(client.chat.completions.create(
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


def accumulate(stream):
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


def check_loop(turns: list) -> None:
    """What every model's plain loop must show: three turns, the named calls, ids, the tools block compiled on the
    first turn and copied from the memory tier (usage counts it as cached) from the second on."""
    assert len(turns) == 3, [t[0] for t in turns]
    (m1, f1, u1, x1), (m2, f2, u2, x2), (m3, f3, u3, x3) = turns
    assert [t.function.name for t in m1.tool_calls] == ["get_weather"] and f1 in ("tool_calls", "length")
    assert [t.function.name for t in m2.tool_calls] == ["get_time"] and f2 in ("tool_calls", "length")
    assert all(isinstance(t.function.arguments, str) and t.id.startswith("call_")
               for t in m1.tool_calls + m2.tool_calls)
    tools = [x["skillcache"]["tools"] for x in (x1, x2, x3)]
    print("turns:", [(f, u.prompt_tokens, u.prompt_tokens_details.cached_tokens, t["source"]) for f, u, t in
                     zip((f1, f2, f3), (u1, u2, u3), tools)], "calls:",
          [(c.function.name, c.function.arguments) for c in m1.tool_calls + m2.tool_calls],
          "answer:", repr(m3.content), m3.tool_calls)
    assert tools[0]["source"] == "compiled" and u1.prompt_tokens_details.cached_tokens == 0  # the block's first use
    for t, u in zip(tools[1:], (u2, u3)):  # from the second turn on: copied from the memory tier
        assert t["source"] == "memory" and u.prompt_tokens_details.cached_tokens >= t["n_tokens"]
    assert f3 in ("stop", "length", "tool_calls")
    assert (m3.content is not None) or m3.tool_calls  # an answer, or (auto) another call: either parses
