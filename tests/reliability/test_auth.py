"""Tenants and keys: 401/403, namespaces (another tenant's skill is a 404), constant-time key lookup, the keys
file's validation, and the refusal to serve without keys on a non-loopback address."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from conftest import ADMIN, KEYS, OTHER, ROOT, USER, app_client, bearer, write_keys
from service.api import auth as auth_mod
from service.api.auth import AuthConfigError, Authenticator, check_exposure, load_keys
from service.config import Settings

TEXT = "Refunds are allowed within 30 days of delivery when the item is unused."


def test_missing_and_unknown_keys_are_401_with_a_bearer_challenge(keyed_client):
    c = keyed_client
    for headers in ({}, bearer("not-a-key-at-all-000000"), {"Authorization": "Basic " + ADMIN},
                    {"Authorization": "Bearer"}, {"Authorization": f"Bearer {ADMIN}x"}):
        for method, path, body in (("GET", "/v1/skills", None), ("POST", "/v1/compose", {"user": "hi"}),
                                   ("POST", "/v1/skills", {"name": "a", "text": TEXT}), ("GET", "/v1/models", None),
                                   ("POST", "/v1/sessions", {}), ("POST", "/v1/chat/completions", {})):
            r = c.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (headers, path, r.text)
            assert r.json()["error"]["type"] == "unauthorized"
            assert r.headers["www-authenticate"] == "Bearer"
    for path in ("/livez", "/metrics", "/openapi.json"):  # always open
        assert c.get(path).status_code == 200
    assert c.get("/readyz").status_code == 200


def test_roles_user_reads_and_composes_admin_also_registers_and_deletes(keyed_client):
    c = keyed_client
    r = c.post("/v1/skills", json={"name": "refund", "text": TEXT}, headers=bearer(USER))
    assert r.status_code == 403 and r.json()["error"]["type"] == "forbidden"
    assert c.post("/v1/skills", json={"name": "refund", "text": TEXT}, headers=bearer(ADMIN)).status_code == 201
    assert c.get("/v1/skills/refund", headers=bearer(USER)).status_code == 200
    r = c.post("/v1/compose", json={"skills": ["refund"], "user": "hi", "max_tokens": 2}, headers=bearer(USER))
    assert r.status_code == 200, r.text
    r = c.post("/v1/chat/completions", headers=bearer(USER), json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "skills": ["refund"]})
    assert r.status_code == 200, r.text
    s = c.post("/v1/sessions", json={"skills": ["refund"]}, headers=bearer(USER))
    assert s.status_code == 201, s.text
    assert c.delete("/v1/skills/refund", headers=bearer(USER)).status_code == 403
    assert c.delete("/v1/skills/refund", headers=bearer(ADMIN)).status_code == 200


def test_tenants_are_isolated_and_another_tenants_skill_is_a_404(keyed_client):
    c = keyed_client
    assert c.post("/v1/skills", json={"name": "policy", "text": TEXT}, headers=bearer(ADMIN)).status_code == 201
    assert c.post("/v1/skills", json={"name": "policy", "text": TEXT + " Globex."},
                  headers=bearer(OTHER)).status_code == 201  # same name, other tenant: its own version 1
    assert c.get("/v1/skills/policy", headers=bearer(OTHER)).json()["text"].endswith("Globex.")
    assert c.get("/v1/skills/policy", headers=bearer(USER)).json()["text"] == TEXT
    assert c.post("/v1/skills", json={"name": "secret", "text": "acme only"}, headers=bearer(ADMIN)).status_code == 201
    for method, path, body in (("GET", "/v1/skills/secret", None), ("DELETE", "/v1/skills/secret", None),
                               ("POST", "/v1/compose", {"skills": ["secret"], "user": "hi", "max_tokens": 1})):
        r = c.request(method, path, json=body, headers=bearer(OTHER))
        assert r.status_code == 404 and r.json()["error"]["type"] == "skill_not_found", (path, r.text)
    assert [s["name"] for s in c.get("/v1/skills", headers=bearer(OTHER)).json()["skills"]] == ["policy"]
    assert {s["name"] for s in c.get("/v1/skills", headers=bearer(USER)).json()["skills"]} == {"policy", "secret"}
    # the blocks are namespaced too: one per tenant for the same text
    state = c.app.state.skillcache
    assert state.registry.block_key("acme", TEXT) != state.registry.block_key("globex", TEXT)
    # sessions: another tenant's session id is a 404 as well
    sid = c.post("/v1/sessions", json={"skills": ["secret"]}, headers=bearer(USER)).json()["id"]
    assert c.get(f"/v1/sessions/{sid}", headers=bearer(USER)).status_code == 200
    r = c.get(f"/v1/sessions/{sid}", headers=bearer(OTHER))
    assert r.status_code == 404 and r.json()["error"]["type"] == "session_not_found"
    assert c.post(f"/v1/sessions/{sid}/turns", json={"user": "x", "max_tokens": 1},
                  headers=bearer(OTHER)).status_code == 404
    assert c.delete(f"/v1/sessions/{sid}", headers=bearer(OTHER)).status_code == 404


def test_request_metrics_carry_the_callers_namespace(keyed_client):
    c = keyed_client
    c.get("/v1/skills", headers=bearer(OTHER))
    c.get("/v1/skills")
    text = c.get("/metrics").text
    assert 'skillcache_requests_total{namespace="globex",route="/v1/skills",status="200"}' in text
    assert 'skillcache_requests_total{namespace="",route="/v1/skills",status="401"}' in text


def test_key_sha256_entries_and_constant_time_comparison(tmp_path, monkeypatch):
    key = "hashed-key-abcdefghijklmnop"
    path = write_keys(tmp_path / "k.json", [
        {"key_sha256": hashlib.sha256(key.encode()).hexdigest(), "namespace": "acme", "role": "user"},
        {"key": ADMIN, "namespace": "acme", "role": "admin"},
        {"key": OTHER, "namespace": "globex", "role": "user"},
    ])
    auth = Authenticator(Settings(api_keys_file=path))
    calls = []
    real = auth_mod.hmac.compare_digest
    monkeypatch.setattr(auth_mod.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    assert auth.authenticate(key, None).namespace == "acme"
    assert len(calls) == 3  # every entry is compared, whichever matches: no early exit
    calls.clear()
    with pytest.raises(Exception) as e:
        auth.authenticate("wrong-key-00000000000000", None)
    assert e.value.error_type == "unauthorized" and len(calls) == 3
    # the plain keys are not kept: only digests
    assert all(not hasattr(k, "key") for k in auth.keys)


@pytest.mark.parametrize("entries, message", [
    ([], "non-empty"),
    ({"key": ADMIN}, "non-empty JSON list"),
    ([{"namespace": "a", "role": "user"}], "exactly one of"),
    ([{"key": ADMIN, "key_sha256": "0" * 64, "namespace": "a", "role": "user"}], "exactly one of"),
    ([{"key": "short", "namespace": "a", "role": "user"}], "at least 16"),
    ([{"key": "has spaces in it 0123456", "namespace": "a", "role": "user"}], "without spaces"),
    ([{"key_sha256": "xyz", "namespace": "a", "role": "user"}], "64 hex"),
    ([{"key": ADMIN, "namespace": "../etc", "role": "user"}], "namespace"),
    ([{"key": ADMIN, "namespace": "acme.sessions", "role": "user"}], "dots are reserved"),
    ([{"key": ADMIN, "namespace": "a", "role": "root"}], "role"),
    ([{"key": ADMIN, "namespace": "a", "role": ["admin"]}], "role"),  # was a TypeError: a traceback, exit 1
    ([{"key": ADMIN, "namespace": "a", "role": "user", "extra": 1}], "unknown fields"),
    ([{"key": ADMIN, "namespace": "a", "role": "user"}, {"key": ADMIN, "namespace": "b", "role": "admin"}],
     "twice"),
])
def test_bad_keys_files_stop_the_start(tmp_path, entries, message):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(entries))
    with pytest.raises(AuthConfigError, match=message):
        load_keys(path)
    with pytest.raises(AuthConfigError):
        Authenticator(Settings(api_keys_file=path))


def test_auth_mode_and_exposure_rules(tmp_path):
    keys = write_keys(tmp_path / "keys.json")
    with pytest.raises(AuthConfigError, match="unreadable|cannot read"):
        Authenticator(Settings(api_keys_file=tmp_path / "missing.json"))
    with pytest.raises(AuthConfigError, match="needs SKILLCACHE_API_KEYS_FILE"):
        Authenticator(Settings(auth="keys"))
    with pytest.raises(AuthConfigError, match="both set"):
        Authenticator(Settings(auth="off", api_keys_file=keys))
    for host in ("127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"):
        check_exposure(Settings(), host)  # open on loopback: fine
    for host in ("0.0.0.0", "::", "10.0.0.5", "example.com"):
        with pytest.raises(AuthConfigError, match="SKILLCACHE_ALLOW_NO_AUTH"):
            check_exposure(Settings(), host)
        check_exposure(Settings(allow_no_auth=True), host)
        check_exposure(Settings(api_keys_file=keys), host)


def test_open_mode_serves_the_default_namespace(tmp_path):
    with app_client(tmp_path) as c:
        assert c.post("/v1/skills", json={"name": "a", "text": TEXT}).status_code == 201
        assert c.app.state.skillcache.registry.block_key("default", TEXT)
        assert c.get("/v1/skills/a").status_code == 200
        # a key sent to an open service is ignored, not an error
        assert c.get("/v1/skills/a", headers=bearer("whatever-0000000000000")).status_code == 200


def test_python_m_service_refuses_a_public_address_without_keys(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "SKILLCACHE_HOME": str(tmp_path), "SKILLCACHE_SKILLS_DIR": ""}
    proc = subprocess.run([sys.executable, "-m", "service", "--host", "0.0.0.0", "--port", "1"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "SKILLCACHE_ALLOW_NO_AUTH" in proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("[{]")
    proc = subprocess.run([sys.executable, "-m", "service", "--port", "1"], cwd=ROOT, timeout=120,
                          env={**env, "SKILLCACHE_API_KEYS_FILE": str(bad)}, capture_output=True, text=True)
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr, proc.stderr


def test_keys_in_the_shipped_example_shape_load(tmp_path):
    """The documented entry shape, as docs/OPERATIONS.md shows it."""
    assert len(load_keys(write_keys(tmp_path / "k.json", KEYS))) == 3


def test_a_keys_entry_that_repeats_a_field_stops_the_start(tmp_path):
    """JSON keeps the last of repeated names silently: "role" twice made a user key admin."""
    path = tmp_path / "keys.json"
    path.write_text('[{"key": "%s", "namespace": "acme", "role": "user", "role": "admin"}]' % ADMIN)
    with pytest.raises(AuthConfigError, match=r"\['role'\] more than once"):
        load_keys(path)
