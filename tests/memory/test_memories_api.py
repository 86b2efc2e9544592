"""/v1/memories, and memories in sessions and /v1/compose, on the tiny model in process."""

import math

import pytest
import torch

from appclient import make_client

LINES = [f"- [profile] fact_{i}: value number {i} for this user" for i in range(12)]
MEM = "# USER MEMORY\n" + "\n".join(LINES) + "\n- order_count: 12"
POLICY = "Refunds are allowed within 30 days. Deny refunds for shipped orders."


@pytest.fixture
def app(tmp_path):
    with make_client(tmp_path) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        assert c.post("/v1/skills", json={"name": "policy", "text": POLICY}).status_code == 201
        yield c


def _err(r, status, kind):
    assert r.status_code == status, r.text
    assert r.json()["error"]["type"] == kind, r.text


def test_create_read_replace_delete(app):
    r = app.post("/v1/memories", json={"name": "ada", "text": MEM})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["revision"] == 1 and body["text"] == MEM and len(body["blocks"]) == 1
    assert [f["label"] for f in body["facts"]] == [f"fact_{i}" for i in range(12)] + ["order_count"]
    assert body["facts"][0] == {"label": "fact_0", "category": "profile", "value": "value number 0 for this user",
                                "block": 0}
    assert app.post("/v1/memories", json={"name": "ada", "text": MEM}).status_code == 200  # the same again
    _err(app.post("/v1/memories", json={"name": "ada", "text": MEM + "\nmore"}), 409, "memory_conflict")
    assert app.get("/v1/memories/ada").json() == body
    r = app.put("/v1/memories/ada", json={"text": MEM + "\n- extra: yes"})
    assert r.status_code == 200 and r.json()["revision"] == 2 and r.json()["facts"][-1]["label"] == "extra"
    assert app.put("/v1/memories/bob", json={"text": "- a: 1"}).status_code == 201
    listed = app.get("/v1/memories").json()["memories"]
    assert [(m["name"], m["revision"], m["n_blocks"]) for m in listed] == [("ada", 2, 1), ("bob", 1, 1)]
    assert app.delete("/v1/memories/ada").json() == {"deleted": "ada"}
    _err(app.get("/v1/memories/ada"), 404, "memory_not_found")
    _err(app.delete("/v1/memories/ada"), 404, "memory_not_found")


def test_invalid_memories_and_edits(tmp_path):
    with make_client(tmp_path, max_memory_tokens=50) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        _err(c.post("/v1/memories", json={"name": "Bad_Name", "text": "x"}), 422, "invalid_request")
        _err(c.get("/v1/memories/Bad_Name"), 422, "invalid_memory")
        _err(c.post("/v1/memories", json={"name": "m", "text": "- a: 1\n- a: 2"}), 422, "invalid_memory")
        _err(c.post("/v1/memories", json={"name": "m", "text": MEM}), 413, "limit_exceeded")
        assert c.post("/v1/memories", json={"name": "m", "text": "- a: 1\n- b: 2"}).status_code == 201
        _err(c.patch("/v1/memories/m", json={"edits": [{"label": "zz", "value": "1"}]}), 422, "invalid_memory")
        _err(c.patch("/v1/memories/m", json={"edits": [{"label": "a", "value": "x\ny"}]}), 422, "invalid_memory")
        _err(c.patch("/v1/memories/m", json={"edits": [{"label": "a", "value": "1", "mode": "bogus"}]}), 422,
             "invalid_request")
        _err(c.patch("/v1/memories/nope", json={"edits": [{"label": "a", "value": "1"}]}), 404, "memory_not_found")
        assert c.get("/v1/memories/m").json()["revision"] == 1  # nothing of the failed edits was stored


def test_edits_touch_only_their_block_and_say_what_was_done(app):
    state = app.app.state.skillcache
    r = app.post("/v1/memories", json={"name": "ada", "text": MEM, "max_block_tokens": 60})
    blocks = r.json()["blocks"]
    assert len(blocks) >= 3
    hashes = [b["content_hash"] for b in blocks]
    last = len(blocks) - 1
    compiles = []
    real = state.memories.kv.rt.compile_block_steps
    state.memories.kv.rt.compile_block_steps = lambda ids, **kw: (compiles.append(len(ids)), real(ids, **kw))[1]
    try:
        r = app.patch("/v1/memories/ada", json={"edits": [
            {"label": "fact_0", "value": "changed for good"},  # erratum (the default)
            {"label": "fact_1", "value": "recompiled value", "mode": "recompile"},
            {"label": "order_count", "value": "34", "mode": "in_place"},
            {"label": "fact_3", "value": "value number 3 for this user"}]})  # what it says already
    finally:
        state.memories.kv.rt.compile_block_steps = real
    assert r.status_code == 200, r.text
    body = r.json()
    edits = {e["label"]: e for e in body["edits"]}
    assert edits["fact_0"]["mode"] == "erratum" and edits["fact_0"]["block"] == 0
    assert edits["fact_0"]["lines"] == ["[MEMORY UPDATE] fact_0 has changed to changed for good; this overrides any "
                                        "earlier value AND any earlier conclusion. Apply the current value."]
    b1 = edits["fact_1"]["block"]
    assert (edits["fact_1"]["mode"] == "recompile"
            and edits["fact_1"]["recomputed_tokens"] == body["blocks"][b1]["n_tokens"])
    assert edits["order_count"]["mode"] == "in_place" and edits["order_count"]["block"] == last
    assert 0 < edits["order_count"]["recomputed_tokens"] <= 3
    assert edits["fact_3"]["mode"] == "unchanged"
    assert len(compiles) == 1  # one block recompiled; the in-place edit ran only the value's tokens
    new = [b["content_hash"] for b in body["blocks"]]
    assert [i for i, (a, b) in enumerate(zip(hashes, new)) if a != b] == sorted({b1, last})
    assert body["blocks"][last]["in_place_edits"] == 1 and body["blocks"][0]["errata"] == {"fact_0": "changed for good"}
    assert "- [profile] fact_0: changed for good" in body["text"] and "- order_count: 34" in body["text"]
    assert body["revision"] == 2
    # the blocks only the old revision used are gone from the store; the new ones are there
    ns = "default"
    assert not app.portal.call(state.store.contains, state.memories.kv.key(ns, hashes[b1]))
    assert app.portal.call(state.store.contains, state.memories.kv.key(ns, new[b1]))
    assert app.portal.call(state.store.contains, state.memories.kv.key(ns, new[last]))


def _full_top(state, plan, k=5):
    lp = torch.log_softmax(state.runtime.prefill(plan, [], mode="full").logits, -1)
    return torch.topk(lp, k).values.tolist()


def test_a_session_floats_the_memory_before_each_turn_and_never_caches_it(app):
    state = app.app.state.skillcache
    app.post("/v1/memories", json={"name": "ada", "text": MEM})
    s = app.post("/v1/sessions", json={"skills": ["policy"], "system": "Be brief.", "memory": "ada",
                                       "memory_seam_tokens": 4096}).json()  # the whole memory recomputed: exact
    assert s["memory"] == "ada"
    sid, mem_ids = s["id"], None
    recomputed = []
    for turn, user in enumerate(["Refund?", "And for order 1043?", "Still?"]):
        live = state.sessions.live[sid]
        late = app.portal.call(state.memories.resolve, "default", "ada")
        mem_ids = late.ids[0]
        plan = state.runtime.prompts.build(state.sessions._head(live) + live.messages + [
            {"role": "user", "content": user}], live.skill_ids, live.base_errata, late_ids=late.ids,
            late_lines=late.lines)
        expect = _full_top(state, plan)
        r = app.post(f"/v1/sessions/{sid}/turns", json={"user": user, "max_tokens": 4, "logprobs": 5})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["prompt_tokens"] == plan.n_tokens
        assert body["memory"]["name"] == "ada" and body["memory"]["blocks"][0]["n_tokens"] == len(mem_ids)
        if turn == 0:  # nothing before the memory ever saw it: with the whole memory as seam this is exact
            assert all(math.isclose(x["logprob"], e, abs_tol=1e-3) for x, e in zip(body["logprobs"], expect))
        recomputed.append(body["usage"]["recomputed_tokens"])
        live = state.sessions.live[sid]
        assert live.cache.get_seq_length() == len(live.ids)
        assert not any(live.ids[i:i + len(mem_ids)] == mem_ids for i in range(len(live.ids)))  # not in the cache
    info = app.get(f"/v1/sessions/{sid}").json()
    assert info["turns"] == 3 and info["memory"] == "ada"
    # an erratum edit between turns: the next turn states it after the memory, and only the line is new work
    app.patch("/v1/memories/ada", json={"edits": [{"label": "fact_2", "value": "now different"}]})
    r = app.post(f"/v1/sessions/{sid}/turns", json={"user": "Still?", "max_tokens": 2}).json()
    assert r["memory"]["lines"] == ["[MEMORY UPDATE] fact_2 has changed to now different; this overrides any earlier "
                                    "value AND any earlier conclusion. Apply the current value."]
    assert r["memory"]["revision"] == 2
    assert r["usage"]["recomputed_tokens"] > recomputed[-1]


def test_recomputed_tokens_do_not_grow_with_the_conversation(app):
    app.post("/v1/memories", json={"name": "ada", "text": MEM})
    sid = app.post("/v1/sessions", json={"skills": ["policy"], "memory": "ada"}).json()["id"]
    usage = [app.post(f"/v1/sessions/{sid}/turns", json={"user": "Refund now?", "max_tokens": 6}).json()["usage"]
             for _ in range(4)]
    n_mem = app.get("/v1/memories/ada").json()["n_tokens"]
    for u in usage:
        assert u["composed_tokens"] == n_mem - 1  # the memory copied but its one seam token
        assert u["recomputed_tokens"] < 40
    assert usage[-1]["prefix_tokens"] > usage[0]["prefix_tokens"] + 30  # the conversation grew
    assert max(u["recomputed_tokens"] for u in usage[1:]) - min(u["recomputed_tokens"] for u in usage[1:]) <= 8


def test_compose_with_a_memory_and_the_session_resumed_elsewhere(tmp_path):
    with make_client(tmp_path) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        c.post("/v1/skills", json={"name": "policy", "text": POLICY})
        c.post("/v1/memories", json={"name": "ada", "text": MEM})
        body = {"skills": ["policy"], "memory": "ada", "user": "Refund?", "max_tokens": 3}
        comp = c.post("/v1/compose", json=body).json()
        full = c.post("/v1/compose", json={**body, "mode": "full"}).json()
        assert comp["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]
        n_mem = comp["memory"]["n_tokens"]
        assert comp["usage"]["composed_tokens"] >= n_mem - 1 and full["usage"]["composed_tokens"] == 0
        assert comp["memory"]["blocks"][0]["seam"] == 1
        _err(c.post("/v1/compose", json={**body, "memory": "nope"}), 404, "memory_not_found")
        sid = c.post("/v1/sessions", json={"skills": ["policy"], "memory": "ada"}).json()["id"]
        _err(c.post("/v1/sessions", json={"skills": ["policy"], "memory": "nope"}), 404, "memory_not_found")
        assert c.post(f"/v1/sessions/{sid}/turns", json={"user": "hi", "max_tokens": 2}).status_code == 200
        c.portal.call(c.app.state.skillcache.sessions.drain)
    with make_client(tmp_path) as c2:  # another process on the same store: memory and session are both there
        c2.portal.call(c2.app.state.skillcache.wait_ready)
        assert c2.get("/v1/memories/ada").json()["text"] == MEM
        r = c2.post(f"/v1/sessions/{sid}/turns", json={"user": "again", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["memory"]["name"] == "ada"
        c2.delete("/v1/memories/ada")
        _err(c2.post(f"/v1/sessions/{sid}/turns", json={"user": "and now?", "max_tokens": 2}), 404,
             "memory_not_found")


def test_a_memory_turn_counts_its_tokens_once_by_kind(app):
    """The copied memory is `composed`, the conversation's own cache `prefix`: not both counted as prefix."""
    from service import metrics

    def counts() -> dict[str, float]:
        return {k: metrics.TOKENS.labels(k)._value.get() for k in ("prefix", "composed", "recomputed")}

    app.post("/v1/memories", json={"name": "ada", "text": MEM})
    sid = app.post("/v1/sessions", json={"skills": ["policy"], "memory": "ada"}).json()["id"]
    app.post(f"/v1/sessions/{sid}/turns", json={"user": "Refund now?", "max_tokens": 4})
    before = counts()
    body = app.post(f"/v1/sessions/{sid}/turns", json={"user": "And now?", "max_tokens": 4}).json()
    after = counts()
    u = body["usage"]
    assert u["composed_tokens"] > 0 and u["prefix_tokens"] > 0
    assert after["prefix"] - before["prefix"] == u["prefix_tokens"]
    assert after["composed"] - before["composed"] == u["composed_tokens"]
    assert after["recomputed"] - before["recomputed"] == u["recomputed_tokens"]
    t = body["timings"]
    assert 0 < t["store_ms"] <= t["ttft_ms"] <= t["total_ms"]  # finding the memory's blocks is part of the turn


def test_chat_completions_take_a_memory_as_compose_does(app):
    """The composition part is one model for every API: a memory named on chat completions is placed and reported
    as on /v1/compose (the same prompt, the memory's tokens composed)."""
    assert app.post("/v1/memories", json={"name": "ada", "text": MEM}).status_code == 201
    comp = app.post("/v1/compose", json={"skills": ["policy"], "memory": "ada", "user": "Refund?",
                                         "max_tokens": 3}).json()
    chat = app.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Refund?"}],
                                                  "skills": ["policy"], "memory": "ada", "max_tokens": 3})
    assert chat.status_code == 200, chat.text
    u = chat.json()["usage"]
    assert u["prompt_tokens"] == comp["usage"]["prompt_tokens"]
    assert u["prompt_tokens_details"]["cached_tokens"] >= comp["memory"]["n_tokens"] - 1
    assert chat.json()["skillcache"]["memory"]["name"] == "ada"
    _err(app.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "memory": "nope"}),
         404, "memory_not_found")
