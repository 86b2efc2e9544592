"""Skill records: names, versions, content hashes and `{{field}}` placeholders. No tensors here."""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import asdict, dataclass, field

from service.errors import InvalidField, InvalidSkillName

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
_NAME_RE = re.compile(NAME_PATTERN)
FIELD_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"
_FIELD_RE = re.compile(FIELD_PATTERN)
_PLACEHOLDER_RE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
MAX_FIELD_VALUE_CHARS = 1024


def check_skill_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidSkillName(
            f"invalid skill name {name!r}: use 1-64 characters of lowercase letters, digits, '.', '_' "
            f"or '-', starting with a letter or digit (pattern {NAME_PATTERN})"
        )
    return name


def placeholders(text: str) -> list[str]:
    """Field names referenced as {{name}} in text, in order of first appearance."""
    return list(dict.fromkeys(_PLACEHOLDER_RE.findall(text)))


def check_fields(text: str, fields: dict[str, str]) -> None:
    for name, value in fields.items():
        if not _FIELD_RE.fullmatch(name):
            raise InvalidField(f"invalid field name {name!r}: must match {FIELD_PATTERN}")
        if not isinstance(value, str) or len(value) > MAX_FIELD_VALUE_CHARS:
            raise InvalidField(f"field {name!r}: the value must be a string of at most {MAX_FIELD_VALUE_CHARS} chars")
    missing = [p for p in placeholders(text) if p not in fields]
    if missing:
        raise InvalidField(
            f"the text refers to undeclared fields {missing}; declare them in 'fields' with a default value"
        )


def render(text: str, values: dict[str, str]) -> str:
    """Substitute {{field}} placeholders. Every placeholder must have a value."""
    return _PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], text)


def render_spans(text: str, values: dict[str, str]) -> tuple[str, dict[str, list[tuple[int, int]]]]:
    """Render placeholders and return the character spans [start, end) each field's value occupies."""
    out: list[str] = []
    spans: dict[str, list[tuple[int, int]]] = {}
    cursor = 0
    length = 0
    for m in _PLACEHOLDER_RE.finditer(text):
        literal = text[cursor : m.start()]
        out.append(literal)
        length += len(literal)
        value = values[m.group(1)]
        spans.setdefault(m.group(1), []).append((length, length + len(value)))
        out.append(value)
        length += len(value)
        cursor = m.end()
    out.append(text[cursor:])
    return "".join(out), spans


def content_hash(text: str, fields: dict[str, str]) -> str:
    payload = json.dumps({"text": text, "fields": fields}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def text_hash(text: str) -> str:
    """Hash of the exact text a block is compiled from (the block key's content hash)."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class SkillRecord:
    namespace: str
    name: str
    version: int
    text: str  # may hold {{field}} placeholders
    content_hash: str  # of text + field defaults: same hash, same version
    n_tokens: int  # of the text rendered with the defaults
    description: str | None = None
    fields: dict[str, str] = field(default_factory=dict)  # name -> default value
    created_at: float = field(default_factory=time.time)

    @property
    def default_text(self) -> str:
        return render(self.text, self.fields)

    def to_doc(self) -> dict:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict) -> "SkillRecord":
        return cls(**{k: doc[k] for k in cls.__dataclass_fields__ if k in doc})

    def public(self) -> dict:
        """The record as the API shows it."""
        d = self.to_doc()
        d.pop("namespace")
        return d


class TextBlock(SkillRecord):
    """A block named by its text alone (an Anthropic `cache_control` block, an agent's repeated section): not
    registered, no fields, its text used as is (braces are text, not placeholders). Content-addressed like any block
    (the store keys blocks by their text's hash), so it composes at any position as a skill does."""

    @classmethod
    def of(cls, namespace: str, text: str) -> "TextBlock":
        digest = hashlib.sha256(text.encode()).hexdigest()
        return cls(namespace, f"block-{digest[:16]}", 1, text, digest, 0)

    @property
    def default_text(self) -> str:
        return self.text
