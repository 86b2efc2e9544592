"""The playground page in a real headless Chromium against a real service on the embedded model, with API keys:
the registry as the API lists it, two shipped skills composed and recomputed in full (both streamed, with their
timings, token counts and erratum line), and the typed error for a skill that is not registered.

    SKILLCACHE_SCREENSHOT=docs/img/playground.png .venv/bin/python -m pytest tests/ui -k browser   # make screenshot

also writes the README's screenshot of the page (taken after both runs). For that picture the test first waits
(up to 10 minutes) for the background seam calibration of the two compiled skills, so the registry shows their seams."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

from service.registry.skillfile import iter_skill_files, parse_skill_file
from ui_browser import chromium, require_browser
from service.devserver import ROOT, ServiceNotReady, ServiceProcess

pytestmark = pytest.mark.slow
KEY = "playground-browser-admin-key-0123456789"
RUN_TIMEOUT_S = 300  # both runs on a busy 2-core CI machine
COMPOSED = ("refund-policy", "style-guide")  # the shipped skills the test composes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The service with every shipped skill registered, but only the two the test composes preloaded (compiled at
    start-up, the slow part of a start): the others are registered with ?compile=false, so the registry holds
    compiled and uncompiled skills and the page must tell them apart."""
    require_browser()
    home = tmp_path_factory.mktemp("home")
    keys = home / "keys.json"
    keys.write_text(json.dumps([{"key": KEY, "namespace": "default", "role": "admin"}]))
    preload = home / "skills"
    preload.mkdir()
    for name in COMPOSED:
        shutil.copy(ROOT / "skills" / f"{name}.md", preload)
    svc = ServiceProcess(home, {"SKILLCACHE_SKILLS_DIR": str(preload), "SKILLCACHE_API_KEYS_FILE": str(keys)})
    with svc:
        try:
            svc.wait_ready(600)
        except ServiceNotReady as e:
            pytest.fail(str(e))
        for path in iter_skill_files(ROOT / "skills"):
            if path.stem not in COMPOSED:
                r = httpx.post(f"{svc.url}/v1/skills?compile=false", json=parse_skill_file(path),
                               headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
                assert r.status_code == 201 and not r.json()["compiled"], r.text
        yield svc


@pytest.fixture
def page(server, tmp_path):
    from selenium.webdriver.support.ui import WebDriverWait

    driver = chromium(str(tmp_path / "profile"))
    try:
        driver.get(f"{server.url}/ui")
        WebDriverWait(driver, 60).until(lambda d: d.find_element("tag name", "body").get_attribute("data-loaded"))
        yield driver
    finally:
        driver.quit()


def _css(driver, selector):
    return driver.find_element("css selector", selector)


def _wait(driver, what, timeout=60):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2,
                         ignored_exceptions=[StaleElementReferenceException]).until(lambda d: what(d))


def _state(driver, mode: str) -> str | None:
    return _css(driver, f"#panel-{mode}").get_attribute("data-state")


def _panel(driver, mode: str) -> dict:
    """What a result panel shows, cell by cell."""
    p = _css(driver, f"#panel-{mode}")
    cells = {name: p.find_element("css selector", f".{name}").text
             for name in ("text", "first-token", "ttft", "prompt", "reused", "recomputed", "completion")}
    return {**cells, "state": p.get_attribute("data-state"),
            "deltas": int(p.find_element("css selector", ".events").get_attribute("data-deltas") or 0),
            "skills": [li.text for li in p.find_elements("css selector", ".skills li")],
            "errata": [li.text for li in p.find_elements("css selector", ".errata li")],
            "error": p.find_element("css selector", ".error").get_attribute("data-type")}


def _number(text: str) -> int:
    return int(text.replace(",", ""))


def _wait_calibrated(server, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listing = httpx.get(f"{server.url}/v1/skills", headers={"Authorization": f"Bearer {KEY}"}).json()["skills"]
        if all(s["calibration"] for s in listing if s["compiled"]):
            return
        time.sleep(5)


def _screenshot(driver, path: Path) -> None:
    """The whole page (the window fitted to its content), as a 256-colour PNG to keep the committed file small."""
    from PIL import Image

    height = driver.execute_script("return Math.ceil(document.body.getBoundingClientRect().height)")
    driver.set_window_size(1360, height)
    frame = height - driver.execute_script("return window.innerHeight")  # the window's own bars, if any
    driver.set_window_size(1360, height + frame)
    path.parent.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(path)), path
    with Image.open(path) as shot:
        shot.convert("RGB").quantize(256).save(path, optimize=True)
    assert path.stat().st_size > 10_000


def test_compose_two_shipped_skills_in_both_modes_then_an_unknown_skill(server, page, tmp_path):
    d = page
    # without a key the service refuses /v1: the page shows its typed error
    _wait(d, lambda d: _css(d, "#registry-error").get_attribute("data-type"))
    assert _css(d, "#registry-error").get_attribute("data-type") == "unauthorized"
    assert "HTTP 401" in _css(d, "#registry-error").text

    if os.environ.get("SKILLCACHE_SCREENSHOT"):
        _wait_calibrated(server)
    _css(d, "#key").send_keys(KEY)
    _css(d, "#save-key").click()
    listing = httpx.get(f"{server.url}/v1/skills", headers={"Authorization": f"Bearer {KEY}"}).json()["skills"]
    assert len(listing) >= 6
    assert {s["name"] for s in listing if s["compiled"]} == set(COMPOSED), listing
    _wait(d, lambda d: len(d.find_elements("css selector", "#registry tbody tr[data-skill]")) == len(listing))
    assert _css(d, "#registry-error").get_attribute("hidden") is not None
    for skill in listing:  # the table shows what the API lists
        row = _css(d, f'#registry tr[data-skill="{skill["name"]}"]')
        assert row.find_element("css selector", ".tokens").text == str(skill["n_tokens"])
        assert row.find_element("css selector", ".compiled").text == ("yes" if skill["compiled"] else "no")
        assert row.find_element("css selector", ".version").text.startswith(f"v{skill['version']}")
    assert d.execute_script("return sessionStorage.getItem('skillcache.apiKey')") == KEY
    assert d.execute_script("return localStorage.length") == 0

    # style-guide first, then refund-policy moved up: the prompt order is refund-policy, style-guide
    for name in ("style-guide", "refund-policy"):
        _css(d, f'#registry tr[data-skill="{name}"] button.add').click()
    _css(d, '#chosen li[data-skill="refund-policy"] button[title="earlier in the prompt"]').click()
    assert [li.get_attribute("data-skill") for li in d.find_elements("css selector", "#chosen li")] == [
        "refund-policy", "style-guide"]
    field = _css(d, 'input[data-field="order_status"]')
    field.clear()
    field.send_keys("shipped")
    _css(d, "#max-tokens").clear()
    _css(d, "#max-tokens").send_keys("16")
    _css(d, "#run-both").click()
    _wait(d, lambda d: _state(d, "full") in ("done", "error"), RUN_TIMEOUT_S)

    comp, full = _panel(d, "compose"), _panel(d, "full")
    for run in (comp, full):
        assert run["state"] == "done" and run["error"] is None, run
        assert run["text"].strip(), run
        assert run["deltas"] >= 2, f"not streamed: {run}"
        assert re.match(r"\d[\d,]* ms \(to the first text, total \d[\d,]* ms\)$", run["first-token"]), run
        assert re.match(r"\d[\d,]* ms / \d[\d,]* ms$", run["ttft"]), run
        assert any("[STATE UPDATE] order_status has changed to shipped" in line for line in run["errata"]), run
        assert [s.split(" ")[0] for s in run["skills"]] == ["refund-policy", "style-guide"]
    assert comp["prompt"] == full["prompt"], "the two modes built different prompts"
    composed, prefix = map(_number, comp["reused"].split(" / "))
    assert composed + prefix > 1000, comp  # both blocks (790 + 652 tokens) reused, not recomputed
    assert _number(comp["recomputed"]) + composed + prefix == _number(comp["prompt"])
    assert full["reused"] == "0 / 0" and full["recomputed"] == full["prompt"]
    assert all(": full (" in s for s in full["skills"])
    assert re.match(r"First token \d+\.\dx sooner composed", _css(d, "#comparison").text), _css(d, "#comparison").text
    if os.environ.get("SKILLCACHE_SCREENSHOT"):
        _screenshot(d, ROOT / os.environ["SKILLCACHE_SCREENSHOT"])
    else:
        _screenshot(d, tmp_path / "playground.png")

    # a skill nobody registered: the service's typed error, in the panel, before any text
    _css(d, "#add-name").send_keys("no-such-skill")
    _css(d, "#add-name-btn").click()
    _css(d, "#run-compose").click()
    _wait(d, lambda d: _state(d, "compose") == "error", RUN_TIMEOUT_S)
    comp = _panel(d, "compose")
    assert comp["error"] == "skill_not_found" and comp["text"] == ""
    assert ("HTTP 404" in _css(d, "#panel-compose .error").text
            and "no-such-skill" in _css(d, "#panel-compose .error").text)
    script_errors = [e for e in d.get_log("browser") if e["source"] == "javascript"]
    assert not script_errors, script_errors
