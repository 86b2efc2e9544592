"""Gemma-3-270M loaded once per test session, its shipped skills tokenized and compiled once."""

import pytest

from embedded_model import ROOT


@pytest.fixture(scope="session")
def gemma_runtime():
    from gemma_model import gemma_settings

    from service.runtime import build_runtime

    return build_runtime(gemma_settings())


@pytest.fixture(scope="session")
def gemma_skills(gemma_runtime):
    """{name: (ids, block)} for every skill file in skills/, rendered with its defaults as the service does."""
    from service.registry.skill import render
    from service.registry.skillfile import iter_skill_files, parse_skill_file

    out = {}
    for path in iter_skill_files(ROOT / "skills"):
        spec = parse_skill_file(path)
        ids = gemma_runtime.prompts.encode_content(render(spec["text"], spec.get("fields") or {}))
        out[spec["name"]] = (ids, gemma_runtime.compile_block(ids))
    assert len(out) >= 5
    return out
