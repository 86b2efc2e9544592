"""Fidelity guard state over a skill's life: one calibration per block, deletes, one-off variant blocks.

The guard's background jobs run as the engine's background work; pausing it (`engine.pause_background`) keeps
them in flight, so each test decides what a job sees when it runs instead of racing it."""

from appclient import make_client
from service import metrics

TEXT = "Refunds are allowed within 30 days of delivery when the item is unused."
FIELD_TEXT = "Order status: {{status}}. Refunds are allowed within 30 days of delivery when the item is unused."


def _total(counter) -> float:
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def _gauge() -> float:
    return metrics.DEGRADED_SKILLS._value.get()


def test_one_calibration_per_block_in_flight(tmp_path):
    """Composes of a block not yet calibrated schedule its calibration once, not once per request."""
    with make_client(tmp_path, seam_auto=True) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        guard = state.pipeline.guard
        assert c.post("/v1/skills?compile=false", json={"name": "a", "text": TEXT}).status_code == 201
        before = _total(metrics.CALIBRATIONS)
        state.engine.pause_background()  # no background job runs until resumed
        try:
            for i in range(12):
                r = c.post("/v1/compose", json={"skills": ["a"], "user": f"hi {i}", "max_tokens": 1})
                assert r.status_code == 200
            assert len(guard._bg) == 1
        finally:
            state.engine.resume_background()
        c.portal.call(guard.drain)
        assert _total(metrics.CALIBRATIONS) - before == 1
        assert c.get("/v1/skills/a").json()["calibration"] is not None
        r = c.post("/v1/compose", json={"skills": ["a"], "user": "again", "max_tokens": 1})
        assert r.status_code == 200 and not guard._bg  # calibrated: nothing more to schedule


def test_a_late_calibration_does_not_restore_a_deleted_skill(tmp_path):
    with make_client(tmp_path, seam_auto=True) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        p = state.pipeline
        key = p.registry.block_key("default", TEXT)
        state.engine.pause_background()
        try:
            assert c.post("/v1/skills", json={"name": "b", "text": TEXT}).status_code == 201  # calibration pending
            assert len(p.guard._bg) == 1
            assert c.delete("/v1/skills/b").status_code == 200
        finally:
            state.engine.resume_background()
        c.portal.call(p.guard.drain)  # the calibration runs to its end
        assert not c.portal.call(p.store.contains, key)
        assert not list((tmp_path / "store").rglob(f"*{key.content_hash}*"))
        # registered again, it is compiled and calibrated as new
        assert c.post("/v1/skills", json={"name": "b", "text": TEXT}).status_code == 201
        c.portal.call(p.guard.drain)
        assert c.get("/v1/skills/b").json()["calibration"] is not None


def test_delete_clears_a_degraded_skill(tmp_path):
    """A degraded skill deleted and registered again (recompiled) is fresh: composed, not degraded, counted
    nowhere; with SKILLCACHE_SEAM_AUTO=false no calibration would ever clear it."""
    with make_client(tmp_path, seam_auto=False, shadow_sample_rate=1.0, fidelity_min_cosine=1.01) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        guard = state.pipeline.guard
        body = {"skills": ["d"], "user": "hi", "max_tokens": 1}
        assert c.post("/v1/skills", json={"name": "d", "text": TEXT}).status_code == 201
        assert c.post("/v1/compose", json=body).status_code == 200
        c.portal.call(guard.drain)  # every shadow check fails (cosine > 1 required)
        assert c.get("/v1/skills/d").json()["degraded"] and _gauge() == 1
        assert c.delete("/v1/skills/d").status_code == 200
        assert _gauge() == 0 and not guard.degraded and not guard.shadow
        assert c.post("/v1/skills", json={"name": "d", "text": TEXT}).status_code == 201
        info = c.get("/v1/skills/d").json()
        assert not info["degraded"] and info["shadow"] is None
        assert [s["path"] for s in c.post("/v1/compose", json=body).json()["skills"]] == ["compose"]
        c.portal.call(guard.drain)


def test_a_shadow_check_finishing_after_the_delete_leaves_no_state(tmp_path):
    with make_client(tmp_path, seam_auto=False, shadow_sample_rate=1.0, fidelity_min_cosine=1.01) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        guard = state.pipeline.guard
        assert c.post("/v1/skills", json={"name": "d", "text": TEXT}).status_code == 201
        state.engine.pause_background()
        try:
            assert c.post("/v1/compose", json={"skills": ["d"], "user": "hi", "max_tokens": 1}).status_code == 200
            assert len(guard._bg) == 1  # its shadow check, waiting
            assert c.delete("/v1/skills/d").status_code == 200
        finally:
            state.engine.resume_background()
        c.portal.call(guard.drain)  # the check fails, for a skill that is gone
        assert not guard.degraded and not guard.shadow and _gauge() == 0
        assert c.post("/v1/skills", json={"name": "d", "text": TEXT}).status_code == 201
        assert not c.get("/v1/skills/d").json()["degraded"]


def _variant(c, value):
    r = c.post("/v1/compose", json={"skills": ["r"], "user": "Refund?", "max_tokens": 1,
                                    "fields": {"status": value}, "edit_mode": "recompile"})
    assert r.status_code == 200, r.text
    c.portal.call(c.app.state.skillcache.pipeline.guard.drain)
    return r.json()


def _field_skill(c) -> str:
    state = c.app.state.skillcache
    c.portal.call(state.wait_ready)
    assert c.post("/v1/skills", json={"name": "r", "text": FIELD_TEXT, "fields": {"status": "A"}}).status_code == 201
    rec = c.portal.call(state.registry.get, "default", "r", None)
    return str(state.registry.block_key("default", rec.default_text))


def test_shadow_checks_of_one_off_variants_count_for_their_skill(tmp_path):
    """`recompile` edits with new field values compose one-off blocks: their shadow checks are the skill's,
    not one more guard entry per variant."""
    with make_client(tmp_path, shadow_sample_rate=1.0, fidelity_min_cosine=0.0) as c:
        key, guard = _field_skill(c), c.app.state.skillcache.pipeline.guard
        for i in range(5):
            assert [s["path"] for s in _variant(c, f"v{i}")["skills"]] == ["compose"]
        assert set(guard.shadow) == {key} and not guard.degraded
        assert c.get("/v1/skills/r").json()["shadow"]["checks"] == 5


def test_a_failed_shadow_check_of_a_variant_degrades_its_skill(tmp_path):
    """One degraded skill (one in the gauge), whatever the variant: its variants and itself then run in full."""
    with make_client(tmp_path, shadow_sample_rate=1.0, fidelity_min_cosine=1.01) as c:
        key, guard = _field_skill(c), c.app.state.skillcache.pipeline.guard
        assert [s["path"] for s in _variant(c, "v0")["skills"]] == ["compose"]  # its shadow check fails
        assert set(guard.degraded) == {key} and set(guard.shadow) == {key} and _gauge() == 1
        for i in range(1, 4):
            assert [s["path"] for s in _variant(c, f"v{i}")["skills"]] == ["full"]
        r = c.post("/v1/compose", json={"skills": ["r"], "user": "Refund?", "max_tokens": 1}).json()
        assert [s["path"] for s in r["skills"]] == ["full"]
        assert c.get("/v1/skills/r").json()["degraded"] and len(guard.degraded) == 1 and _gauge() == 1
        assert c.delete("/v1/skills/r").status_code == 200
        assert not guard.shadow and not guard.degraded and _gauge() == 0
