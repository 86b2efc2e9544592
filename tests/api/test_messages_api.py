"""The Anthropic Messages API (POST /v1/messages) in process, on the tiny random-weight model, through the official
anthropic SDK and raw HTTP: the block mapping (system breakpoints, tool turns), refusals in Anthropic's error shape,
the streaming events' order, usage counts (cache_control blocks created then read, composed at a new position)."""

from __future__ import annotations

import asyncio
import json

import anthropic
import pytest

from appclient import make_client
from service.api import messages_blocks as mb
from service.api.routes.messages import _stream
from service.api.schemas.messages import MessagesRequest
from service.compose.pipeline import Final
from service.errors import InvalidRequest, Overloaded
from service.runtime.params import Delta, Done

POLICY = ("Refund policy: items may be returned within 30 days of delivery when unused and in their original "
          "packaging; refunds go to the original payment method within five business days.")
PREAMBLE = "You are the support assistant of an online shop that sells kitchen tools."
_USER = [{"role": "user", "content": "hi"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with make_client(tmp_path_factory.mktemp("messages")) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        yield c


@pytest.fixture(scope="module")
def sdk(client):
    return anthropic.Anthropic(base_url="http://testserver", api_key="unused", http_client=client, max_retries=0)


def _req(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": _USER, **kw})


def _n_tokens(client, text: str) -> int:
    return len(client.app.state.skillcache.runtime.prompts.encode_content(text))


# ---- the block mapping ----------------------------------------------------------------------------------------------
def test_system_is_split_after_each_breakpoint_and_the_rest_stays_the_system_text():
    cc = {"type": "ephemeral"}
    body = _req(messages=[{"role": "user", "content": "hi"}], system=[
        {"type": "text", "text": "A"}, {"type": "text", "text": "B", "cache_control": cc},
        {"type": "text", "text": "C", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"type": "text", "text": "D"}, {"type": "text", "text": "E"}])
    assert mb.system_parts(body) == (["A\n\nB", "C"], "D\n\nE")
    assert mb.system_parts(_req(system="S")) == ([], "S")
    auto = _req(system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
                cache_control=cc)  # automatic caching: the breakpoint is the last system block
    assert mb.system_parts(auto) == (["A\n\nB"], None)
    with pytest.raises(InvalidRequest, match="system.0.cache_control"):
        mb.system_parts(_req(system=[{"type": "text", "text": " ", "cache_control": cc}]))


def test_tool_turns_map_to_tool_calls_and_tool_messages():
    body = _req(messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}, {"type": "text", "text": "In Paris."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": False,
                                      "content": [{"type": "text", "text": "18 C"}]},
                                     {"type": "text", "text": "And tomorrow?",
                                      "cache_control": {"type": "ephemeral"}}]}])
    out = mb.conversation(body.messages, "Be brief.")
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool", "user"]
    assert out[1]["content"] == "Weather?\n\nIn Paris."
    assert out[2]["tool_calls"] == [{"id": "t1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert out[3] == {"role": "tool", "tool_call_id": "t1", "content": "18 C", "name": "get_weather"}
    tools, choice, parallel = mb.openai_tools(_req(tools=[WEATHER],
                                                   tool_choice={"type": "any", "disable_parallel_tool_use": True}))
    assert tools[0].function.parameters == WEATHER["input_schema"] and choice == "required" and parallel is False


@pytest.mark.parametrize("messages, where", [
    ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
     "messages.0.content.0"),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "tool_result", "tool_use_id": "t"}]}],
     "messages.0.content.1"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "messages.1"),
    ([{"role": "user", "content": []}], "messages.0.content"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "r"}]}], "messages.0"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                    "content": [{"type": "image", "source": {}}]}]}], "messages.0.content.0.content.0"),
])
def test_blocks_out_of_place_are_refused_naming_them(messages, where):
    with pytest.raises(InvalidRequest, match=where.replace(".", r"\.")):
        mb.conversation(_req(messages=messages).messages, None)


# ---- refusals in Anthropic's error shape ---------------------------------------------------------------------------


@pytest.mark.parametrize("extra, field", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "messages.0.content.0"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0"),
    ({"top_k": 0}, "top_k"), ({"output_config": {"task_budget": 100}}, "output_config"),
    ({"container": "c1"}, "container"), ({"mcp_servers": [{"type": "url", "url": "x", "name": "n"}]}, "mcp_servers"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"service_tier": "priority"}, "service_tier"), ({"bogus": 1}, "bogus"),
    ({"max_tokens": None}, "max_tokens"), ({"temperature": 1.5}, "temperature"),
    ({"tool_choice": {"type": "tool", "name": "g"}, "tools": [WEATHER]}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.name"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
])
def test_unsupported_fields_are_refused_in_anthropics_shape(client, extra, field):
    body = {"model": "m", "max_tokens": 4, "messages": _USER, **extra}
    if body["max_tokens"] is None:
        del body["max_tokens"]
    r = client.post("/v1/messages", json=body)
    assert r.status_code in (400, 422), r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["error_type"] == "invalid_request" and field in err["error"]["message"], err


def test_the_sdk_raises_its_own_error_class_for_a_refusal(sdk):
    with pytest.raises(anthropic.UnprocessableEntityError) as e:
        sdk.messages.create(model="m", max_tokens=4, messages=_USER, extra_body={"container": "c1"})
    assert e.value.body["error"]["type"] == "invalid_request_error"


def test_top_k_is_honoured_and_thinking_and_effort_are_hints(sdk):
    """top_k restricts sampling (top_k 1 with temperature 1 is the greedy reply); thinking and output_config.effort
    are hints: accepted, and the reply has no thinking blocks (the model does not think before it answers)."""
    greedy = sdk.messages.create(model="m", max_tokens=6, messages=_USER)
    for _ in range(2):  # unseeded sampling: only the one most likely token is ever left to draw
        one = sdk.messages.create(model="m", max_tokens=6, messages=_USER, extra_body={"temperature": 1.0, "top_k": 1})
        assert one.content[0].text == greedy.content[0].text
    m = sdk.messages.create(model="m", max_tokens=3, messages=_USER,
                            thinking={"type": "enabled", "budget_tokens": 1024},
                            extra_body={"output_config": {"effort": "low"}})
    assert m.content and all(b.type != "thinking" for b in m.content)


def test_what_the_sdk_sends_is_accepted(sdk):
    m = sdk.messages.create(model="m", max_tokens=3, messages=_USER, metadata={"user_id": "u-1"},
                            service_tier="standard_only", stop_sequences=["\n\nHuman:"], system="Be brief.",
                            thinking={"type": "disabled"}, extra_body={"temperature": 0.0, "top_p": 0.9})
    assert m.type == "message" and m.role == "assistant" and m.stop_reason in ("end_turn", "max_tokens",
                                                                               "stop_sequence")
    assert m.usage.output_tokens <= 3 and m.content[0].type == "text"


# ---- responses, streaming, usage ------------------------------------------------------------------------------------
def test_usage_adds_up_to_the_same_prompt_as_chat_completions(client, sdk):
    system = PREAMBLE + " " + POLICY + " Be brief."  # a plain string over 256 characters (256 bounds the blocks)
    m = sdk.messages.create(model="m", max_tokens=2, system=system, messages=_USER)
    chat = client.post("/v1/chat/completions", json={"max_tokens": 2, "messages": [
        {"role": "system", "content": system}, *_USER]}).json()
    u = m.usage
    assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens == \
        chat["usage"]["prompt_tokens"]
    assert u.output_tokens == chat["usage"]["completion_tokens"] == 2 and m.stop_reason == "max_tokens"


def test_a_cache_control_block_is_created_once_then_read_and_composed_at_another_position(client, sdk):
    n = _n_tokens(client, POLICY)
    system = [{"type": "text", "text": POLICY, "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Answer in one sentence."}]
    first = sdk.messages.create(model="m", max_tokens=2, system=system, messages=[{"role": "user", "content": "Hi"}])
    [block] = first.model_extra["skillcache"]["skills"]
    assert block["name"].startswith("block-") and block["source"] == "compiled"
    assert first.usage.cache_creation_input_tokens == n and first.usage.cache_read_input_tokens == 0
    again = sdk.messages.create(model="m", max_tokens=2, system=system,
                                messages=[{"role": "user", "content": "Can I return a knife?"}])
    assert again.model_extra["skillcache"]["skills"][0]["source"] == "memory"
    assert again.usage.cache_creation_input_tokens == 0 and again.usage.cache_read_input_tokens >= n
    moved = sdk.messages.create(model="m", max_tokens=2, messages=_USER, system=[
        {"type": "text", "text": PREAMBLE, "cache_control": {"type": "ephemeral"}}, system[0]])
    pre, pol = moved.model_extra["skillcache"]["skills"]
    assert pol["content_hash"] == block["content_hash"] and pol["source"] == "memory" and pol["path"] == "compose"
    assert moved.usage.cache_creation_input_tokens == _n_tokens(client, PREAMBLE)
    assert moved.usage.cache_read_input_tokens == n - pol["seam"] >= 0.9 * n


def _events(client, body: dict) -> list[tuple[str, dict]]:
    out, name = [], None
    with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                out.append((name, data))
    return out


def test_stream_events_come_in_anthropics_order(client):
    ev = _events(client, {"model": "m", "max_tokens": 4, "messages": _USER})
    names = [n for n, _ in ev]
    assert names[:3] == ["message_start", "ping", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert ev[0][1]["message"]["stop_reason"] is None
    delta = ev[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 4


def test_a_streamed_tool_use_accumulates_in_the_sdk(sdk):
    kw = dict(model="m", max_tokens=24, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    plain = sdk.messages.create(**kw)
    with sdk.messages.stream(**kw) as s:
        streamed = s.get_final_message()
    for m in (plain, streamed):
        [call] = [b for b in m.content if b.type == "tool_use"]
        assert call.name == "get_weather" and isinstance(call.input, dict)
        assert m.stop_reason in ("tool_use", "max_tokens")
    assert streamed.content[-1].input == plain.content[-1].input  # greedy: the same call
    assert streamed.usage.cache_read_input_tokens > 0  # the tools block, compiled by the first request
    nxt = sdk.messages.create(model="m", max_tokens=3, tools=[WEATHER], messages=[
        *kw["messages"], {"role": "assistant", "content": plain.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": plain.content[-1].id, "content": "18 C"}]}])
    assert nxt.type == "message"


def test_an_error_inside_the_stream_is_an_error_event():
    async def events():
        yield Delta("Hel")
        raise Overloaded("the queue is full")

    async def collect():
        return [f async for f in _stream(events(), {"id": "msg_1"}, None)]

    frames = asyncio.run(collect())
    assert frames[-1].startswith("event: error\n")
    err = json.loads(frames[-1].split("data: ", 1)[1])
    assert err == {"type": "error", "error": {"type": "rate_limit_error", "message": "the queue is full",
                                              "error_type": "overloaded"}}


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_stop_reason_names_the_stop_sequence_that_cut_the_text():
    def final(reason, text, ids):
        return Final(Done(reason, text, [ord(ch) for ch in ids]), {}, {}, [], [])

    assert mb.stop(final("stop", "ab", "abEND"), ["X", "END"], _Tok()) == ("stop_sequence", "END")
    assert mb.stop(final("stop", "ab", "ab"), ["END"], _Tok()) == ("end_turn", None)
    assert mb.stop(final("length", "ab", "ab"), ["END"], _Tok()) == ("max_tokens", None)
    assert mb.stop(final("tool_calls", "", ""), [], _Tok()) == ("tool_use", None)


def test_input_tokens_are_what_was_computed_and_not_written_to_the_cache(tmp_path):
    """Anthropic's input_tokens: the tokens neither read from nor written to the cache. A prompt whose every token
    but the last was read from the automatic head (the same text sent before, marked another way) writes nothing,
    even when its cache_control queues its system text as a new block: before, the queued block's tokens were
    counted as written and input_tokens came out 0 with a token computed."""
    policy = ("Returns policy. Items may be returned within 30 days of delivery with a receipt. Final-sale items, "
              "gift cards and opened software cannot be returned. Refunds go to the original payment method.")
    turn = [{"role": "user", "content": "Can I return a gift card?"}]
    marked = {"model": "m", "max_tokens": 2, "messages": turn,
              "system": [{"type": "text", "text": policy, "cache_control": {"type": "ephemeral"}},
                         {"type": "text", "text": "Be brief."}]}
    whole = {"model": "m", "max_tokens": 2, "messages": turn, "system": policy + "\n\nBe brief.",
             "cache_control": {"type": "ephemeral"}}  # the same text; the whole system text is the block
    with make_client(tmp_path, auto_reuse=True) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        first = c.post("/v1/messages", json=marked).json()["usage"]
        again = c.post("/v1/messages", json=whole).json()["usage"]
    assert first["cache_creation_input_tokens"] > 40 and first["input_tokens"] > 0, first
    total = sum(first[k] for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"))
    assert sum(again[k] for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")) == total
    assert again["cache_read_input_tokens"] == total - 1, again  # all but the last token, which is computed
    assert again["input_tokens"] == 1 and again["cache_creation_input_tokens"] == 0, again
