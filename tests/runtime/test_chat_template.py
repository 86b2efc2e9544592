"""SKILLCACHE_CHAT_TEMPLATE on tiny GGUF files: a model without a template says so (start-up warning, /readyz) and
gets plain text; an override (a built-in or a Jinja file) replaces that, or the tokenizer's own template; the
fingerprint covers the template in use; a bad override stops the start with what to fix."""

import logging

import pytest
from fastapi.testclient import TestClient

from tiny_gguf import write_tiny_gguf

from service.config import Settings
from service.errors import ModelLoadError
from service.main import create_app
from service.runtime import build_runtime

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Refund?"}]
# a ChatML variant: other role markers than tiny.py's, so a render shows which template was used
FILE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] | upper }}: {{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>ASSISTANT: {% endif %}"
)


@pytest.fixture(scope="module")
def base_gguf(tmp_path_factory):
    """A base checkpoint: no chat template in the file."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "base.gguf", chat_template=False)


def _settings(tmp_path, model, **kw) -> Settings:
    return Settings(model=str(model), home=tmp_path / "home", device="cpu", skills_dir=None, store="memory",
                    seam_auto=False, shadow_sample_rate=0.0, refine_after=0, **kw)


def _readyz(settings) -> dict:
    with TestClient(create_app(settings)) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        r = c.get("/readyz")
        assert r.status_code == 200, r.text
        return r.json()


def _render(rt) -> str:
    skill = rt.prompts.encode_content("Refunds are allowed within 30 days.")
    return rt.tokenizer.decode(rt.prompts.build(MSGS, [skill]).ids)


def test_no_template_falls_back_to_plain_text_and_says_so(tmp_path, base_gguf, caplog):
    with caplog.at_level(logging.WARNING, logger="service.runtime.templates"):
        rt = build_runtime(_settings(tmp_path, base_gguf))
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "base has no chat template" in warning and "SKILLCACHE_CHAT_TEMPLATE" in warning
    assert "<|im_start|>" in _render(rt)[:12] and "system" not in _render(rt)  # BOS, then plain text: no turns
    ready = _readyz(_settings(tmp_path, base_gguf))
    assert ready["chat_template"]["source"] == "none" and ready["chat_template"]["plain_text_fallback"]
    assert "SKILLCACHE_CHAT_TEMPLATE" in ready["chat_template"]["warning"]


def test_a_builtin_override_replaces_the_fallback(tmp_path, base_gguf, caplog):
    with caplog.at_level(logging.WARNING, logger="service.runtime.templates"):
        rt = build_runtime(_settings(tmp_path, base_gguf, chat_template="chatml"))
    assert not caplog.records  # no fallback warning
    text = _render(rt)
    assert text.startswith("<|im_start|>system\nRefunds are allowed") and text.endswith("<|im_start|>assistant\n")
    assert rt.tokenizer.convert_ids_to_tokens(rt.anchor) != ["<|im_start|>"]  # skills follow the system turn's opening
    assert rt.tokenizer.convert_tokens_to_ids("<|im_end|>") in rt.eos_ids  # the turn's end stops decoding
    ready = _readyz(_settings(tmp_path, base_gguf, chat_template="chatml"))
    assert ready["chat_template"] == {"source": "builtin", "name": "chatml", "sha256": ready["chat_template"]["sha256"],
                                      "plain_text_fallback": False, "warning": None}


def test_a_file_override_replaces_the_tokenizers_own_template(tmp_path):
    own = write_tiny_gguf(tmp_path / "chat.gguf", chat_template=True)  # tiny.py's ChatML
    assert "<|im_start|>system\n" in _render(build_runtime(_settings(tmp_path, own)))
    path = tmp_path / "template.jinja"
    path.write_text(FILE_TEMPLATE)
    rt = build_runtime(_settings(tmp_path, own, chat_template=str(path)))
    assert _render(rt).startswith("<|im_start|>SYSTEM: Refunds are allowed")
    assert rt.loaded.chat_template["source"] == "file" and rt.loaded.chat_template["name"] == str(path)


def test_the_fingerprint_covers_the_template_in_use(tmp_path, base_gguf):
    def fp(**kw) -> str:
        return build_runtime(_settings(tmp_path, base_gguf, **kw)).fingerprint

    path = tmp_path / "t.jinja"
    path.write_text(FILE_TEMPLATE)
    copy = tmp_path / "copy.jinja"
    copy.write_text(FILE_TEMPLATE)
    fps = {"none": fp(), "chatml": fp(chat_template="chatml"), "file": fp(chat_template=str(path))}
    assert len(set(fps.values())) == 3, fps  # blocks compiled under one template are never served under another
    assert fp(chat_template=str(copy)) == fps["file"]  # the template's text counts, not where it lives
    path.write_text(FILE_TEMPLATE.replace("upper", "lower"))
    assert fp(chat_template=str(path)) != fps["file"]


@pytest.mark.parametrize("setting, expect", [
    ("gemma", "no single token for <start_of_turn>, <end_of_turn>.*Built-ins that fit this tokenizer: chatml"),
    ("chatmll", "neither a built-in \\(chatml, gemma, llama3\\) nor a readable file"),
    ("{syntax", "neither a built-in"),
])
def test_a_bad_override_is_a_clear_start_up_error(tmp_path, base_gguf, setting, expect):
    with pytest.raises(ModelLoadError, match=expect):
        build_runtime(_settings(tmp_path, base_gguf, chat_template=setting))


@pytest.mark.parametrize("text, expect", [
    ("", "the file is empty"),
    ("{% for m in messages %}{{ m['content'] }", "fails on one user turn"),
    ("{% for m in messages %}{{ m['role'] }}{% endfor %}", "drops the user turn's content"),
])
def test_a_bad_template_file_is_a_clear_start_up_error(tmp_path, base_gguf, text, expect):
    path = tmp_path / "bad.jinja"
    path.write_text(text)
    with pytest.raises(ModelLoadError, match=expect):
        build_runtime(_settings(tmp_path, base_gguf, chat_template=str(path)))
    ready_error = TestClient(create_app(_settings(tmp_path, base_gguf, chat_template=str(path))))
    with ready_error as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        r = c.get("/readyz")
        assert r.status_code == 503 and "SKILLCACHE_CHAT_TEMPLATE" in r.json()["error"]
