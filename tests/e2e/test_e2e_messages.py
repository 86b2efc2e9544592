"""The Messages API end to end: a real service (uvicorn, the embedded model, API keys on) driven by the official
anthropic SDK. Text, a stream (text_stream and the final message), a forced tool call and its result in the next
turn, a cache_control system block created once then read from cache (at its first position and composed after
another block), and the x-api-key header (401 without it). One server for the module; replies are kept short."""

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.devserver import ROOT, ServiceNotReady, ServiceProcess

pytestmark = pytest.mark.slow

KEY = "e2e-messages-key-0123456789"
POLICY = (ROOT / "skills" / "refund-policy.md").read_text()[:1200]  # a block of ~250 tokens
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home, skills = tmp_path_factory.mktemp("home"), tmp_path_factory.mktemp("skills")  # no skills to preload
    keys = home / "keys.json"
    keys.write_text(json.dumps([{"key": KEY, "namespace": "default", "role": "admin"}]))
    env = {"SKILLCACHE_SKILLS_DIR": str(skills), "SKILLCACHE_API_KEYS_FILE": str(keys)}
    with ServiceProcess(home, env, threads=None) as svc:
        try:
            svc.wait_ready(300)
        except ServiceNotReady as e:
            pytest.fail(str(e))
        yield svc.url


@pytest.fixture(scope="module")
def client(server):
    import anthropic

    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=300)


def test_x_api_key_is_required_and_accepted(server):
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    for headers in ({}, {"x-api-key": "not-a-key-0000000000"}):
        r = httpx.post(f"{server}/v1/messages", json=body, headers=headers, timeout=60)
        assert r.status_code == 401, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{server}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=300)
    assert r.status_code == 200 and r.json()["type"] == "message", r.text


def test_create_text(client):
    m = client.messages.create(model="smollm2", max_tokens=8, system="You are a helpful assistant.",
                               messages=[{"role": "user", "content": "What is the capital of France?"}])
    print("create:", m.model_dump_json(exclude_none=True))
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens") and 0 < m.usage.output_tokens <= 8
    assert m.usage.input_tokens > 0 and m.id.startswith("msg_")


def test_stream_text_and_final_message(client):
    with client.messages.stream(model="smollm2", max_tokens=8,
                                messages=[{"role": "user", "content": "Name three colors."}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens") and 0 < final.usage.output_tokens <= 8
    assert final.usage.input_tokens > 0


def test_tool_use_then_tool_result(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = client.messages.create(model="smollm2", max_tokens=24, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather"}, messages=ask)
    print("tool_use:", m.model_dump_json(exclude_none=True))
    [call] = [b for b in m.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input, dict) and m.stop_reason in ("tool_use", "max_tokens")
    assert m.usage.cache_creation_input_tokens > 0  # the tools block, compiled by this request
    answer = client.messages.create(model="smollm2", max_tokens=6, tools=[WEATHER], messages=[
        *ask, {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": [{"type": "text", "text": '{"temp_c": 18, "sky": "cloudy"}'}]}]}])
    print("after tool_result:", answer.model_dump_json(exclude_none=True))
    assert answer.type == "message" and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.cache_read_input_tokens >= m.usage.cache_creation_input_tokens  # the tools block, cached


def compiled_blocks(server: str) -> float:
    """skillcache_auto_blocks_total{outcome="compiled"}: automatic blocks compiled in the background so far."""
    families = text_string_to_metric_families(httpx.get(f"{server}/metrics", timeout=30).text)
    return sum(s.value for f in families for s in f.samples
               if s.name == "skillcache_auto_blocks_total" and s.labels.get("outcome") == "compiled")


def test_cache_control_block_is_read_from_cache_again_and_after_another_block(client, server):
    system = [{"type": "text", "text": POLICY, "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Answer in one sentence."}]

    def ask(question: str, system=system):
        return client.messages.create(model="smollm2", max_tokens=2, system=system,
                                      messages=[{"role": "user", "content": question}])

    before = compiled_blocks(server)
    first = ask("Can I return an opened blender?")
    n = first.usage.cache_creation_input_tokens  # queued for compiling in the background (automatic reuse is on)
    assert n > 200 and first.usage.cache_read_input_tokens == 0
    assert first.model_extra["skillcache"]["skills"] == []  # computed as text this time, off the compile clock
    second = ask("How long do refunds take?")
    print("usage:", first.usage, second.usage)
    assert second.usage.cache_read_input_tokens >= 0.9 * n  # the automatic head, or the block once compiled
    for _ in range(120):  # the block compiles when the engine is idle
        if compiled_blocks(server) > before:
            break
        time.sleep(0.5)
    preamble = {"type": "text", "text": "You work for Acme Kitchen, an online shop.",
                "cache_control": {"type": "ephemeral"}}
    moved = ask("Can I return a knife?", system=[preamble, *system])
    (policy,) = moved.model_extra["skillcache"]["skills"]  # the new preamble is text, queued in turn
    print("moved:", moved.usage, policy)
    assert policy["source"] == "memory" and policy["path"] == "compose"
    assert moved.usage.cache_read_input_tokens >= 0.9 * n
    assert moved.usage.input_tokens + moved.usage.cache_creation_input_tokens + \
        moved.usage.cache_read_input_tokens > n
