"""The real embedded model (SmolLM2-135M-Instruct), loaded once per test session."""

import os
from pathlib import Path

import pytest

from service.config import Settings

ROOT = Path(__file__).resolve().parents[2]


def embedded_settings(**overrides) -> Settings:
    home = os.environ.get("SKILLCACHE_HOME")
    base = {"home": Path(home)} if home else {}
    return Settings(model="embedded", **{**base, **overrides})


@pytest.fixture(scope="session")
def embedded_runtime():
    from service.runtime import build_runtime

    return build_runtime(embedded_settings())


@pytest.fixture(scope="session")
def shipped_skills(embedded_runtime):
    """(name, rendered text, ids) for every skill file shipped in skills/."""
    from service.registry.skill import render
    from skillcache_client.skillfile import iter_skill_files, parse_skill_file

    out = []
    for path in iter_skill_files(ROOT / "skills"):
        spec = parse_skill_file(path)
        text = render(spec["text"], spec.get("fields") or {})
        out.append((spec["name"], text, embedded_runtime.prompts.encode_content(text)))
    assert len(out) >= 5
    return out
