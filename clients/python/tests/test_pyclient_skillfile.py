"""The skill-file parser, and every skill file shipped in the repository's skills/ folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from skillcache_client.skillfile import (
    SKILL_NAME_RE,
    SkillFileError,
    iter_skill_files,
    parse_skill_file,
    parse_skill_text,
    placeholders,
    render,
)

GOOD = """\ufeff
---
name: refund-policy
description: "Refund rules: the short version"
# a comment
fields:
  order_status: delivered
  customer_tier: 'gold'
  note: ""
  when: 10:30
---

# SKILL

Status {{order_status}}, tier {{ customer_tier }}, note [{{note}}].
"""


def test_parse_full_front_matter() -> None:
    s = parse_skill_text(GOOD.replace("\n", "\r\n"))
    assert s == {
        "name": "refund-policy",
        "description": "Refund rules: the short version",
        "fields": {"order_status": "delivered", "customer_tier": "gold", "note": "", "when": "10:30"},
        "text": "# SKILL\n\nStatus {{order_status}}, tier {{ customer_tier }}, note [{{note}}].",
    }


def test_minimal_file_and_body_fences() -> None:
    s = parse_skill_text("---\nname: a\n---\nbody\n---\nmore body\n")
    assert s == {"name": "a", "description": None, "fields": {}, "text": "body\n---\nmore body"}


def test_placeholders_and_render() -> None:
    text = "{{a}} {{ b }} {{a}} {{ not-a-field }} {c}"
    assert placeholders(text) == ["a", "b"]
    assert render(text, {"a": "1", "b": "2"}) == "1 2 1 {{ not-a-field }} {c}"
    assert render("{{a}} {{z}}", {"a": "x"}) == "x {{z}}"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("name: a\n", "missing front matter"),
        ("---\nname: a\n", "unterminated"),
        ("---\nname: Bad Name\n---\nx", "invalid skill name"),
        ("---\ndescription: d\n---\nx", "no 'name'"),
        ("---\nname: a\n---\n\n  \n", "body is empty"),
        ("---\nname: a\nfeilds:\n  x: 1\n---\nx", "unknown key 'feilds'"),
        ("---\nname: a\nname: b\n---\nx", "duplicate key"),
        ("---\nname: a\nfields: x\n---\nx", "indented mapping"),
        ("---\nname: a\nfields:\n  x: 1\n  x: 2\n---\nx", "duplicate field"),
        ("---\nname: a\nfields:\n  1x: 1\n---\nx", "invalid field name"),
        ("---\nname: a\nfields:\n\tx: 1\n---\nx", "tabs"),
        ("---\nname: a\n  x: 1\n---\nx", "unexpected indented line"),
        ("---\nname: a\njust words\n---\nx", "expected 'key: value'"),
        ("---\nname: a\nfields:\n  x: 1\n---\n{{x}} {{y}}", "undeclared field(s): y"),
    ],
)
def test_errors(source: str, message: str) -> None:
    with pytest.raises(SkillFileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_skill_text(source, "f.md")


def test_error_names_file_and_line() -> None:
    with pytest.raises(SkillFileError) as ei:
        parse_skill_text("---\nname: a\nbogus: 1\n---\nx", "skills/a.md")
    assert str(ei.value).startswith("skills/a.md:3: ")
    assert (ei.value.path, ei.value.line) == ("skills/a.md", 3)


def test_iter_skill_files(tmp_path: Path) -> None:
    for rel in ["b.md", "a.markdown", "README.md", "notes.txt", "sub/c.md", ".hidden/d.md", "_drafts/e.md"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("---\nname: x\n---\nx")
    assert [p.relative_to(tmp_path).as_posix() for p in iter_skill_files(tmp_path)] == [
        "a.markdown", "b.md", "sub/c.md",
    ]
    assert list(iter_skill_files(tmp_path / "notes.txt")) == [tmp_path / "notes.txt"]  # a file: as given
    with pytest.raises(FileNotFoundError):
        list(iter_skill_files(tmp_path / "missing"))


def test_non_utf8_file(tmp_path: Path) -> None:
    (tmp_path / "x.md").write_bytes(b"---\nname: x\n---\n\xff\xfe")
    with pytest.raises(SkillFileError, match="not UTF-8"):
        parse_skill_file(tmp_path / "x.md")


# ---- the shipped skills ----------------------------------------------------------------------

EXPECTED = {
    "account-security": {"verification_level"},
    "escalation-playbook": {"queue_load"},
    "refund-policy": {"order_status", "customer_tier"},
    "shipping-faq": {"region"},
    "style-guide": set(),
    "tool-specs": set(),
}


def test_shipped_skill_set(skills_dir: Path) -> None:
    files = list(iter_skill_files(skills_dir))
    assert [p.stem for p in files] == sorted(EXPECTED)
    assert (skills_dir / "README.md").is_file()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shipped_skill(skills_dir: Path, name: str) -> None:
    s = parse_skill_file(skills_dir / f"{name}.md")
    assert s["name"] == name and SKILL_NAME_RE.fullmatch(s["name"])
    assert s["description"]
    assert set(s["fields"]) == EXPECTED[name]
    assert set(placeholders(s["text"])) == set(s["fields"])  # every field is used; every use is declared
    assert all(v for v in s["fields"].values())  # non-empty defaults
    words = len(render(s["text"], s["fields"]).split())
    assert 250 <= words <= 900, words
    assert "<|" not in s["text"] and "|>" not in s["text"]  # no special-token spellings
    assert s["text"].startswith(f"# SKILL: {name.upper().replace('-', '_')}")


def test_refund_policy_decisions_are_one_word(skills_dir: Path) -> None:
    text = parse_skill_file(skills_dir / "refund-policy.md")["text"]
    assert "APPROVE" in text and "DENY" in text


def test_tool_specs_cover_every_tool(skills_dir: Path) -> None:
    text = parse_skill_file(skills_dir / "tool-specs.md")["text"]
    for tool in ("search_orders", "get_order", "issue_refund", "escalate_ticket"):
        assert f'"name": "{tool}"' in text and f"## {tool}" in text
