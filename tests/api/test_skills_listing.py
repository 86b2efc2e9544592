"""GET /v1/skills tells the truth about every skill's block: compiled, calibration, degraded, versions and hits are
the values GET /v1/skills/{name} reports, not placeholders (issue 22)."""

from appclient import make_client

TEXT = "Refunds are allowed within 30 days of delivery when the item is unused."


def _listed(c) -> dict[str, dict]:
    r = c.get("/v1/skills")
    assert r.status_code == 200, r.text
    return {s["name"]: s for s in r.json()["skills"]}


def test_listing_reports_compiled_versions_and_hits(client):
    assert client.post("/v1/skills", json={"name": "eager", "text": TEXT}).status_code == 201
    assert client.post("/v1/skills", json={"name": "eager", "text": TEXT + " v2"}).status_code == 201
    assert client.post("/v1/skills?compile=false", json={"name": "lazy", "text": TEXT + " lazy"}).status_code == 201
    listed = _listed(client)
    assert listed["eager"]["compiled"] is True and listed["lazy"]["compiled"] is False
    assert listed["eager"]["versions"] == [1, 2] and listed["eager"]["version"] == 2
    assert listed["eager"]["hits"] == {"compiled": 1} and listed["lazy"]["hits"] == {}
    for _ in range(2):
        r = client.post("/v1/compose", json={"skills": ["eager", "lazy"], "user": "hi", "max_tokens": 1})
        assert r.status_code == 200, r.text
    listed = _listed(client)
    assert listed["lazy"]["compiled"] is True
    assert listed["eager"]["hits"] == {"compiled": 1, "memory": 2}
    assert listed["lazy"]["hits"] == {"compiled": 1, "memory": 1}
    for name in ("eager", "lazy"):
        assert listed[name] == client.get(f"/v1/skills/{name}").json()


def test_listing_sees_a_block_that_is_gone(client):
    assert client.post("/v1/skills", json={"name": "gone", "text": TEXT}).status_code == 201
    state = client.app.state.skillcache
    client.portal.call(state.store.delete, state.registry.block_key("default", TEXT))  # evicted from every tier
    assert _listed(client)["gone"]["compiled"] is False


def test_listing_reports_the_calibrated_seam(tmp_path):
    with make_client(tmp_path, seam_auto=True) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        assert c.post("/v1/skills", json={"name": "cal", "text": TEXT}).status_code == 201
        c.portal.call(state.pipeline.guard.drain)  # the calibration the registration scheduled
        cal = _listed(c)["cal"]["calibration"]
        assert cal is not None and isinstance(cal["seam"], int) and "passed" in cal
        assert cal == c.get("/v1/skills/cal").json()["calibration"]


def test_listing_reports_a_degraded_skill(tmp_path):
    with make_client(tmp_path, shadow_sample_rate=1.0, fidelity_min_cosine=1.01) as c:  # every shadow check fails
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        for name in ("bad", "untouched"):
            assert c.post("/v1/skills", json={"name": name, "text": f"{TEXT} {name}"}).status_code == 201
        assert c.post("/v1/compose", json={"skills": ["bad"], "user": "hi", "max_tokens": 1}).status_code == 200
        c.portal.call(state.pipeline.guard.drain)
        listed = _listed(c)
        assert listed["bad"]["degraded"] is True and listed["bad"]["shadow"]["checks"] == 1
        assert listed["untouched"]["degraded"] is False and listed["untouched"]["shadow"] is None
