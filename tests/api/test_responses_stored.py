"""Stored responses and conversations (service/api/responses_store.py) in process on the tiny random-weight model:
store (default true) and GET/DELETE, previous_response_id (the earlier conversation first, without its
instructions, its K/V found by automatic reuse), conversations, tenants, expiry and the per-tenant bound, streaming,
a second app over the same store (disk, and Redis), and the official openai SDK and the OpenAI Agents SDK."""

from __future__ import annotations

import json
from contextlib import contextmanager

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from appclient import make_client
from redis_server import RedisServer, redis_or_skip
from tiny import tiny_runtime

ACME = {"Authorization": "Bearer acme-user-key-0123456789"}
GLOBEX = {"Authorization": "Bearer globex-user-key-0123456789"}
# long enough (> SKILLCACHE_AUTO_MIN_TOKENS) that automatic reuse keeps the first prompt's head
STORY = ("I ordered a blue kettle on Monday, order A-10482, and it arrived on Thursday with a cracked lid and a "
         "dented base. The box was fine, so it must have been packed that way. I would like a replacement rather "
         "than a refund, and I can send photos of the damage if you need them. What should I do next?")
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _keys(path):
    path.write_text(json.dumps([{"key": "acme-user-key-0123456789", "namespace": "acme", "role": "user"},
                                {"key": "globex-user-key-0123456789", "namespace": "globex", "role": "user"}]))
    return path


@contextmanager
def app(home, runtime=None, **settings):
    with make_client(home, runtime=runtime, **settings) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)  # the SDKs are made with no retries: a 503 would fail
        yield c


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    home = tmp_path_factory.mktemp("stored")
    with app(home, auto_reuse=True, api_keys_file=_keys(home / "keys.json")) as c:
        c.headers.update(ACME)
        yield c


@pytest.fixture(scope="module")
def sdk(client):
    return OpenAI(base_url="http://testserver/v1", api_key="acme-user-key-0123456789", http_client=client,
                  max_retries=0)


def create(c, **body) -> dict:
    r = c.post("/v1/responses", json={"max_output_tokens": 4, **body})
    assert r.status_code == 200, r.text
    return r.json()


def error(r, status: int, kind: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == kind, err
    return err


def test_stored_by_default_then_deleted(client):
    r = create(client, input="Hello there", metadata={"k": "v"})
    assert r["store"] is True and r["previous_response_id"] is None and r["conversation"] is None
    got = client.get(f"/v1/responses/{r['id']}")
    assert got.status_code == 200 and got.json() == r  # the same JSON the POST returned
    assert client.delete(f"/v1/responses/{r['id']}").json() == {"id": r["id"], "object": "response", "deleted": True}
    err = error(client.get(f"/v1/responses/{r['id']}"), 404, "response_not_found")
    assert r["id"] in err["message"]
    err = error(client.post("/v1/responses", json={"input": "more", "previous_response_id": r["id"]}),
                404, "response_not_found")
    assert err["message"] == f"Previous response with id '{r['id']}' not found."
    error(client.delete(f"/v1/responses/{r['id']}"), 404, "response_not_found")
    error(client.get("/v1/responses/not-an-id"), 404, "response_not_found")


def test_store_false_keeps_nothing(client):
    r = create(client, input="Hello there", store=False)
    assert r["store"] is False
    error(client.get(f"/v1/responses/{r['id']}"), 404, "response_not_found")
    error(client.post("/v1/responses", json={"input": "more", "previous_response_id": r["id"]}),
          404, "response_not_found")


def test_previous_response_id_sends_the_earlier_turn_first_and_its_kv_is_reused(client):
    agent = "You are a support agent."
    first = create(client, instructions=agent, input=STORY)
    follow = create(client, instructions=agent, input="Thanks. And the photos?", previous_response_id=first["id"])
    assert follow["previous_response_id"] == first["id"]
    # the prompt is the earlier conversation, then the input: the same count as sending it all by hand
    turn_one = [{"role": "user", "content": STORY}, *first["output"]]
    by_hand = create(client, store=False, instructions=agent,
                     input=[*turn_one, {"role": "user", "content": "Thanks. And the photos?"}])
    assert follow["usage"]["input_tokens"] == by_hand["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    # automatic reuse found the earlier prompt's K/V: the follow-up opens with it
    cached = follow["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached > 0.5 * first["usage"]["input_tokens"], follow["usage"]
    # the earlier instructions are not carried over (as at OpenAI): a follow-up without any has none
    bare = create(client, input="Thanks. And the photos?", previous_response_id=first["id"])
    by_hand = create(client, store=False, input=[*turn_one, {"role": "user", "content": "Thanks. And the photos?"}])
    assert bare["instructions"] is None and bare["usage"]["input_tokens"] == by_hand["usage"]["input_tokens"]
    assert bare["usage"]["input_tokens"] < follow["usage"]["input_tokens"]
    # a chain: the third turn sees both earlier ones
    third = create(client, instructions=agent, input="Fine.", previous_response_id=follow["id"])
    by_hand = create(client, store=False, instructions=agent, input=[
        *turn_one, {"role": "user", "content": "Thanks. And the photos?"}, *follow["output"],
        {"role": "user", "content": "Fine."}])
    assert third["usage"]["input_tokens"] == by_hand["usage"]["input_tokens"]
    assert third["usage"]["input_tokens_details"]["cached_tokens"] >= cached
    items = client.get(f"/v1/responses/{follow['id']}/input_items", params={"order": "asc"}).json()
    assert items["object"] == "list" and items["has_more"] is False
    assert [(i["role"], i["content"][0]["text"]) for i in items["data"]] == [("user", "Thanks. And the photos?")]
    assert items["first_id"] == items["last_id"] == items["data"][0]["id"]


def test_function_call_then_its_output_through_previous_response_id(client):
    r = create(client, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=24,
               tool_choice={"type": "function", "name": "get_weather"})
    [call] = [o for o in r["output"] if o["type"] == "function_call"]
    out = create(client, tools=[WEATHER], tool_choice="none", previous_response_id=r["id"],
                 input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}])
    assert out["status"] in ("completed", "incomplete")
    err = error(client.post("/v1/responses", json={"input": [{"type": "function_call_output", "call_id": "call_x",
                                                               "output": "o"}], "previous_response_id": r["id"]}),
                422, "invalid_request")
    assert err["message"].startswith("input.0.call_id"), err


def test_another_tenants_response_is_not_found(client):
    r = create(client, input="Hello there")
    error(client.get(f"/v1/responses/{r['id']}", headers=GLOBEX), 404, "response_not_found")
    error(client.delete(f"/v1/responses/{r['id']}", headers=GLOBEX), 404, "response_not_found")
    error(client.post("/v1/responses", headers=GLOBEX, json={"input": "x", "previous_response_id": r["id"]}),
          404, "response_not_found")
    assert client.get(f"/v1/responses/{r['id']}").status_code == 200  # still there for its own tenant
    conv = client.post("/v1/conversations", json={}).json()
    error(client.get(f"/v1/conversations/{conv['id']}", headers=GLOBEX), 404, "conversation_not_found")
    error(client.post("/v1/responses", headers=GLOBEX, json={"input": "x", "conversation": conv["id"]}),
          404, "conversation_not_found")


def test_conversation_collects_the_items_of_its_responses(client):
    made = client.post("/v1/conversations", json={"metadata": {"topic": "kettle"},
                                                   "items": [{"role": "user", "content": STORY},
                                                             {"role": "assistant", "content": "Sorry to hear it."}]})
    assert made.status_code == 200, made.text
    conv = made.json()
    assert conv["object"] == "conversation" and conv["id"].startswith("conv_")
    assert conv["metadata"] == {"topic": "kettle"}
    assert client.get(f"/v1/conversations/{conv['id']}").json() == conv
    one = create(client, input="Can you replace it?", conversation=conv["id"])
    assert one["conversation"] == {"id": conv["id"]}
    two = create(client, input="When?", conversation={"id": conv["id"]})
    seen = [{"role": "user", "content": STORY}, {"role": "assistant", "content": "Sorry to hear it."},
            {"role": "user", "content": "Can you replace it?"}, *one["output"], {"role": "user", "content": "When?"}]
    by_hand = create(client, store=False, input=seen)
    assert two["usage"]["input_tokens"] == by_hand["usage"]["input_tokens"]  # the second sees the first's items
    assert two["usage"]["input_tokens_details"]["cached_tokens"] > 0
    items = client.get(f"/v1/conversations/{conv['id']}/items", params={"order": "asc", "limit": 100}).json()
    assert [i.get("role", i["type"]) for i in items["data"]] == ["user", "assistant", "user", "assistant", "user",
                                                                  "assistant"]
    assert items["data"][3]["id"] == one["output"][0]["id"] and items["data"][-1]["id"] == two["output"][0]["id"]
    newest = client.get(f"/v1/conversations/{conv['id']}/items", params={"limit": 2}).json()
    assert [i["id"] for i in newest["data"]] == [items["data"][5]["id"], items["data"][4]["id"]] and newest["has_more"]

    err = error(client.post("/v1/responses", json={"input": "x", "conversation": conv["id"],
                                                   "previous_response_id": one["id"]}), 422, "invalid_request")
    assert err["message"].startswith("conversation"), err
    assert client.delete(f"/v1/conversations/{conv['id']}").json() == {
        "id": conv["id"], "object": "conversation.deleted", "deleted": True}
    error(client.get(f"/v1/conversations/{conv['id']}"), 404, "conversation_not_found")
    error(client.post("/v1/responses", json={"input": "x", "conversation": conv["id"]}), 404, "conversation_not_found")
    error(client.delete(f"/v1/conversations/{conv['id']}"), 404, "conversation_not_found")
    error(client.post("/v1/responses", json={"input": "x", "conversation": "conv_unknown"}), 404,
          "conversation_not_found")


def _sse(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_a_streamed_response_is_stored_when_it_completes(client):
    r = client.post("/v1/responses", json={"input": "Hello there", "max_output_tokens": 4, "stream": True})
    events = _sse(r.text)
    assert events[0]["response"]["store"] is True and events[-1]["type"] in ("response.completed",
                                                                              "response.incomplete")
    final = events[-1]["response"]
    assert client.get(f"/v1/responses/{final['id']}").json() == final
    follow = create(client, input="And?", previous_response_id=final["id"], stream=False)
    assert follow["usage"]["input_tokens"] > final["usage"]["input_tokens"]
    r = client.post("/v1/responses", json={"input": "Hello", "max_output_tokens": 2, "stream": True, "store": False})
    final = _sse(r.text)[-1]["response"]
    assert final["store"] is False
    error(client.get(f"/v1/responses/{final['id']}"), 404, "response_not_found")


def test_expiry_on_read_and_by_the_sweep(tmp_path):
    with app(tmp_path, responses_ttl_s=60) as c:
        stored = c.app.state.responses_store
        stored.stop_sweeper()  # this test sweeps itself, on its own clock
        now = [1_000_000.0]
        stored.responses.clock = stored.conversations.clock = lambda: now[0]
        old = create(c, input="Hello there")
        conv = c.post("/v1/conversations", json={}).json()
        now[0] += 59
        assert c.get(f"/v1/responses/{old['id']}").status_code == 200
        fresh = create(c, input="Hello again")
        now[0] += 2  # old is 61 s old, fresh 2 s
        error(c.get(f"/v1/responses/{old['id']}"), 404, "response_not_found")
        error(c.post("/v1/responses", json={"input": "x", "previous_response_id": old["id"]}), 404,
              "response_not_found")
        error(c.get(f"/v1/conversations/{conv['id']}"), 404, "conversation_not_found")
        assert c.get(f"/v1/responses/{fresh['id']}").status_code == 200
        defs = c.app.state.skillcache.definitions
        assert c.portal.call(defs.get, "default.responses", fresh["id"]) is not None
        now[0] += 60  # fresh expired too, never read since: the sweep deletes it from the store
        assert c.portal.call(stored.sweep) == 1
        assert c.portal.call(defs.get, "default.responses", fresh["id"]) is None
        assert c.portal.call(stored.sweep) == 0


def test_the_oldest_go_past_the_per_tenant_bound(tmp_path):
    with app(tmp_path, responses_max_per_tenant=2) as c:
        ids = [create(c, input=f"Hello {i}")["id"] for i in range(3)]
        error(c.get(f"/v1/responses/{ids[0]}"), 404, "response_not_found")
        assert [c.get(f"/v1/responses/{i}").status_code for i in ids[1:]] == [200, 200]
        convs = [c.post("/v1/conversations", json={}).json()["id"] for _ in range(2)]
        create(c, input="Hi", conversation=convs[0], store=False)  # used: now the most recent of the two
        c.post("/v1/conversations", json={})
        assert c.get(f"/v1/conversations/{convs[0]}").status_code == 200
        error(c.get(f"/v1/conversations/{convs[1]}"), 404, "conversation_not_found")
        # the sweep applies the bound to documents this process did not write (another replica's)
        stored = c.app.state.responses_store
        stored.responses._order.clear()
        assert c.portal.call(stored.sweep) == 0
        stored.responses.max = 1
        assert c.portal.call(stored.sweep) == 1
        assert [c.get(f"/v1/responses/{i}").status_code for i in ids[1:]] == [404, 200]


def test_a_second_app_over_the_same_store_resumes_the_response(tmp_path):
    """Two replicas on one disk store (their definitions directory): one stores, the other continues and deletes."""
    with app(tmp_path) as a, app(tmp_path, runtime=tiny_runtime.__wrapped__("llama")) as b:
        r = create(a, input=STORY)
        follow = create(b, input="And then?", previous_response_id=r["id"])
        assert follow["usage"]["input_tokens"] > r["usage"]["input_tokens"]
        assert b.get(f"/v1/responses/{r['id']}").json()["output"] == r["output"]
        b.delete(f"/v1/responses/{r['id']}")
        error(a.get(f"/v1/responses/{r['id']}"), 404, "response_not_found")


def test_replicas_on_redis_share_responses_and_conversations(tmp_path):
    redis_or_skip()
    with RedisServer() as srv:
        on_redis = {"store": "redis", "redis_url": srv.url}
        with app(tmp_path / "a", **on_redis) as a, \
                app(tmp_path / "b", runtime=tiny_runtime.__wrapped__("llama"), **on_redis) as b:
            r = create(a, input=STORY)
            follow = create(b, input="And then?", previous_response_id=r["id"])
            assert follow["previous_response_id"] == r["id"]
            assert a.get(f"/v1/responses/{follow['id']}").json() == follow
            conv = a.post("/v1/conversations", json={}).json()
            create(b, input="Hi", conversation=conv["id"])
            assert len(a.get(f"/v1/conversations/{conv['id']}/items").json()["data"]) == 2


def test_the_openai_sdk(sdk):
    r = sdk.responses.create(model="m", input="Hello there", max_output_tokens=4)
    assert r.store is True
    follow = sdk.responses.create(model="m", input="And then?", max_output_tokens=4, previous_response_id=r.id)
    assert follow.previous_response_id == r.id and follow.usage.input_tokens > r.usage.input_tokens
    got = sdk.responses.retrieve(follow.id)
    assert got.id == follow.id and got.output_text == follow.output_text and got.usage == follow.usage
    [item] = sdk.responses.input_items.list(follow.id).data
    assert item.type == "message" and item.content[0].text == "And then?"
    assert sdk.responses.delete(r.id) is None
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model="m", input="x", max_output_tokens=2, previous_response_id=r.id)

    conv = sdk.conversations.create(items=[{"role": "user", "content": "My name is Ada."}], metadata={"a": "b"})
    assert sdk.conversations.retrieve(conv.id).metadata == {"a": "b"}
    one = sdk.responses.create(model="m", input="What is my name?", max_output_tokens=4, conversation=conv.id)
    assert one.conversation.id == conv.id
    assert len(sdk.conversations.items.list(conv.id).data) == 3
    assert sdk.conversations.delete(conv.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.retrieve(conv.id)


def test_the_agents_sdk_continues_with_previous_response_id(client):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner

    async def run():
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            oai = AsyncOpenAI(base_url="http://testserver/v1", api_key="acme-user-key-0123456789", http_client=http,
                              max_retries=0)
            # stop strings keep the random model's replies short of max_tokens (an incomplete reply raises there)
            stop = [" ", "e", "a", "o", "t", "0", "3", "F"]
            settings = ModelSettings(temperature=0.0, max_tokens=64, extra_body={"stop": stop})
            agent = Agent(name="a", instructions="Be brief.", model=OpenAIResponsesModel("m", oai),
                          model_settings=settings)
            config = RunConfig(tracing_disabled=True)
            first = await Runner.run(agent, STORY, run_config=config)
            second = await Runner.run(agent, "And the photos?", run_config=config,
                                      previous_response_id=first.last_response_id)
            return first, second

    first, second = client.portal.call(run)
    one = client.get(f"/v1/responses/{first.last_response_id}").json()
    two = client.get(f"/v1/responses/{second.last_response_id}").json()
    assert one["previous_response_id"] is None and two["previous_response_id"] == one["id"]
    assert two["instructions"] == "Be brief." and second.final_output == two["output"][0]["content"][0]["text"]
    # the second turn's prompt is the first's, then its input: the first's K/V are found
    assert two["usage"]["input_tokens"] > one["usage"]["input_tokens"]
    assert two["usage"]["input_tokens_details"]["cached_tokens"] > 0.5 * one["usage"]["input_tokens"], two["usage"]
