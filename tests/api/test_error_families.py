"""One error family, one payload: a store refusing a write, our own invariant failing, a body that does not validate.
Each is {"error": {"type", "message", "request_id"}} with the request id in the X-Request-ID header too."""

from __future__ import annotations

import errno
import logging

import pytest

from appclient import make_client
from service.runtime import composer
from service.store import fsutil

TEXT = "Returns are accepted within 30 days with a receipt. " * 4


@pytest.fixture
def c(tmp_path):
    with make_client(tmp_path) as client:
        client.portal.call(client.app.state.skillcache.wait_ready)
        assert client.post("/v1/skills", json={"name": "a", "text": TEXT}).status_code == 201
        yield client


def shape(r, status: int, error_type: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"type", "message", "request_id"} and err["type"] == error_type
    assert r.headers["x-request-id"] == err["request_id"]
    return err


def test_a_store_write_failure_is_507_store_write_failed(c, monkeypatch):
    def refuse(fd, view):
        raise OSError(errno.ENOSPC, "simulated")

    monkeypatch.setattr(fsutil, "_write", refuse)
    err = shape(c.post("/v1/skills", json={"name": "b", "text": TEXT + " B"}), 507, "store_write_failed")
    assert "SKILLCACHE_HOME" in err["message"]


def test_our_own_invariant_failing_is_a_500_with_the_request_id_in_the_log(c, monkeypatch, caplog):
    def broken(self, *a, **kw):
        raise composer.InternalError("block ids differ from the prompt's skill ids")

    monkeypatch.setattr(composer.Composer, "steps", broken)
    with caplog.at_level(logging.ERROR, logger="service.api.errors"):
        r = c.post("/v1/compose", json={"skills": ["a"], "user": "hi", "max_tokens": 2},
                   headers={"X-Request-ID": "trace-42"})
    err = shape(r, 500, "internal_error")
    assert err["request_id"] == "trace-42" and "report request trace-42" in err["message"]
    assert any("trace-42" in rec.getMessage() for rec in caplog.records)  # the log names it


def test_a_body_that_does_not_validate_is_422_with_a_made_request_id(c):
    err = shape(c.post("/v1/compose", json={"skills": ["a"], "user": "hi", "max_tokens": -1}), 422, "invalid_request")
    assert "max_tokens" in err["message"] and err["request_id"].startswith("req-")
    ok = c.get("/v1/skills")
    assert ok.status_code == 200 and ok.headers["x-request-id"].startswith("req-")  # on every response
