"""Skill registry endpoints and their errors, on a tiny random-weight model."""

from service.metrics import COMPILES

TEXT = "Refunds are allowed within 30 days of delivery when the item is unused."


def test_register_same_text_keeps_version_changed_text_adds_one(client):
    r = client.post("/v1/skills", json={"name": "refund", "text": TEXT, "description": "policy"})
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["version"] == 1 and body["compiled"] and body["n_tokens"] > 0
    again = client.post("/v1/skills", json={"name": "refund", "text": TEXT})
    assert again.status_code == 200 and again.json()["version"] == 1
    changed = client.post("/v1/skills", json={"name": "refund", "text": TEXT + " Always."})
    assert changed.status_code == 201 and changed.json()["version"] == 2
    assert changed.json()["versions"] == [1, 2]
    old = client.get("/v1/skills/refund", params={"version": 1}).json()
    assert old["text"] == TEXT and old["compiled"]
    assert client.get("/v1/skills/refund").json()["version"] == 2
    names = [s["name"] for s in client.get("/v1/skills").json()["skills"]]
    assert names == ["refund"]


def test_compile_happens_once_per_text(client):
    before = COMPILES._value.get()
    client.post("/v1/skills", json={"name": "once", "text": TEXT + " once"})
    client.post("/v1/skills", json={"name": "once", "text": TEXT + " once"})
    client.post("/v1/compose", json={"skills": ["once"], "user": "hi", "max_tokens": 2})
    assert COMPILES._value.get() - before == 1


def test_delete_removes_definition_and_blocks(client):
    client.post("/v1/skills", json={"name": "gone", "text": TEXT})
    state = client.app.state.skillcache
    key = state.registry.block_key("default", TEXT)
    assert client.portal.call(state.store.contains, key)
    r = client.delete("/v1/skills/gone")
    assert r.status_code == 200 and r.json() == {"deleted": "gone", "versions": [1]}
    assert not client.portal.call(state.store.contains, key)
    assert client.get("/v1/skills/gone").json()["error"]["type"] == "skill_not_found"
    assert client.delete("/v1/skills/gone").status_code == 404


def test_bad_names_and_fields(client):
    for name in ["Bad Name", "../etc", "", "x" * 65, "-lead"]:
        r = client.post("/v1/skills", json={"name": name, "text": TEXT})
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request", name
    r = client.post("/v1/skills", json={"name": "f", "text": "status is {{status}}"})
    assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_field"
    assert "status" in r.json()["error"]["message"]
    r = client.post("/v1/skills", json={"name": "f", "text": "x", "fields": {"bad-name": "1"}})
    assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_field"
    r = client.post("/v1/skills", json={"name": "f", "text": "x", "unknown": 1})
    assert r.status_code == 422
    r = client.get("/v1/skills/BAD NAME")
    assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_skill_name"


def test_limits(tmp_path):
    from appclient import make_client

    with make_client(tmp_path, max_skill_tokens=8, max_body_bytes=2000) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        r = c.post("/v1/skills", json={"name": "big", "text": TEXT})
        assert r.status_code == 413 and r.json()["error"]["type"] == "limit_exceeded"
        assert "SKILLCACHE_MAX_SKILL_TOKENS" in r.json()["error"]["message"]
        r = c.post("/v1/skills", json={"name": "huge", "text": "a " * 2000})
        assert r.status_code == 413 and "2000 bytes" in r.json()["error"]["message"]
        assert c.get("/v1/skills").status_code == 200  # nothing lost, still serving


def test_compile_false_reports_whether_a_block_exists(client):
    client.post("/v1/skills", json={"name": "pre", "text": TEXT + " pre"})  # compiled
    again = client.post("/v1/skills", params={"compile": "false"}, json={"name": "pre", "text": TEXT + " pre"})
    assert again.status_code == 200 and again.json()["compiled"] is True
    lazy = client.post("/v1/skills", params={"compile": "false"}, json={"name": "lazy", "text": TEXT + " lazy"})
    assert lazy.status_code == 201 and lazy.json()["compiled"] is False


def test_a_skill_longer_than_the_models_context_is_refused_at_registration(client):
    r = client.post("/v1/skills", json={"name": "huge", "text": "hello " * 5000})  # tiny model: context 4096
    assert r.status_code == 413 and r.json()["error"]["type"] == "limit_exceeded"
    assert "context" in r.json()["error"]["message"]
    assert client.get("/v1/skills/huge").status_code == 404  # nothing stored
