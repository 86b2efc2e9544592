"""/v1/compose, chat completions, health and metrics on a tiny random-weight model."""

import json

import pytest

TEXT = "Refunds are allowed within 30 days of delivery when the item is unused."


@pytest.fixture
def skills(client):
    client.post("/v1/skills", json={"name": "a", "text": TEXT})
    client.post("/v1/skills", json={"name": "b", "text": "Tool specs: search(query), lookup(order_id)."})
    client.post("/v1/skills", json={
        "name": "f", "text": "The order status is {{status}}.", "fields": {"status": "delivered"}})
    return client


def test_compose_reports_usage_sources_and_matches_full_with_whole_seam(skills):
    body = {"skills": ["a", {"name": "b", "version": 1}], "user": "Can I get a refund?", "max_tokens": 8}
    comp = skills.post("/v1/compose", json={**body, "seam_tokens": 4096}).json()
    full = skills.post("/v1/compose", json={**body, "mode": "full"}).json()
    assert comp["text"] == full["text"]
    assert comp["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]
    # every seam recomputed, except the first skill's: it follows the template opening it was compiled
    # after, so its K/V are already the full prefill's and it is copied as is
    assert comp["usage"]["reused_tokens"] == skills.get("/v1/skills/a").json()["n_tokens"]
    normal = skills.post("/v1/compose", json=body).json()
    u = normal["usage"]
    assert u["reused_tokens"] > 0 and u["reused_tokens"] + u["recomputed_tokens"] == u["prompt_tokens"]
    assert u["completion_tokens"] <= 8
    assert [s["source"] for s in normal["skills"]] == ["memory", "memory"]
    assert set(normal["timings"]) == {"ttft_ms", "compose_ms", "store_ms", "total_ms"}


def test_compose_stream_sse(skills):
    with skills.stream("POST", "/v1/compose", json={
        "skills": ["a"], "user": "hi", "max_tokens": 6, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    events = [json.loads(f) for f in frames[:-1]]
    assert events[-1]["type"] == "done" and events[-1]["usage"]["completion_tokens"] <= 6
    text = "".join(e["text"] for e in events if e["type"] == "delta")
    plain = skills.post("/v1/compose", json={"skills": ["a"], "user": "hi", "max_tokens": 6}).json()
    assert text == plain["text"]


def test_fields_become_errata_and_unknown_fields_are_refused(skills):
    r = skills.post("/v1/compose", json={"skills": ["f"], "user": "status?", "max_tokens": 2,
                                        "fields": {"status": "shipped"}}).json()
    assert r["edits"][0]["lines"][0].startswith("[STATE UPDATE] status has changed to shipped;")
    same = skills.post("/v1/compose", json={"skills": ["f"], "user": "status?", "max_tokens": 2,
                                           "fields": {"status": "delivered"}}).json()
    assert same["edits"] == []
    bad = skills.post("/v1/compose", json={"skills": ["f"], "user": "x", "fields": {"nope": "1"}})
    assert bad.status_code == 422 and bad.json()["error"]["type"] == "invalid_field"


@pytest.mark.parametrize("body,status,etype", [
    ({"skills": ["missing"], "user": "x"}, 404, "skill_not_found"),
    ({"skills": [{"name": "a", "version": 9}], "user": "x"}, 404, "skill_not_found"),
    ({"skills": ["a", "a"], "user": "x"}, 422, "invalid_request"),
    ({"skills": ["a"], "user": ""}, 422, "invalid_request"),
    ({"skills": ["a"], "user": "x", "max_tokens": 0}, 422, "invalid_request"),
    ({"skills": ["a"], "user": "x", "temperature": -1}, 422, "invalid_request"),
    ({"skills": ["a"], "user": "x", "max_tokens": 100_000}, 413, "limit_exceeded"),
    ({"skills": ["a"], "user": "x", "mode": "magic"}, 422, "invalid_request"),
])
def test_compose_errors(skills, body, status, etype):
    r = skills.post("/v1/compose", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["type"] == etype


def test_context_too_long(skills):
    r = skills.post("/v1/compose", json={"skills": ["a"], "user": "word " * 3000, "max_tokens": 2000})
    assert r.status_code == 422 and r.json()["error"]["type"] == "context_too_long"


def test_sampling_follows_temperature_top_p_and_seed(skills):
    """A seed reproduces its text; other seeds give other texts (the tiny model's random weights spread the
    distribution: 8 greedy-identical texts would mean temperature or seed is ignored); top_p near 0 keeps only the
    most likely token, so any seed gives the greedy text."""
    base = {"skills": ["a"], "user": "hi", "max_tokens": 8}

    def text(**kw) -> str:
        r = skills.post("/v1/compose", json={**base, **kw})
        assert r.status_code == 200, r.text
        return r.json()["text"]

    greedy = text(temperature=0.0)
    sampled = [text(temperature=1.0, top_p=1.0, seed=seed) for seed in range(8)]
    assert text(temperature=1.0, top_p=1.0, seed=3) == sampled[3]  # one seed, one text
    assert len(set(sampled)) >= 4 and any(t != greedy for t in sampled), sampled
    assert {text(temperature=1.0, top_p=1e-6, seed=seed) for seed in range(3)} == {greedy}


def test_logprobs(skills):
    r = skills.post("/v1/compose", json={"skills": ["a"], "user": "hi", "max_tokens": 1, "logprobs": 3}).json()
    assert len(r["logprobs"]) == 3
    assert r["logprobs"][0]["logprob"] >= r["logprobs"][1]["logprob"]


def test_chat_completions_shape(skills):
    r = skills.post("/v1/chat/completions", json={
        "model": "x", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "max_tokens": 4, "skills": ["a"]}).json()
    assert r["object"] == "chat.completion"
    assert r["choices"][0]["message"]["role"] == "assistant"
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    bad = skills.post("/v1/chat/completions", json={"messages": [{"role": "assistant", "content": "x"}]})
    assert bad.status_code == 422


def test_health_and_metrics(skills):
    assert skills.get("/livez").json() == {"status": "ok"}
    ready = skills.get("/readyz")
    assert ready.status_code == 200 and ready.json()["selfcheck"]["ok"]
    skills.post("/v1/compose", json={"skills": ["a"], "user": "hi", "max_tokens": 1})
    text = skills.get("/metrics").text
    assert 'skillcache_skill_hits_total{tier="memory"}' in text
    assert "skillcache_ttft_seconds_bucket" in text
    assert skills.get("/v1/models").json()["data"][0]["object"] == "model"


def test_overload_returns_429(skills):
    state = skills.app.state.skillcache
    import threading

    gate = threading.Event()
    engine = state.engine
    blockers = []
    try:
        # occupy the engine and fill the queue, then one more request must be shed
        for _ in range(engine.config.queue_size + 1):
            blockers.append(skills.portal.call(_submit_blocking, engine, gate))
        r = skills.post("/v1/compose", json={"skills": ["a"], "user": "hi", "max_tokens": 1})
        assert r.status_code == 429 and r.json()["error"]["type"] == "overloaded"
        assert r.headers["retry-after"] == "1"
    finally:
        gate.set()


async def _submit_blocking(engine, gate):
    import time

    job = engine.submit(lambda cancelled: gate.wait(10))
    time.sleep(0.05)
    return job


def test_seam_tokens_auto_and_bounds(skills):
    body = {"skills": ["a", "b"], "user": "hi", "max_tokens": 1}
    r = skills.post("/v1/compose", json={**body, "seam_tokens": "auto"})
    # the first skill is copied as is (seam 0); the second gets the uncalibrated default, SKILLCACHE_SEAM_TOKENS
    assert r.status_code == 200 and [s["seam"] for s in r.json()["skills"]] == [0, 4]
    r = skills.post("/v1/compose", json={**body, "seam_tokens": 2})
    assert [s["seam"] for s in r.json()["skills"]] == [0, 2]
    assert r.json()["usage"]["composed_tokens"] == sum(
        skills.get(f"/v1/skills/{n}").json()["n_tokens"] for n in "ab") - 2  # what `seam` says was recomputed
    full = skills.post("/v1/compose", json={**body, "mode": "full"})
    assert [s["seam"] for s in full.json()["skills"]] == [None, None]
    bad = skills.post("/v1/compose", json={"skills": ["a"], "user": "hi", "seam_tokens": "some"})
    assert bad.status_code == 422
    assert skills.post("/v1/sessions", json={"skills": ["a"], "seam_tokens": "auto"}).status_code == 201


def test_a_temperature_just_above_zero_samples_like_greedy(skills):
    body = {"skills": ["a"], "user": "hi", "max_tokens": 6}
    greedy = skills.post("/v1/compose", json=body).json()["text"]
    for t in (1e-40, 5e-324):  # overflowed to inf/NaN inside softmax: a 500
        r = skills.post("/v1/compose", json={**body, "temperature": t, "seed": 1})
        assert r.status_code == 200 and r.json()["text"] == greedy, r.text


def test_an_empty_stop_string_is_refused_in_both_forms(skills):
    for stop in ("", [""], "x" * 257):
        r = skills.post("/v1/compose", json={"skills": ["a"], "user": "hi", "stop": stop, "stream": True})
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request", stop


def test_chat_accepts_null_for_optional_parameters(skills):
    """The openai SDK sends null for parameters passed as None; OpenAI's API reads null as the default."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": None, "top_p": None,
            "n": None, "logprobs": None, "stream": None, "stop": None, "seed": None, "skills": ["a"]}
    r = skills.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    plain = skills.post("/v1/chat/completions", json={k: v for k, v in body.items() if v is not None}).json()
    assert r.json()["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


def test_validation_messages_name_fields_not_pydantic_internals(skills):
    r = skills.post("/v1/compose", content=b'{"user":', headers={"content-type": "application/json"})
    assert r.status_code == 422 and "not valid JSON (at character" in r.json()["error"]["message"]
    r = skills.post("/v1/compose", json={"skills": ["a"], "user": "hi", "seam_tokens": "some"})
    msg = r.json()["error"]["message"]
    assert (r.status_code == 422 and msg.startswith("seam_tokens: ")
            and "constrained" not in msg and "literal" not in msg)
