"""Automatic exact heads (SKILLCACHE_AUTO_REUSE, service/compose/auto.py): a repeated prompt head is served from the
head tree with no registration, through all four APIs, exactly as a full prefill, per tenant, within its budget."""

import json
from contextlib import contextmanager

import pytest
import torch

from appclient import make_client
from service import metrics
from service.kv.radix import RadixHeads
from service.runtime.steps import run_steps
from tests.store.store_helpers import metric
from tiny import tiny_runtime

RULES = ["Refunds are allowed within 30 days of delivery when the item is unused.",
         "The assistant must check the order status before approving any request.",
         "Tool specs: search(query), lookup(order_id), refund(order_id, amount).",
         "Answer politely and briefly. Use the current value of every field."]


def system_text(tag: str, n_tokens: int = 2000) -> str:
    """A system prompt of at least n_tokens tiny-tokenizer tokens, distinct per tag."""
    rt = tiny_runtime("llama")
    lines: list[str] = [f"You are the {tag} agent."]
    while len(rt.prompts.encode_content("\n".join(lines))) < n_tokens:
        lines.append(f"Rule {len(lines)}: {RULES[len(lines) % len(RULES)]}")
    return "\n".join(lines)


def n_tokens(text: str) -> int:
    return len(tiny_runtime("llama").prompts.encode_content(text))


@contextmanager
def client(tmp_path, **kw):
    """The shared test client with automatic heads on (its default: off), ready."""
    with make_client(tmp_path, **{"auto_reuse": True, "torch_threads": 1, **kw}) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        yield c


def chat(c, system: str, user: str, headers=None) -> dict:
    r = c.post("/v1/chat/completions", headers=headers or {}, json={"max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]})
    assert r.status_code == 200, r.text
    return r.json()


def cached_via(c, api: str, system: str, user: str) -> tuple[int, dict]:
    """The cached prompt tokens a request through `api` reports, and its body."""
    if api == "chat":
        body = chat(c, system, user)
        return body["usage"]["prompt_tokens_details"]["cached_tokens"], body
    if api == "compose":
        r = c.post("/v1/compose", json={"system": system, "user": user, "max_tokens": 2})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["reused_tokens"], r.json()
    if api == "responses":
        r = c.post("/v1/responses", json={"instructions": system, "input": user, "max_output_tokens": 2})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["input_tokens_details"]["cached_tokens"], r.json()
    # system as one text block: a plain string over 256 characters is refused today (the schema's max_length=256
    # meant for the block list applies to the string too)
    r = c.post("/v1/messages", json={"model": "m", "max_tokens": 2, "system": [{"type": "text", "text": system}],
                                     "messages": [{"role": "user", "content": user}]})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["cache_read_input_tokens"], r.json()


def test_a_repeated_system_prompt_is_cached_through_every_api(tmp_path):
    with client(tmp_path) as c:
        for api in ("compose", "chat", "responses", "messages"):
            system = system_text(api)
            n = n_tokens(system)
            assert n >= 2000
            first, _ = cached_via(c, api, system, "Can I get a refund?")
            again, body = cached_via(c, api, system, "Where is my order, please?")
            assert first == 0, api
            assert again >= 0.9 * n, (api, again, n)
            if api == "compose":
                u = body["usage"]
                assert u["auto_tokens"] == u["prefix_tokens"] == again and u["composed_tokens"] == 0
                assert u["recomputed_tokens"] == u["prompt_tokens"] - again


def test_switched_off_nothing_is_cached(tmp_path):
    with client(tmp_path, auto_reuse=False) as c:
        system = system_text("off", 300)
        chat(c, system, "Can I get a refund?")
        assert chat(c, system, "Where is my order?")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("family", ["llama", "gemma3", "deepseek_v3", "qwen2"])
def test_a_served_head_gives_the_full_prefills_logits(family):
    rt = tiny_runtime(family)
    system = system_text("exact", 400)
    one = rt.prompts.build([{"role": "system", "content": system}, {"role": "user", "content": "Can I get a refund?"}],
                           [])
    two = rt.prompts.build([{"role": "system", "content": system}, {"role": "user", "content": "Where is it?"}], [])
    tree = RadixHeads(1 << 30, min_tokens=16)
    first = rt.prefill(one, [], mode="full")
    tree.insert_cache(("default", rt.fingerprint), one.ids, first.cache)
    hit = tree.match(("default", rt.fingerprint), two.ids, limit=two.n_tokens - 1)
    assert hit is not None and hit.n_tokens >= n_tokens(system)
    served = run_steps(rt.prefill_steps(two, [], mode="compose", prefix=hit, chunk=64))
    full = rt.prefill(two, [], mode="full")
    torch.testing.assert_close(served.logits, full.logits, atol=1e-5, rtol=1e-5)
    for a, b in zip(served.cache.layers, full.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)  # [1, H_kv, T, D]
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
    assert (served.n_prefix, served.n_reused, served.n_exact) == (hit.n_tokens, 0, two.n_tokens)
    assert served.cache.layers[0].keys.data_ptr() != hit.spans[0][0][0].data_ptr()  # its own copy
    served.cache.layers[0].keys.zero_()
    again = tree.match(("default", rt.fingerprint), two.ids, limit=two.n_tokens - 1)
    kept = again.spans[0][0][0]  # layer 0's keys of the head's first span: [1, H_kv, t, D], untouched
    torch.testing.assert_close(kept, full.cache.layers[0].keys[:, :, :kept.shape[2]], atol=1e-5, rtol=1e-5)


def _compose(c, **kw) -> dict:
    r = c.post("/v1/compose", json={"user": "Can I get a refund?", "max_tokens": 4, "logprobs": 3, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_in_the_service_the_served_head_answers_as_the_full_prefill(tmp_path):
    system = system_text("logits", 300)
    with client(tmp_path) as c:
        _compose(c, system=system, user="First question?")
        hit = _compose(c, system=system)
        full = _compose(c, system=system, mode="full")
        assert hit["usage"]["auto_tokens"] >= n_tokens(system) and full["usage"]["auto_tokens"] == 0
        assert hit["text"] == full["text"]
        for got, want in zip(hit["logprobs"], full["logprobs"]):
            assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-4)


def test_composed_kv_is_kept_only_up_to_its_first_rotated_block(tmp_path):
    with client(tmp_path) as c:
        state = c.app.state.skillcache
        texts = [" ".join(RULES * 3), " ".join(reversed(RULES * 3))]
        for name, text in zip("ab", texts):
            assert c.post("/v1/skills", json={"name": name, "text": text}).status_code == 201
        first = _compose(c, skills=["a", "b"], seam_tokens=2)
        assert [s["path"] for s in first["skills"]] == ["compose", "compose"]
        rt = state.runtime
        plan = rt.prompts.build([{"role": "user", "content": "Can I get a refund?"}],
                                [rt.prompts.encode_content(t) for t in texts])
        b_at = plan.skill_offsets()[1]
        tree = state.pipeline.auto.tree
        assert tree.longest(("default", rt.fingerprint), plan.ids) == b_at + 2  # a exact, b's seam exact, no more
        again = _compose(c, skills=["a", "b"], seam_tokens=2)
        assert [s["path"] for s in again["skills"]] == ["prefix", "compose"]
        assert again["usage"]["auto_tokens"] == b_at  # cut back to b's start: a head never ends inside a block


def _keys(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"key": "acme-user-key-0123456789", "namespace": "acme", "role": "user"},
                                {"key": "globex-user-key-0123456789", "namespace": "globex", "role": "user"}]))
    return path


def test_one_tenants_heads_never_serve_another(tmp_path):
    acme = {"Authorization": "Bearer acme-user-key-0123456789"}
    globex = {"Authorization": "Bearer globex-user-key-0123456789"}
    system = system_text("tenant", 300)
    with client(tmp_path, api_keys_file=_keys(tmp_path)) as c:
        cached = lambda body: body["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
        assert cached(chat(c, system, "Can I get a refund?", acme)) == 0
        assert cached(chat(c, system, "Where is my order?", globex)) == 0  # the same text, another tenant
        assert cached(chat(c, system, "And my invoice?", acme)) >= 0.9 * n_tokens(system)
        assert cached(chat(c, system, "And my invoice?", globex)) >= 0.9 * n_tokens(system)  # its own, kept now


def test_a_stream_of_distinct_prompts_stays_within_the_budget_and_metrics_move(tmp_path):
    budget = 1024**2
    with client(tmp_path, auto_cache_bytes=budget) as c:
        state = c.app.state.skillcache
        tree = state.pipeline.auto.tree
        hits, auto = metric("skillcache_auto_head_lookups_total", result="hit"), \
            metric("skillcache_prompt_tokens_total", kind="auto")
        evicted = metric("skillcache_auto_cache_evictions_total")
        for i in range(8):
            chat(c, f"{i} " + system_text(f"stream {i}", 300), "Hello?")
            assert tree.bytes_used <= budget
            assert metric("skillcache_auto_cache_bytes") == tree.bytes_used
        assert metric("skillcache_auto_cache_evictions_total") > evicted
        assert metric("skillcache_auto_head_lookups_total", result="hit") == hits  # none repeated
        system = system_text("repeat", 300)
        chat(c, system, "Hello?")
        body = chat(c, system, "Hello again?")
        assert metric("skillcache_auto_head_lookups_total", result="hit") == hits + 1
        assert metric("skillcache_prompt_tokens_total", kind="auto") == \
            auto + body["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert metrics.AUTO_BYTES._value.get() <= budget


@pytest.mark.parametrize("extra", [
    {"fields": {"plan": "y"}, "edit_mode": "in_place"},
    {"fields": {"plan": "y"}, "edit_mode": "field+erratum"},
    {"fields": {"plan": "y"}, "edit_mode": "recompile"},
    {"fields": {"plan": "y"}},
    {"memory": "m"},
    {"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object",
                                                                                  "properties": {}}}}]},
    {"tools": [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
               for n in ("f", "g")], "tool_choice": "required"},
    {"mode": "full"},
])
def test_every_kind_of_request_repeats_with_counts_that_add_up(tmp_path, extra):
    """Edits, memories, tools and mode=full with heads kept and served: the counts add up, and a head never
    reaches into an edited block or the late blocks."""
    system = system_text("mixed", 200)
    with client(tmp_path) as c:
        assert c.post("/v1/skills", json={"name": "f", "text": "The plan is {{plan}}. " + " ".join(RULES),
                                          "fields": {"plan": "x"}}).status_code == 201
        assert c.post("/v1/skills", json={"name": "a", "text": " ".join(reversed(RULES))}).status_code == 201
        assert c.post("/v1/memories", json={"name": "m", "text": "- plan: gold\n- city: Oslo"}).status_code in (200,
                                                                                                            201)
        bodies = [_compose(c, skills=["f", "a"], system=system, user=u, **extra) for u in ("One?", "Two?", "One?")]
    for body in bodies:
        u = body["usage"]
        assert u["reused_tokens"] + u["recomputed_tokens"] == u["prompt_tokens"]
        assert u["reused_tokens"] == u["composed_tokens"] + u["prefix_tokens"] >= u["auto_tokens"]
    if extra.get("edit_mode") in ("in_place", "field+erratum"):
        assert all(b["edits"][0]["mode"] == extra["edit_mode"] for b in bodies)
        assert all(b["skills"][0]["path"] != "prefix" for b in bodies)  # the edited first skill is never in a head
    if extra.get("mode") == "full":
        assert all(b["usage"]["auto_tokens"] == 0 for b in bodies)
    elif "fields" in extra and extra.get("edit_mode") in (None, "recompile"):
        assert bodies[2]["usage"]["auto_tokens"] > 0


def test_where_a_head_may_end_and_the_switches():
    from service.compose.auto import AutoHeads, head_clip, head_limit
    from service.config import Settings
    from service.runtime.prompt import PromptPlan, Segment

    plan = PromptPlan([Segment("text", [1] * 5), Segment("skill", [2] * 10, 0), Segment("text", [3] * 4),
                       Segment("skill", [4] * 6, 1), Segment("text", [5] * 3)])
    assert head_limit(plan) == plan.n_tokens - 1 == 27
    assert [head_clip(plan, m) for m in (0, 5, 9, 15, 17, 20, 22, 26)] == [0, 5, 5, 15, 17, 19, 19, 26]
    plan.segments[3].recompute = [(1, 2)]  # an edited block: no head reaches into it
    assert head_limit(plan) == 19
    plan.segments[3].recompute = []
    plan.late_span = (15, 25)  # a memory placed late: re-rotated there, never from a head
    assert head_limit(plan) == 15
    assert AutoHeads(Settings(auto_cache_bytes=0), "fp").enabled is False
    assert AutoHeads(Settings(auto_reuse=False), "fp").enabled is False
    assert AutoHeads(Settings(), "fp").enabled is True  # the service's default: on
