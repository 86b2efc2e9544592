"""The playground's static files (/ui): served whole, open when keys are configured (the page holds no data, /v1
still needs a key), shipped in the package, and made of plain ES modules whose imports all resolve."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from appclient import make_client
from service.api.routes.playground import STATIC

ROOT = Path(__file__).resolve().parents[2]
KEY = "playground-admin-key-0123456789"


def _assets(html: str) -> list[str]:
    return re.findall(r'(?:src|href)="(/ui/static/[^"]+)"', html)


def _imports(js: str) -> list[str]:
    return re.findall(r'^import .* from "\./([^"]+)";$', js, re.M)


def test_page_and_every_module_it_loads_are_served(client):
    page = client.get("/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assets = _assets(page.text)
    assert "/ui/static/main.js" in assets and "/ui/static/playground.css" in assets
    seen, todo = set(), list(assets)
    while todo:  # follow the module graph from the page's entry points
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        r = client.get(path)
        assert r.status_code == 200, path
        kind = "text/css" if path.endswith(".css") else "text/javascript"
        assert r.headers["content-type"].startswith(kind), (path, r.headers["content-type"])
        if path.endswith(".js"):
            todo += [f"/ui/static/{name}" for name in _imports(r.text)]
    on_disk = {f"/ui/static/{p.name}" for p in STATIC.iterdir() if p.suffix in (".js", ".css")}
    assert seen == on_disk, f"files the page never loads: {on_disk - seen}"
    assert client.get("/ui/static/nope.js").status_code == 404
    assert client.get("/", follow_redirects=False).headers["location"] == "/ui"


def test_no_script_writes_service_text_as_html():
    for path in STATIC.glob("*.js"):
        src = path.read_text()
        assert not re.search(r"\.(innerHTML|outerHTML)\s*=|insertAdjacentHTML|document\.write", src), path.name


def test_the_page_is_open_and_the_api_still_needs_a_key(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"key": KEY, "namespace": "acme", "role": "admin"}]))
    with make_client(tmp_path, api_keys_file=keys) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        assert c.get("/ui").status_code == 200
        assert c.get("/ui/static/api.js").status_code == 200
        r = c.get("/v1/skills")
        assert r.status_code == 401 and r.json()["error"]["type"] == "unauthorized"
        assert c.get("/v1/skills", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_the_static_files_ship_in_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    globs = package_data["service.api"]
    base = ROOT / "service" / "api"
    shipped = {p for g in globs for p in base.glob(g) if p.is_file()}
    files = {p for p in STATIC.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert files and files <= shipped, f"not in package data: {sorted(map(str, files - shipped))}"
