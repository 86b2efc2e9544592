"""The service's side of the tested range (service/vllm/compat.py): the first time vLLM answers /health, its release is
read from /version, and one warning names the tested range when it is not one of them. The connector's side (vLLM's
log) runs inside vLLM's venv (connector_cases.py)."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from service.vllm import compat
from service.vllm.client import VllmClient


def client_of(version: str | None) -> tuple[VllmClient, list[str]]:
    asked: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/version" and version is not None:
            return httpx.Response(200, json={"version": version})
        return httpx.Response(404)

    c = VllmClient("http://vllm:8000")
    c.http = httpx.AsyncClient(base_url=c.base_url, transport=httpx.MockTransport(answer))
    return c, asked


def health_twice(c: VllmClient) -> list[bool]:
    async def run():
        out = [await c.health(), await c.health()]
        await c.http.aclose()
        return out
    return asyncio.run(run())


@pytest.mark.parametrize("version, warned", [("0.29.1", True), ("0.33.0", True), (compat.TESTED[0], False),
                                             (compat.TESTED[-1] + "+cpu", False), (None, True)])
def test_an_untested_vllm_is_named_once_with_the_tested_range(caplog, version, warned):
    c, asked = client_of(version)
    with caplog.at_level(logging.WARNING, logger="service.vllm.client"):
        assert health_twice(c) == [True, True]
    lines = [r.getMessage() for r in caplog.records if "tested on" in r.getMessage()]
    assert len(lines) == (1 if warned else 0)
    if warned:
        assert f"{compat.TESTED[0]} to {compat.TESTED[-1]}" in lines[0] and "http://vllm:8000" in lines[0]
    assert asked.count("/version") == 1  # read once, not on every health check
    assert c.version == (version or "")


def test_a_vllm_that_does_not_answer_is_not_asked_its_version():
    c = VllmClient("http://127.0.0.1:9")  # nothing listens there
    assert asyncio.run(c.health()) is False
    assert c.version is None


def test_the_pinned_release_is_the_newest_tested_one():
    """scripts/install-vllm.sh installs compat.TESTED's last release by default (make run-vllm, CI)."""
    import re

    from service.vllm.launch import ROOT

    script = (ROOT / "scripts" / "install-vllm.sh").read_text()
    assert re.search(r'VLLM_VERSION:-([0-9.]+)\}', script).group(1) == compat.TESTED[-1]
    assert list(compat.TESTED) == sorted(compat.TESTED, key=compat.release)
