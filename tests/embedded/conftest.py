"""The real embedded model (SmolLM2-135M-Instruct), loaded once per test session."""

import pytest

from embedded_model import ROOT


@pytest.fixture(scope="session")
def shipped_skills(embedded_runtime):
    """(name, rendered text, ids) for every skill file shipped in skills/."""
    from service.registry.skill import render
    from service.registry.skillfile import iter_skill_files, parse_skill_file

    out = []
    for path in iter_skill_files(ROOT / "skills"):
        spec = parse_skill_file(path)
        text = render(spec["text"], spec.get("fields") or {})
        out.append((spec["name"], text, embedded_runtime.prompts.encode_content(text)))
    assert len(out) >= 5
    return out
