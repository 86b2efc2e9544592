"""Tool calling over the API on tiny random-weight models, through the official openai SDK (in process): chat
completions with tools (fallback block on plain ChatML, the template's own on Qwen2.5), the tools block cached from
the second request, forced calls, streamed delta.tool_calls, refused fields; /v1/compose with tools."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI, UnprocessableEntityError

from appclient import make_client
from tool_templates import QWEN25, tools_runtime

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone", "strict": True,
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture
def sdk(client):
    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


@pytest.fixture
def native(tmp_path):
    with make_client(tmp_path, runtime=tools_runtime(QWEN25)) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        yield OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=c, max_retries=0)


def test_named_tool_choice_is_that_call_and_the_block_is_cached_from_the_second_request(sdk):
    first = sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named("get_time"),
                                        max_tokens=24)
    choice = first.choices[0]
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_time" and call.id.startswith("call_")
    assert isinstance(call.function.arguments, str)
    assert choice.finish_reason in ("tool_calls", "length")  # random weights: the call may be cut by max_tokens
    tools = first.model_extra["skillcache"]["tools"]
    assert tools["format"] == "fallback" and not tools["native"] and tools["source"] == "compiled"
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # compiled for this request: computed, not cached
    again = sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named("get_weather"),
                                        max_tokens=24)
    assert again.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert again.model_extra["skillcache"]["tools"]["source"] == "memory"
    assert again.usage.prompt_tokens_details.cached_tokens == tools["n_tokens"]  # first block: copied as is


def test_auto_and_none_answer_in_text_or_calls_and_none_never_calls(sdk):
    auto = sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=8)
    msg = auto.choices[0].message
    assert (msg.tool_calls is None) == (auto.choices[0].finish_reason != "tool_calls")
    none = sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert none.choices[0].message.tool_calls is None and isinstance(none.choices[0].message.content, str)
    assert none.usage.prompt_tokens == auto.usage.prompt_tokens  # the tools are in the prompt either way


def test_streamed_tool_calls_accumulate_to_the_same_call(sdk):
    body = dict(model="m", messages=ASK, tools=TOOLS, tool_choice=named("get_weather"), max_tokens=16)
    plain = sdk.chat.completions.create(**body).choices[0].message.tool_calls[0]
    chunks = list(sdk.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    parts = [tc for d in deltas for tc in d.tool_calls or []]
    assert parts[0].index == 0 and parts[0].id.startswith("call_") and parts[0].function.name == "get_weather"
    assert "".join(p.function.arguments or "" for p in parts) == plain.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("tool_calls", "length")
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_a_tool_result_round_trips_and_the_loop_continues(sdk):
    call = sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named("get_weather"),
                                       max_tokens=16).choices[0].message
    history = ASK + [call.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": '{"temp_c": 21}'}]
    nxt = sdk.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice=named("get_time"),
                                      max_tokens=16)
    assert nxt.choices[0].message.tool_calls[0].function.name == "get_time"
    assert nxt.usage.prompt_tokens_details.cached_tokens > 0
    answer = sdk.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice="none", max_tokens=6)
    assert answer.choices[0].message.content is not None


def test_native_template_renders_the_tools_and_forces_its_own_call_format(native):
    r = native.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named("get_weather"),
                                       max_tokens=24)
    tools = r.model_extra["skillcache"]["tools"]
    assert tools["native"] and tools["format"] == "hermes" and tools["path"] == "compose"
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    again = native.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=4)
    # the Qwen template puts the tools after the system text: a later block, re-rotated with its seam
    assert again.usage.prompt_tokens_details.cached_tokens == tools["n_tokens"] - again.model_extra[
        "skillcache"]["tools"]["seam"]


@pytest.mark.parametrize("extra,field", [
    ({"n": 2}, "n"),
    ({"logit_bias": {"42": 5}}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}},
     "response_format"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"presence_penalty": -1}, "presence_penalty"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
])
def test_fields_not_honoured_are_a_422_naming_the_field(client, extra, field):
    r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **extra})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["type"] == "invalid_request" and r.json()["error"]["message"].startswith(field)


def test_fields_ignored_on_purpose_are_accepted(sdk):
    r = sdk.chat.completions.create(model="m", messages=ASK, max_tokens=2, user="u-1", store=False,
                                    metadata={"k": "v"}, service_tier="auto", n=1, frequency_penalty=0,
                                    response_format={"type": "text"}, parallel_tool_calls=False)
    assert r.choices[0].message.content is not None
    with pytest.raises(UnprocessableEntityError, match="logit_bias"):
        sdk.chat.completions.create(model="m", messages=ASK, max_tokens=2, logit_bias={"1": 1})


@pytest.mark.parametrize("messages,where", [
    ([{"role": "tool", "tool_call_id": "x", "content": "1"}], "messages.0.tool_call_id"),
    (ASK + [{"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                                  "function": {"name": "get_weather", "arguments": "{}"}}]}],
     "the last message"),
    (ASK + [{"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                                  "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "user", "content": "?"}], "messages.2: tool calls"),
    ([{"role": "user"}], "messages.0.content"),
    ([{"role": "user", "content": "x", "tool_calls": []}, {"role": "tool", "content": "1"}], "messages.1.tool_call_id"),
])
def test_tool_turns_out_of_place_are_a_422_naming_the_message(client, messages, where):
    r = client.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 422 and r.json()["error"]["message"].startswith(where), r.text


def test_compose_with_tools_returns_calls_and_streams_tool_call_events(client):
    body = {"user": "What time is it in Tokyo?", "tools": TOOLS, "tool_choice": named("get_time"), "max_tokens": 16}
    r = client.post("/v1/compose", json=body).json()
    assert r["tool_calls"][0]["function"]["name"] == "get_time" and r["tools"]["format"] == "fallback"
    assert r["finish_reason"] in ("tool_calls", "length")
    with client.stream("POST", "/v1/compose", json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    [call] = [e for e in events if e["type"] == "tool_call"]
    assert call["index"] == 0 and call["tool_call"]["function"]["name"] == "get_time"
    assert events[-1]["type"] == "done" and events[-1]["tool_calls"] == [call["tool_call"]]
    assert events[-1]["tools"]["source"] == "memory"
    plain = client.post("/v1/compose", json={"user": "hi", "max_tokens": 2}).json()
    assert plain["tool_calls"] is None and plain["tools"] is None


def test_required_among_several_tools_is_always_a_call_of_an_offered_one(sdk):
    for question in ["What is the weather in Rome?", "What time is it in Oslo?", "Tell me a joke."]:
        r = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": question}], tools=TOOLS,
                                        tool_choice="required", max_tokens=16)
        calls = r.choices[0].message.tool_calls
        assert calls and calls[0].function.name in {"get_weather", "get_time"}, r
        # the opening up to the arguments, the chosen name included, is prompt (the service wrote it)
        auto = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": question}], tools=TOOLS,
                                           max_tokens=1)
        assert r.usage.prompt_tokens > auto.usage.prompt_tokens + 10 and r.usage.completion_tokens <= 16


def test_a_streamed_call_accumulated_by_the_sdk_goes_back_as_it_is(sdk):
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    for chunk in sdk.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named("get_weather"),
                                             max_tokens=12, stream=True):
        state.handle_chunk(chunk)
    msg = state.current_completion_snapshot.choices[0].message
    sent = msg.model_dump(exclude_none=True)
    assert "index" in sent["tool_calls"][0]  # the SDK keeps the stream's index: accepted and ignored
    history = ASK + [sent, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "ok"}]
    r = sdk.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice="none", max_tokens=2)
    assert r.choices[0].message.content is not None


def test_tools_longer_than_a_skill_may_be_are_refused(tmp_path):
    with make_client(tmp_path, max_skill_tokens=64) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        r = c.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 2})
        assert r.status_code == 413 and r.json()["error"]["type"] == "limit_exceeded"
        assert "SKILLCACHE_MAX_SKILL_TOKENS" in r.json()["error"]["message"]


def test_the_tools_block_is_calibrated_and_kept_in_memory_only(tmp_path):
    from service.tools.spec import Tool, ToolsParams

    with make_client(tmp_path, seam_auto=True, seam_candidates=[0, 4]) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        c.post("/v1/skills", json={"name": "a", "text": "Refunds are allowed within 30 days of delivery."})
        body = {"messages": ASK, "tools": TOOLS, "max_tokens": 1, "skills": ["a"]}
        first = c.post("/v1/chat/completions", json=body).json()["skillcache"]["tools"]
        assert first["source"] == "compiled" and first["seam"] == 4  # after a skill, before calibration: the default
        c.portal.call(state.pipeline.guard.drain)
        again = c.post("/v1/chat/completions", json=body).json()["skillcache"]["tools"]
        assert again["source"] == "memory"
        block = state.pipeline.tool_prompt.block(ToolsParams([Tool.from_openai(t) for t in TOOLS]))
        kv, source, _ = c.portal.call(state.pipeline.tools_block, "default", list(block.ids))
        assert source == "memory" and json.loads(kv.meta["calibration"])["seam"] == again["seam"]
        assert c.portal.call(state.store.disk_keys, "tools-") == []  # never written to disk
