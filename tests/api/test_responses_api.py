"""POST /v1/responses in process on the tiny random-weight model, through the official openai SDK: input items ->
the pipeline's messages, the Response and its usage, streamed events (order, sequence numbers, what they add up to),
forced function calls, refused fields and malformed items (typed 4xx, never 5xx). Stored responses and conversations:
tests/api/test_responses_stored.py."""

from __future__ import annotations

import pytest
from openai import OpenAI

from appclient import make_client

from service.api.responses_items import conversation
from service.api.schemas.responses import ResponsesRequest
from service.errors import InvalidRequest

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}',
        "id": "fc_1", "status": "completed"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with make_client(tmp_path_factory.mktemp("responses")) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)  # the SDK is made with no retries: a 503 would fail
        yield c


@pytest.fixture(scope="module")
def sdk(client):
    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


def messages(**body) -> list[dict]:
    return conversation(ResponsesRequest(**body))


def test_items_map_to_the_pipeline_messages():
    out = messages(instructions="Be brief.", input=[
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]},
        CALL, {**CALL, "call_id": "call_2", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_2", "output": "rain"},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "sun"}]}])
    assert out[0] == {"role": "system", "content": "Be brief.\n\nUse tools."}
    assert out[1] == {"role": "user", "content": "Weather ?"}
    assert out[2]["role"] == "assistant" and out[2]["content"] == "Let me look."
    assert [c["id"] for c in out[2]["tool_calls"]] == ["call_1", "call_2"]  # both calls join the message before
    assert out[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert out[3:] == [{"role": "tool", "tool_call_id": "call_2", "content": "rain", "name": "get_weather"},
                       {"role": "tool", "tool_call_id": "call_1", "content": "sun", "name": "get_weather"}]
    assert messages(input="hi") == [{"role": "user", "content": "hi"}]
    lone = messages(input=[{"role": "user", "content": "q"}, CALL,
                           {"type": "function_call_output", "call_id": "call_1", "output": "o"}])
    assert lone[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


@pytest.mark.parametrize("items, where", [
    ([{"role": "user", "content": "q"}, {"role": "system", "content": "late"}, {"role": "user", "content": "q"}],
     "input.1"),
    ([{"role": "user", "content": "q"}, {"type": "function_call_output", "call_id": "nope", "output": "o"}],
     "input.1.call_id"),
    ([{"role": "user", "content": "q"}, CALL, {"role": "user", "content": "again"}], "input.2"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "input: the last item"),
    ([], "input: the last item"),
])
def test_items_out_of_place_are_refused_naming_the_item(items, where):
    with pytest.raises(InvalidRequest) as e:
        messages(input=items)
    assert e.value.message.startswith(where), e.value.message


def test_plain_response_and_usage(sdk):
    r = sdk.responses.create(model="m", instructions="Be brief.", input="Hello", max_output_tokens=6,
                             metadata={"k": "v"}, store=False, temperature=0.0, top_p=1.0)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.metadata == {"k": "v"}
    [msg] = r.output
    assert msg.type == "message" and r.output_text == msg.content[0].text and r.instructions == "Be brief."
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 6
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    assert u.input_tokens_details.cached_tokens == 0 and r.model_extra["skillcache"]["skills"] == []


def test_stream_events_order_sequence_numbers_and_final_response(sdk):
    events = list(sdk.responses.create(model="m", input="Hello", max_output_tokens=5, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if events[-1].response.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2] if hasattr(e, "item_id"))
    final = events[-1].response
    assert final.output_text == text == events[-4].text and final.output[0].id == item_id
    plain = sdk.responses.create(model="m", input="Hello", max_output_tokens=5)
    assert plain.output_text == text  # greedy: the same reply either way


def test_forced_call_plain_and_streamed(sdk):
    body = dict(model="m", input="Weather in Paris?", tools=[WEATHER], max_output_tokens=24,
                tool_choice={"type": "function", "name": "get_weather"})
    r = sdk.responses.create(**body)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"] and calls[0].call_id.startswith("call_")
    assert r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"
    events = list(sdk.responses.create(**body, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(added) == len(done) == 1 and added[0].item.arguments == "" and done[0].name == "get_weather"
    assert done[0].arguments == calls[0].arguments
    # the call's output in the next turn, as input items (what the SDK sent back, ids and all)
    nxt = sdk.responses.create(model="m", tools=[WEATHER], tool_choice="none", max_output_tokens=4, input=[
        {"role": "user", "content": "Weather in Paris?"}, *[o.model_dump(exclude_none=True) for o in r.output],
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}])
    assert not [o for o in nxt.output if o.type == "function_call"]
    assert nxt.model_extra["skillcache"]["tools"]["source"] == "memory"
    assert nxt.usage.input_tokens_details.cached_tokens >= nxt.model_extra["skillcache"]["tools"]["n_tokens"]


REFUSED = [
    ({"conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation"),  # one or the other, as at OpenAI
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.0.type"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"tool_choice": "required"}, "tool_choice"),  # nothing offered to call
    ({"tools": [WEATHER, WEATHER]}, "tools.1.name"),
]


@pytest.mark.parametrize("extra, field", REFUSED, ids=[f for _, f in REFUSED])
def test_unsupported_fields_are_refused_naming_them(client, extra, field):
    r = client.post("/v1/responses", json={"input": "hi", **extra})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request" and err["message"].startswith(field), err


def test_stateful_fields_are_honoured_not_refused(client):
    """store, previous_response_id and conversation were refused when this service kept nothing; now a stored
    response is echoed as stored, and an id that is not there is a typed 404 (tests/api/test_responses_stored.py has
    the rest)."""
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 1, "store": True})
    assert r.status_code == 200 and r.json()["store"] is True, r.text
    for extra, status, kind in [({"previous_response_id": "resp_1"}, 404, "response_not_found"),
                                ({"conversation": "conv_1"}, 404, "conversation_not_found"),
                                ({"conversation": {"id": "conv_1"}}, 404, "conversation_not_found")]:
        r = client.post("/v1/responses", json={"input": "hi", **extra})
        assert r.status_code == status and r.json()["error"]["type"] == kind, r.text
        assert "'resp_1'" in r.json()["error"]["message"] or "'conv_1'" in r.json()["error"]["message"]


def test_hints_are_accepted_and_the_response_says_what_was_applied(sdk):
    """A hint changes nothing a client may rely on: accepted, as vLLM and hosted APIs accept it, and echoed as
    applied (the verbosity and effort asked for; no truncation, one service tier)."""
    r = sdk.responses.create(input="hi", max_output_tokens=2, text={"verbosity": "low"},
                             reasoning={"effort": "high", "summary": "auto"}, truncation="auto", service_tier="flex",
                             prompt_cache_retention="24h", extra_body={"prompt_cache_options": {"mode": "auto"},
                                                                       "stream_options": None})
    assert r.status in ("completed", "incomplete") and r.text.verbosity == "low"
    assert r.reasoning.effort == "high" and r.reasoning.summary is None  # no reasoning happened: nothing to sum up
    assert r.truncation == "disabled" and r.service_tier == "default" and r.prompt_cache_retention == "24h"
    assert not [o for o in r.output if o.type == "reasoning"]
    plain = sdk.responses.create(input="hi", max_output_tokens=1)
    assert plain.text.verbosity == "medium" and plain.reasoning is None


def test_the_agents_sdks_default_model_settings_are_accepted(client):
    """The OpenAI Agents SDK's own model sends text.verbosity and reasoning from ModelSettings: both hints."""

    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner
    from openai import AsyncOpenAI
    from openai.types.shared import Reasoning
    import httpx

    async def run() -> str:
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            oai = AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
            agent = Agent(name="a", instructions="Be brief.", model=OpenAIResponsesModel("m", oai),
                          model_settings=ModelSettings(verbosity="low", reasoning=Reasoning(effort="low"),
                                                       temperature=0.0, max_tokens=64,
                                                       extra_body={"stop": [" ", "e", "a", "o", "t"]}))
            out = await Runner.run(agent, "hi", run_config=RunConfig(tracing_disabled=True))
            return out.final_output

    assert isinstance(client.portal.call(run), str)


def test_neutral_values_the_sdks_send_are_accepted(client):
    body = {"input": "hi", "max_output_tokens": 1, "store": False, "include": [], "reasoning": {"effort": None},
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "background": False, "user": "u",
            "previous_response_id": None, "conversation": None, "parallel_tool_calls": False, "service_tier": "auto",
            "prompt_cache_key": "k", "metadata": {}, "tools": [], "tool_choice": "auto"}
    assert client.post("/v1/responses", json=body).status_code == 200


@pytest.mark.parametrize("body", [
    {"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
    {"input": [{"type": "item_reference", "id": "msg_1"}]},
    {"input": [{"type": "function_call", "call_id": "c"}]},
    {"input": [{"role": "tool", "content": "x"}]},
    {"input": [{"role": "user"}]},
    {"input": [7]},
    {"input": {"role": "user", "content": "x"}},
    {"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]},
    {"input": "hi", "tool_choice": {"type": "function"}},
    {"input": "hi", "temperature": 9},
    {"input": "hi", "max_output_tokens": 0},
    {"input": "hi", "unknown": 1},
    {},
])
def test_malformed_bodies_are_a_typed_4xx(client, body):
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 422, r.text
    assert r.json()["error"]["type"] == "invalid_request"
