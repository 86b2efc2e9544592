"""Sessions: exact incremental turns, errata on a cached prefix, persistence and resume, bounds."""

import math

import pytest

from appclient import make_client
from service.runtime.fidelity import compare  # noqa: F401  (import check: runtime helpers load)

POLICY = "Refunds are allowed within 30 days. The order status is {{status}}. Deny refunds for shipped orders."


@pytest.fixture
def app(tmp_path):
    with make_client(tmp_path) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        c.post("/v1/skills", json={"name": "policy", "text": POLICY, "fields": {"status": "delivered"}})
        yield c


def _full_top(client, sid, user, fields, k=5):
    """Top-k logprobs of a full prefill of exactly the tokens the session will hold for this turn."""
    state = client.app.state.skillcache
    mgr = state.sessions
    s = mgr.live[sid]
    tmpl = state.settings.erratum_template
    errata = [tmpl.format(field=f, value=v) for f, v in fields.items() if s.fields[f] != v]
    content = "\n".join(errata) + "\n\n" + user if errata else user
    plan = mgr.rt.prompts.build(mgr._head(s) + s.messages + [{"role": "user", "content": content}],
                                s.skill_ids, s.base_errata)
    import torch

    logits = mgr.rt.prefill(plan, [], mode="full").logits
    lp = torch.log_softmax(logits, -1)
    vals, ids = torch.topk(lp, k)
    return [(mgr.rt.tokenizer.decode([int(i)]), float(v)) for v, i in zip(vals, ids)], len(plan.ids)


def test_turns_equal_full_prefill_of_the_transcript_and_prefill_only_new_tokens(app):
    s = app.post("/v1/sessions", json={"skills": ["policy"], "system": "Be brief.", "mode": "full"}).json()
    sid, n0 = s["id"], s["n_tokens"]
    assert s["usage"]["recomputed_tokens"] == n0
    prev = n0
    for turn, (user, fields) in enumerate([("Refund?", {}), ("And now?", {"status": "shipped"}),
                                           ("Again?", {"status": "delivered"})]):
        expect, n_prompt = _full_top(app, sid, user, fields)
        r = app.post(f"/v1/sessions/{sid}/turns", json={"user": user, "fields": fields, "max_tokens": 4,
                                                         "logprobs": 5})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["session"] == sid
        got = [(x["token"], x["logprob"]) for x in body["logprobs"]]
        # same distribution head: the top-5 logprobs agree (token order may swap only inside exact ties)
        assert all(math.isclose(a, b, abs_tol=1e-3) for (_, a), (_, b) in zip(got, expect))
        if expect[0][1] - expect[1][1] > 1e-3:
            assert got[0][0] == expect[0][0]
        u = body["usage"]
        assert u["prompt_tokens"] == n_prompt
        assert u["reused_tokens"] >= prev - 1  # everything cached before is reused (but the last token)
        assert u["recomputed_tokens"] == n_prompt - u["reused_tokens"]
        if fields.get("status") == "shipped":
            assert body["edits"][0]["lines"] == [
                "[STATE UPDATE] status has changed to shipped; this overrides any earlier value. "
                "Apply the current value."]
        prev = n_prompt + u["completion_tokens"]
    info = app.get(f"/v1/sessions/{sid}").json()
    assert info["turns"] == 3 and info["fields"] == {"status": "delivered"}
    assert [m["role"] for m in info["messages"]] == ["user", "assistant"] * 3


def test_session_is_persisted_and_resumed(tmp_path):
    with make_client(tmp_path) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        c.post("/v1/skills", json={"name": "policy", "text": POLICY, "fields": {"status": "delivered"}})
        sid = c.post("/v1/sessions", json={"skills": ["policy"]}).json()["id"]
        first = c.post(f"/v1/sessions/{sid}/turns", json={"user": "Refund?", "max_tokens": 3}).json()
        c.portal.call(c.app.state.skillcache.sessions.drain)
    # a new process over the same store (disk) resumes the session: another replica would too
    with make_client(tmp_path) as c2:
        c2.portal.call(c2.app.state.skillcache.wait_ready)
        info = c2.get(f"/v1/sessions/{sid}").json()
        assert info["turns"] == 1 and info["messages"][1]["content"] == first["text"]
        r = c2.post(f"/v1/sessions/{sid}/turns", json={"user": "Sure?", "max_tokens": 2}).json()
        assert r["usage"]["reused_tokens"] >= info["n_tokens"] - 1


def test_live_sessions_are_bounded_and_evicted_ones_resume(tmp_path):
    with make_client(tmp_path, session_max_bytes=1) as c:  # every other session is evicted at once
        c.portal.call(c.app.state.skillcache.wait_ready)
        c.post("/v1/skills", json={"name": "policy", "text": POLICY, "fields": {"status": "delivered"}})
        a = c.post("/v1/sessions", json={"skills": ["policy"]}).json()["id"]
        b = c.post("/v1/sessions", json={"skills": ["policy"]}).json()["id"]
        mgr = c.app.state.skillcache.sessions
        assert list(mgr.live) == [b]
        c.portal.call(mgr.drain)
        assert c.post(f"/v1/sessions/{a}/turns", json={"user": "hi", "max_tokens": 1}).status_code == 200


def test_session_errors(app):
    assert app.get("/v1/sessions/s-doesnotexist").status_code == 404
    assert app.post("/v1/sessions", json={"skills": ["nope"]}).json()["error"]["type"] == "skill_not_found"
    sid = app.post("/v1/sessions", json={"skills": ["policy"]}).json()["id"]
    bad = app.post(f"/v1/sessions/{sid}/turns", json={"user": "x", "fields": {"unknown": "1"}})
    assert bad.status_code == 422 and bad.json()["error"]["type"] == "invalid_field"
    mgr = app.app.state.skillcache.sessions
    app.portal.call(mgr.live[sid].lock.acquire)
    busy = app.post(f"/v1/sessions/{sid}/turns", json={"user": "x"})
    assert busy.status_code == 409 and busy.json()["error"]["type"] == "session_busy"
    mgr.live[sid].lock.release()
    assert app.delete(f"/v1/sessions/{sid}").json() == {"deleted": sid}
    assert app.get(f"/v1/sessions/{sid}").status_code == 404


def test_turn_ending_on_eos_keeps_cache_and_ids_in_step(app):
    """A reply that stops on end-of-sequence has every token forwarded: the next turn must still work."""
    state = app.app.state.skillcache
    rt = state.runtime
    sid = app.post("/v1/sessions", json={"skills": ["policy"]}).json()["id"]
    real = rt.eos_ids
    try:
        rt.eos_ids = set(range(rt.config.vocab_size))  # every token ends the reply at once
        r = app.post(f"/v1/sessions/{sid}/turns", json={"user": "Refund?", "max_tokens": 5})
        assert r.status_code == 200 and r.json()["finish_reason"] == "stop"
    finally:
        rt.eos_ids = real
    s = state.sessions.live[sid]
    assert len(s.ids) == s.cache.get_seq_length()
    assert app.post(f"/v1/sessions/{sid}/turns", json={"user": "Why?", "max_tokens": 2}).status_code == 200


def test_session_limits(app):
    r = app.post("/v1/sessions", json={"skills": ["policy", "policy"]})
    assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request"
    sid = app.post("/v1/sessions", json={"skills": ["policy"]}).json()["id"]
    r = app.post(f"/v1/sessions/{sid}/turns", json={"user": "x", "max_tokens": 100_000})
    assert r.status_code == 413 and "SKILLCACHE_MAX_TOKENS_CAP" in r.json()["error"]["message"]


def test_saved_sessions_expire_after_the_store_ttl(tmp_path):
    """Saved copies (KV on disk, document) with no turn for longer than SKILLCACHE_SESSION_STORE_TTL_S are
    deleted by the sweep, and a resume past the TTL is a 404 even before a sweep ran; fresh ones stay."""
    import time

    from service.sessions.saved import Session

    with make_client(tmp_path, session_store_ttl_s=3600, session_max_bytes=1) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        c.post("/v1/skills", json={"name": "policy", "text": POLICY, "fields": {"status": "delivered"}})
        saved, defs = state.sessions.saved, state.definitions
        assert saved._sweeper is not None and not saved._sweeper.done()  # the background sweep runs
        old, stale, fresh = (c.post("/v1/sessions", json={"skills": ["policy"]}).json()["id"] for _ in range(3))
        assert c.post(f"/v1/sessions/{fresh}/turns", json={"user": "hi", "max_tokens": 2}).status_code == 200
        c.portal.call(state.sessions.drain)
        assert list(state.sessions.live) == [fresh]  # session_max_bytes=1: the others live only in the store

        def age(sid: str) -> Session:  # as if its last turn was two hours ago
            doc = c.portal.call(defs.get, "default.sessions", sid)
            doc["saved_at"] = time.time() - 7200
            c.portal.call(defs.put, "default.sessions", sid, 1, doc)
            return Session(**doc)

        old_s, _ = age(old), age(stale)
        r = c.get(f"/v1/sessions/{stale}")  # past the TTL: expired on resume, and deleted
        assert r.status_code == 404 and "SKILLCACHE_SESSION_STORE_TTL_S" in r.json()["error"]["message"]
        assert c.portal.call(defs.get, "default.sessions", stale) is None
        block_file = state.store.tiers[1].path_for(saved._key(old_s))
        assert block_file.is_file()
        assert c.portal.call(saved.sweep) == 1  # `old`; `fresh` was saved just now
        assert not block_file.exists() and c.portal.call(defs.get, "default.sessions", old) is None
        assert c.get(f"/v1/sessions/{old}").status_code == 404
        assert c.post(f"/v1/sessions/{fresh}/turns", json={"user": "again", "max_tokens": 2}).status_code == 200
        # an hour and more later the fresh one goes too, live or not
        c.portal.call(state.sessions.drain)
        assert c.portal.call(saved.sweep, time.time() + 3700) == 1 and not state.sessions.live
        assert c.get(f"/v1/sessions/{fresh}").status_code == 404


def test_store_ttl_zero_keeps_saved_sessions(tmp_path):
    import time

    with make_client(tmp_path, session_store_ttl_s=0) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        c.post("/v1/skills", json={"name": "policy", "text": POLICY, "fields": {"status": "delivered"}})
        sid = c.post("/v1/sessions", json={"skills": ["policy"]}).json()["id"]
        c.portal.call(state.sessions.drain)
        assert state.sessions.saved._sweeper is None
        assert c.portal.call(state.sessions.saved.sweep, time.time() + 10**9) == 0
        assert c.get(f"/v1/sessions/{sid}").status_code == 200


def test_a_stop_string_does_not_stay_in_the_context_of_later_turns(app):
    """A reply cut at a stop string: later turns see the returned text, as a client replaying the transcript
    through /v1/chat/completions would send it, not the generated tokens through the stop string (which the
    cache held); and the next turn's output equals a full prefill of that transcript."""
    mgr = app.app.state.skillcache.sessions
    probe = app.post("/v1/sessions", json={"skills": ["policy"]}).json()["id"]
    full = app.post(f"/v1/sessions/{probe}/turns", json={"user": "Refund?", "max_tokens": 12}).json()["text"]
    # a stop string inside the reply (greedy: a fresh identical session generates the same)
    stop = next(full[i:i + 2] for i in range(1, len(full) - 1)
                if full[i:i + 2].isalnum() and full.find(full[i:i + 2]) == i)
    sid = app.post("/v1/sessions", json={"skills": ["policy"]}).json()["id"]
    r = app.post(f"/v1/sessions/{sid}/turns", json={"user": "Refund?", "max_tokens": 12, "stop": [stop]}).json()
    assert r["finish_reason"] == "stop" and r["text"] == full[:full.find(stop)]

    s = mgr.live[sid]
    transcript = app.get(f"/v1/sessions/{sid}").json()["messages"]
    assert transcript[-1]["content"] == r["text"]
    replay = mgr.rt.prompts.build(mgr._head(s) + transcript + [{"role": "user", "content": "Why?"}], s.skill_ids,
                                  s.base_errata)
    sent = mgr.rt.prompts.build(mgr._head(s) + s.messages + [{"role": "user", "content": "Why?"}], s.skill_ids,
                                s.base_errata)
    assert sent.ids == replay.ids  # what the next turn sends is the replayed transcript
    import torch

    expect = torch.log_softmax(mgr.rt.prefill(replay, [], mode="full").logits, -1)
    body = app.post(f"/v1/sessions/{sid}/turns", json={"user": "Why?", "max_tokens": 2, "logprobs": 5}).json()
    assert body["usage"]["prompt_tokens"] == len(replay.ids)
    # the cache, which held the tokens through the stop string, was cut back to where the two agree
    top = torch.topk(expect, 5).values.tolist()
    assert all(math.isclose(x["logprob"], e, abs_tol=1e-3) for x, e in zip(body["logprobs"], top))


def test_a_field_two_skills_declare_with_different_defaults_reaches_both(app):
    """`policy` says status=delivered, `tools` says pending. Setting pending is news to `policy`: an erratum,
    as /v1/compose adds; once that erratum was said, the same value again adds nothing, and another adds one."""
    tools = "Tool specs: search(query), lookup(order_id). Status {{status}}."
    app.post("/v1/skills", json={"name": "tools", "text": tools, "fields": {"status": "pending"}})
    mgr = app.app.state.skillcache.sessions
    line = ("[STATE UPDATE] status has changed to {}; this overrides any earlier value. Apply the current value.")
    composed = app.post("/v1/compose", json={"skills": ["policy", "tools"], "user": "q", "max_tokens": 1,
                                            "fields": {"status": "pending"}}).json()
    assert [e["skill"] for e in composed["edits"]] == ["policy"]
    sid = app.post("/v1/sessions", json={"skills": ["policy", "tools"]}).json()["id"]

    def turn(value):
        r = app.post(f"/v1/sessions/{sid}/turns", json={"user": "q", "max_tokens": 1, "fields": {"status": value}})
        assert r.status_code == 200, r.text
        return r.json()["edits"]

    assert turn("pending") == [{"mode": "erratum", "fields": ["status"], "lines": [line.format("pending")]}]
    assert turn("pending") == []
    app.portal.call(mgr.drain)
    mgr.live.pop(sid)  # what each skill was told survives a resume
    assert turn("pending") == []
    assert turn("delivered") == [{"mode": "erratum", "fields": ["status"], "lines": [line.format("delivered")]}]
    assert app.get(f"/v1/sessions/{sid}").json()["fields"] == {"status": "delivered"}
