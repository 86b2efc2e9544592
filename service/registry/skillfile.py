"""Skill files: Markdown with a small front matter block. Standard library only: the client package ships this same
file (clients/python/skillcache_client/skillfile.py is a link to it), so the service and the CLI read one format.

    ---
    name: refund-policy
    description: Retail refund rules
    fields:
      order_status: delivered
    ---
    # SKILL: REFUND_POLICY
    ... {{order_status}} ...

Front matter keys: `name` (required), `description`, `fields` (an indented mapping of field name to
default value). Values may be quoted with '...' or "...". The body, stripped of surrounding
whitespace, is the skill text; every `{{field}}` in it must be declared under `fields`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from os import PathLike
from pathlib import Path
from typing import Any

SKILL_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
FIELD_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
PLACEHOLDER_RE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
FRONT_MATTER_KEYS = ("name", "description", "fields")
SKILL_FILE_SUFFIXES = (".md", ".markdown")
_FENCE = "---"


class SkillFileError(ValueError):
    """A skill file that cannot be parsed; the message names the file and line."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None) -> None:
        where = f"{path}:{line}: " if path and line else f"{path}: " if path else f"line {line}: " if line else ""
        super().__init__(f"{where}{message}")
        self.path, self.line = path, line


def placeholders(text: str) -> list[str]:
    """Field names referenced as `{{name}}` in text, in order of first use."""
    return list(dict.fromkeys(PLACEHOLDER_RE.findall(text)))


def render(text: str, values: Mapping[str, str]) -> str:
    """Replace each `{{name}}` whose name is in values; leave the others untouched."""
    return PLACEHOLDER_RE.sub(lambda m: str(values[m.group(1)]) if m.group(1) in values else m.group(0), text)


def _scalar(raw: str) -> str:
    value = raw.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        try:
            return str(json.loads(value))
        except ValueError:
            return value[1:-1]
    if len(value) >= 2 and value[0] == value[-1] == "'":
        return value[1:-1].replace("''", "'")
    return value


def parse_skill_text(source: str, path: str | None = None) -> dict[str, Any]:
    """Parse a skill file's contents -> `{"name", "description", "fields", "text"}`."""
    lines = source.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n").split("\n")
    start = next((i for i, ln in enumerate(lines) if ln.strip()), None)
    if start is None or lines[start].strip() != _FENCE:
        raise SkillFileError("missing front matter: the file must start with a '---' line", path)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip() == _FENCE), None)
    if end is None:
        raise SkillFileError("unterminated front matter: no closing '---' line", path, start + 1)

    meta: dict[str, str] = {}
    fields: dict[str, str] = {}
    seen: set[str] = set()
    in_fields = False
    for no in range(start + 1, end):
        line = lines[no]
        lineno = no + 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = line[: len(line) - len(line.lstrip())]
        if "\t" in indent:
            raise SkillFileError("indent with spaces, not tabs", path, lineno)
        key, sep, value = line.strip().partition(":")
        key = key.strip()
        if not sep or not key:
            raise SkillFileError(f"expected 'key: value', got {line.strip()!r}", path, lineno)
        if not indent:
            if key not in FRONT_MATTER_KEYS:
                raise SkillFileError(f"unknown key {key!r} (known: {', '.join(FRONT_MATTER_KEYS)})", path, lineno)
            if key in seen:
                raise SkillFileError(f"duplicate key {key!r}", path, lineno)
            seen.add(key)
            in_fields = key == "fields"
            if in_fields:
                if value.strip() not in ("", "{}"):
                    raise SkillFileError("'fields' is an indented mapping on the lines below it", path, lineno)
            else:
                meta[key] = _scalar(value)
        elif in_fields:
            if not FIELD_NAME_RE.fullmatch(key):
                raise SkillFileError(f"invalid field name {key!r}", path, lineno)
            if key in fields:
                raise SkillFileError(f"duplicate field {key!r}", path, lineno)
            fields[key] = _scalar(value)
        else:
            raise SkillFileError("unexpected indented line (only 'fields' takes a nested mapping)", path, lineno)

    name = meta.get("name", "")
    if not name:
        raise SkillFileError("front matter has no 'name'", path)
    if not SKILL_NAME_RE.fullmatch(name):
        raise SkillFileError(f"invalid skill name {name!r} (must match {SKILL_NAME_RE.pattern})", path)
    text = "\n".join(lines[end + 1:]).strip()
    if not text:
        raise SkillFileError("the skill body is empty", path)
    undeclared = [f for f in placeholders(text) if f not in fields]
    if undeclared:
        raise SkillFileError(f"body uses undeclared field(s): {', '.join(undeclared)}", path)
    return {"name": name, "description": meta.get("description") or None, "fields": fields, "text": text}


def parse_skill_file(path: str | PathLike[str]) -> dict[str, Any]:
    """Read and parse one skill file (UTF-8) -> `{"name", "description", "fields", "text"}`."""
    p = Path(path)
    try:
        source = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SkillFileError(f"not UTF-8 text ({e.reason})", str(p)) from None
    return parse_skill_text(source, str(p))


def iter_skill_files(path: str | PathLike[str]) -> Iterator[Path]:
    """A file as given; or a folder's skill files (*.md, *.markdown), recursively, sorted by path.

    README files and anything under a hidden (`.`) or private (`_`) name are skipped.
    """
    root = Path(path)
    if root.is_file():
        yield root
        return
    if not root.is_dir():
        raise FileNotFoundError(f"no such file or folder: {root}")
    found = []
    for p in root.rglob("*"):
        rel = p.relative_to(root).parts
        if any(part.startswith((".", "_")) for part in rel):
            continue
        if p.is_file() and p.suffix.lower() in SKILL_FILE_SUFFIXES and not p.name.lower().startswith("readme"):
            found.append(p)
    yield from sorted(found, key=lambda q: q.relative_to(root).as_posix())
