"""Start-up says what it does: a log line as each phase starts and ends, and /readyz names the phase while not ready."""

from __future__ import annotations

import logging
import threading

from appclient import make_client
from service.runtime import selfcheck


def test_readyz_names_the_phase_while_starting_and_the_log_has_each_phases_duration(tmp_path, monkeypatch, caplog):
    gate, entered = threading.Event(), threading.Event()
    real = selfcheck.run_selfcheck

    def slow_selfcheck(rt):  # on the engine's thread: holds the start-up in its self-check until the test has looked
        entered.set()
        assert gate.wait(60)
        return real(rt)

    monkeypatch.setattr(selfcheck, "run_selfcheck", slow_selfcheck)
    with caplog.at_level(logging.INFO, logger="service.startup"), make_client(tmp_path) as c:
        assert entered.wait(60)
        starting = c.get("/readyz")
        gate.set()
        c.portal.call(c.app.state.skillcache.wait_ready)
        ready = c.get("/readyz")
    assert starting.status_code == 503 and starting.json()["phase"] == "self-check"
    assert ready.status_code == 200 and ready.json()["phase"] == "ready"
    took = ready.json()["startup_s"]
    assert list(took) == ["self-check", "shipped skills: registering and compiling"] and took["self-check"] > 0
    lines = [r.getMessage() for r in caplog.records]
    assert "start-up: self-check ..." in lines
    assert any(line.startswith("start-up: self-check done in ") for line in lines)
    assert any(line.startswith("start-up: ready after ") for line in lines)


def test_a_self_check_that_raises_is_reported_by_readyz_as_json_not_a_500(monkeypatch):
    """A self-check that fails with an exception (no error measured) still gives /readyz a JSON body: 503, the error
    named, max_abs_err null (it was NaN, which JSON cannot carry: /readyz answered 500)."""
    import json

    from tests.tiny import tiny_runtime

    rt = tiny_runtime("llama")
    monkeypatch.setattr(rt, "compile_block", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    report = selfcheck.run_selfcheck(rt).to_dict()
    assert report["ok"] is False and report["max_abs_err"] is None and "boom" in report["error"]
    json.dumps(report, allow_nan=False)
    nan = selfcheck.SelfCheckReport(False, float("nan"), 0.0, 1, 1, [], 0.0, "x").to_dict()
    assert nan["max_abs_err"] is None
