"""Memories belong to a tenant: another tenant's memory is a 404 everywhere (read, edit, delete, list, compose,
sessions), and the same name in two tenants is two memories."""

from __future__ import annotations

from conftest import ADMIN, OTHER, USER, bearer

ACME = "# USER MEMORY\n- [billing] plan: gold\n- [shipping] city: Lyon"
GLOBEX = "# USER MEMORY\n- [billing] plan: basic\n- [shipping] city: Oslo"


def _type(r) -> str:
    return r.json()["error"]["type"]


def test_another_tenants_memory_is_not_there(keyed_client):
    c = keyed_client
    r = c.post("/v1/memories", json={"name": "profile", "text": ACME}, headers=bearer(USER))
    assert r.status_code == 201, r.text  # a user key may keep its own tenant's memories
    assert c.get("/v1/memories/profile", headers=bearer(ADMIN)).json()["text"] == ACME  # same tenant, other key
    other = bearer(OTHER)
    for method, path, body in (("GET", "/v1/memories/profile", None), ("DELETE", "/v1/memories/profile", None),
                               ("PATCH", "/v1/memories/profile", {"edits": [{"label": "plan", "value": "none"}]})):
        r = c.request(method, path, json=body, headers=other)
        assert r.status_code == 404 and _type(r) == "memory_not_found", (method, r.text)
    assert c.get("/v1/memories", headers=other).json() == {"memories": []}
    r = c.post("/v1/compose", json={"memory": "profile", "user": "Which plan?", "max_tokens": 2}, headers=other)
    assert r.status_code == 404 and _type(r) == "memory_not_found"
    r = c.post("/v1/sessions", json={"system": "Be brief.", "memory": "profile"}, headers=other)
    assert r.status_code == 404 and _type(r) == "memory_not_found"
    for path in ("/v1/memories", "/v1/memories/profile"):  # and without a key, nothing at all
        assert c.get(path).status_code == 401

    # the same name in the other tenant: its own memory, and neither sees the other's
    assert c.put("/v1/memories/profile", json={"text": GLOBEX}, headers=other).status_code == 201
    assert c.get("/v1/memories/profile", headers=other).json()["text"] == GLOBEX
    acme = c.get("/v1/memories/profile", headers=bearer(USER)).json()
    assert acme["text"] == ACME and acme["revision"] == 1
    r = c.post("/v1/compose", json={"memory": "profile", "user": "Which plan?", "max_tokens": 2}, headers=other)
    assert r.status_code == 200 and r.json()["memory"]["revision"] == 1
    state = c.app.state.skillcache
    globex = c.portal.call(state.memories.resolve, "globex", "profile")
    mine = c.portal.call(state.memories.resolve, "acme", "profile")
    assert globex.ids != mine.ids  # each tenant's session floats its own text
    assert c.delete("/v1/memories/profile", headers=other).status_code == 200
    assert c.get("/v1/memories/profile", headers=bearer(USER)).status_code == 200  # acme's untouched
