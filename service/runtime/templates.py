"""The chat template prompts are rendered with: the tokenizer's own, an override (SKILLCACHE_CHAT_TEMPLATE: a Jinja
file or a built-in), or none, in which case service.runtime.prompt falls back to plain text (BOS, then the system
text, skills and turns joined by blank lines), which is right for base checkpoints and is said at start-up and in
/readyz. The template in use is the tokenizer's `chat_template`, so the fingerprint (tokenizer_digest) covers it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from service.errors import ModelLoadError

log = logging.getLogger(__name__)

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Gemma's turns; a system message leads the first user turn (Gemma has no system role), as in Google's template
GEMMA = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{{ (prefix if loop.first else '') + (message['content'] | trim) + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ (message['content'] | trim) + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# name -> (template, the special tokens it writes, the one that ends a turn: decoding stops there)
BUILTIN_TEMPLATES: dict[str, tuple[str, list[str], str]] = {
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    "gemma": (GEMMA, ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>"),
    "llama3": (LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
}
FALLBACK_WARNING = (
    "{name} has no chat template: prompts are plain text (BOS, then the system text, skills and turns joined by "
    "blank lines), which suits a base checkpoint. For a chat model set SKILLCACHE_CHAT_TEMPLATE to a Jinja file or "
    "one of: " + ", ".join(BUILTIN_TEMPLATES)
)


def _sha(template) -> str:
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe_template(tokenizer, model_name: str = "the model") -> dict:
    """What /readyz says about the tokenizer's own template (or its absence)."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        return {"source": "tokenizer", "name": None, "sha256": _sha(template), "plain_text_fallback": False,
                "warning": None}
    return {"source": "none", "name": None, "sha256": None, "plain_text_fallback": True,
            "warning": FALLBACK_WARNING.format(name=model_name)}


def _single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[0] if len(ids) == 1 else None


def _builtin(tokenizer, name: str) -> tuple[str, int]:
    template, markers, stop = BUILTIN_TEMPLATES[name]
    missing = [m for m in markers if _single_token(tokenizer, m) is None]
    if missing:
        fits = [n for n, (_, ms, _) in BUILTIN_TEMPLATES.items()
                if all(_single_token(tokenizer, m) is not None for m in ms)]
        raise ModelLoadError(
            f"SKILLCACHE_CHAT_TEMPLATE={name}: this tokenizer has no single token for {', '.join(missing)}, so the "
            f"template's turns would be spelled out as text. Built-ins that fit this tokenizer: "
            f"{', '.join(fits) or 'none'}; or give the path of a Jinja file")
    return template, _single_token(tokenizer, stop)


def _read_file(setting: str) -> str:
    path = Path(setting).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"SKILLCACHE_CHAT_TEMPLATE={setting!r} is neither a built-in "
                             f"({', '.join(BUILTIN_TEMPLATES)}) nor a readable file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"SKILLCACHE_CHAT_TEMPLATE={setting}: cannot read it as UTF-8 text: {e}") from e
    if not text.strip():
        raise ModelLoadError(f"SKILLCACHE_CHAT_TEMPLATE={setting}: the file is empty")
    return text


def _check_renders(tokenizer, setting: str) -> None:
    probe = "skillcache template probe"
    try:
        out = tokenizer.apply_chat_template([{"role": "user", "content": probe}], tokenize=False,
                                            add_generation_prompt=True)
    except Exception as e:
        raise ModelLoadError(f"SKILLCACHE_CHAT_TEMPLATE={setting}: the template fails on one user turn: "
                             f"{type(e).__name__}: {e}") from e
    if probe not in out:
        raise ModelLoadError(f"SKILLCACHE_CHAT_TEMPLATE={setting}: the template drops the user turn's content")


def use_chat_template(loaded, setting: str | None) -> dict:
    """Install the override named by `setting` (None: keep the tokenizer's) on `loaded`'s tokenizer; warn about
    the plain-text fallback. Returns what /readyz reports. A bad override raises ModelLoadError."""
    tok = loaded.tokenizer
    if not setting:
        info = describe_template(tok, loaded.name)
        if info["warning"]:
            log.warning(info["warning"])
        return info
    if setting in BUILTIN_TEMPLATES:
        template, stop_id = _builtin(tok, setting)
        source = "builtin"
    else:
        template, stop_id, source = _read_file(setting), None, "file"
    if getattr(tok, "chat_template", None):
        log.info("SKILLCACHE_CHAT_TEMPLATE=%s replaces the tokenizer's own chat template", setting)
    tok.chat_template = template
    _check_renders(tok, setting)
    if stop_id is not None:  # the turn's end stops decoding, as the tokenizer's EOS does
        gen = loaded.model.generation_config
        eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
        gen.eos_token_id = [e for e in eos if e is not None] + ([stop_id] if stop_id not in eos else [])
    log.info("chat template: %s %s", source, setting)
    return {"source": source, "name": setting, "sha256": _sha(template), "plain_text_fallback": False,
            "warning": None}
