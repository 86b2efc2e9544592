"""Fidelity guard: seam calibration, shadow verification and the fallback to full prefill."""

import pytest

from appclient import make_client
from service.runtime.calibrate import calibrate
from tiny import random_ids, tiny_runtime


def test_calibration_picks_a_larger_seam_for_a_stricter_threshold():
    rt = tiny_runtime("llama")
    block = rt.compile_block(random_ids(40, seed=21))
    loose = calibrate(rt, block, [0, 1, 2, 4, 8, 16, 32], min_cosine=0.0, tie_margin=0.05)
    strict = calibrate(rt, block, [0, 1, 2, 4, 8, 16, 32], min_cosine=0.999999, tie_margin=0.05)
    assert loose.passed and loose.seam == 0
    assert strict.seam > loose.seam
    assert strict.passed and strict.cosine_min >= 0.999999  # at the whole block composition is exact (float32)


def test_calibration_is_stored_with_the_block_and_reported(tmp_path):
    with make_client(tmp_path, seam_auto=True, fidelity_min_cosine=0.0) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        c.post("/v1/skills", json={"name": "a", "text": "Refunds are allowed within 30 days of delivery."})
        c.portal.call(state.pipeline.guard.drain)
        info = c.get("/v1/skills/a").json()
        assert info["calibration"]["seam"] == 0 and info["calibration"]["passed"]
        r = c.post("/v1/compose", json={"skills": ["a"], "user": "hi", "max_tokens": 1}).json()
        assert r["skills"][0]["seam"] == 0 and r["skills"][0]["path"] == "compose"
        # the calibration travels with the block: a new process reads it from disk
        key = state.registry.block_key("default", "Refunds are allowed within 30 days of delivery.")
        from service.store.disk import DiskBlockStore

        stored = c.portal.call(DiskBlockStore(tmp_path / "store" / "blocks").get, key)
        assert "calibration" in stored.meta


class _Started(list):
    """guard.shadow_started that also writes "shadow" into an ordered log when a check starts."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def append(self, t: float) -> None:
        self.log.append("shadow")
        super().append(t)


def test_shadow_runs_after_the_response_and_records_fidelity(tmp_path, monkeypatch):
    """The shadow recompute starts only after the sampled request's whole response was produced: on the engine
    thread, its start comes after the request's last decode step (order, not timestamps)."""
    with make_client(tmp_path, shadow_sample_rate=1.0) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        c.post("/v1/skills", json={"name": "a", "text": "Refunds are allowed within 30 days of delivery."})
        guard, batch, log = state.pipeline.guard, state.engine.batch, []
        step = batch.step
        monkeypatch.setattr(batch, "step", lambda toks: (step(toks), log.append("decode"))[0])
        monkeypatch.setattr(guard, "shadow_started", _Started(log))
        r = c.post("/v1/compose", json={"skills": ["a"], "user": "hi", "max_tokens": 3})
        c.portal.call(guard.drain)
        assert r.status_code == 200, r.text
        n_tokens = r.json()["usage"]["completion_tokens"]
        assert n_tokens == 3  # the first from the prefill, two from decode steps
        assert log == ["decode"] * (n_tokens - 1) + ["shadow"], log
        info = c.get("/v1/skills/a").json()
        assert info["shadow"]["checks"] == 1
        text = c.get("/metrics").text
        assert "skillcache_shadow_checks_total" in text


@pytest.mark.slow
def test_broken_composition_is_caught_and_served_by_full_prefill(tmp_path, embedded_runtime):
    """No re-rotation (a deliberate bug) fails the shadow check; the skill then runs in full."""
    rt = embedded_runtime
    with make_client(tmp_path, runtime=rt, shadow_sample_rate=1.0, seam_auto=False) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        from pathlib import Path

        from service.registry.skillfile import parse_skill_file

        root = Path(__file__).resolve().parents[2] / "skills"
        for name in ("tool-specs", "refund-policy"):
            spec = parse_skill_file(root / f"{name}.md")
            c.post("/v1/skills", json={"name": name, "text": spec["text"], "fields": spec["fields"]})
        body = {"skills": ["tool-specs", "refund-policy"], "user": "Can I get a refund?", "max_tokens": 2}
        original = rt.rotator.rotate_layers
        rt.rotator.rotate_layers = lambda keys, delta: list(keys)
        try:
            first = c.post("/v1/compose", json=body).json()
            assert first["skills"][1]["path"] == "compose"
            c.portal.call(state.pipeline.guard.drain)
        finally:
            rt.rotator.rotate_layers = original
        guard = state.pipeline.guard
        assert guard.degraded, "the shadow check did not catch the broken composition"
        after = c.post("/v1/compose", json=body).json()
        assert {s["path"] for s in after["skills"]} == {"full"}
        assert after["usage"]["composed_tokens"] == 0
        assert c.get("/v1/skills/refund-policy").json()["degraded"]


def test_calibration_steps_report_the_tokens_they_run(monkeypatch):
    """The serving engine budgets background work by what each step yields: every model call happens inside a
    step, and a step runs at most `chunk` tokens and yields how many it ran."""
    from service.runtime.calibrate import calibrate, calibration_steps

    rt = tiny_runtime("llama")
    block = rt.compile_block(random_ids(24, seed=22))
    calibrate(rt, block, [0, 4], min_cosine=0.999, tie_margin=0.05)  # warm: the anchor's K/V is computed once
    ran = []
    forward = rt.forward
    monkeypatch.setattr(rt, "forward", lambda ids, start, cache: ran.append(len(ids)) or forward(ids, start, cache))
    steps = calibration_steps(rt, block, [0, 4], min_cosine=0.999, tie_margin=0.05, chunk=8)
    n_steps = 0
    try:
        while True:
            ran.clear()
            n = next(steps)
            assert n == sum(ran) and 0 < n <= 8, (n, ran)
            n_steps += 1
    except StopIteration as done:
        assert done.value.n_probes == 2 and not ran
    assert n_steps > 4


def test_shadow_full_prefill_runs_in_chunks(tmp_path, monkeypatch):
    """A live request waits behind one background step at most: the shadow's full prefill is split into
    SKILLCACHE_BACKGROUND_CHUNK_TOKENS-token steps of the engine's background work."""
    with make_client(tmp_path, shadow_sample_rate=1.0, background_chunk_tokens=8) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        c.post("/v1/skills", json={"name": "a", "text": "Refunds are allowed within 30 days of delivery."})
        rt, calls = state.runtime, []
        forward = rt.forward
        monkeypatch.setattr(rt, "forward", lambda ids, start, cache: calls.append((start, len(ids))) or
                            forward(ids, start, cache))
        r = c.post("/v1/compose", json={"skills": ["a"], "user": "hi", "max_tokens": 1}).json()
        del calls[:]  # the request's own forwards; what follows is the shadow check's
        c.portal.call(state.pipeline.guard.drain)
        n = r["usage"]["prompt_tokens"]
        assert {(lo, 8) for lo in range(0, n - 8, 8)} <= set(calls)  # the full prefill, 8 tokens a step
        assert not [x for x in calls if x[0] == 0 and x[1] > 8]  # and never in one piece
        assert [st["checks"] for st in state.pipeline.guard.shadow.values()] == [1]
